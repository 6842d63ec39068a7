"""Integrations with the libraries that call a model in their own ways: transformers' ``Trainer`` and TRL.

* :mod:`hf_fused.integrations.transformers_trainer`: ``Trainer`` gathers real logits as predictions from a patched
  model; ``use_liger_kernel=True`` applies Liger's layer kernels, not its loss.
* :mod:`hf_fused.integrations.trl`: TRL's trainers call ``model(..., fused_lm_head=True)`` (their own fused LM head);
  on a model patched by :func:`hf_fused.apply_fused_loss` hf_fused's ops answer that call. For a patched student,
  ``DistillationTrainer``'s divergence and ``GKDTrainer``'s loss come from
  :func:`hf_fused.ops.linear_distillation_loss`; the experimental ``AsyncDistillationTrainer``'s loss against a
  teacher's top-k log-probs from :func:`hf_fused.ops.sparse_distillation_loss`, and so does
  ``ServerDistillationTrainer``'s; the experimental ``ORPOTrainer``'s and ``CPOTrainer``'s log-probs, NLL and logits
  metrics from TRL's fused-head call, ``OnlineDPOTrainer``'s completion log-probs from the patched forward.

They plug into the model layer through its extension point (:mod:`hf_fused.model.extensions`; registered when
``hf_fused`` is imported): the fused-head keyword is answered by :func:`~hf_fused.integrations.trl.trl_fused_forward`,
the distillation keyword (GKD's student call) by :func:`~hf_fused.integrations.trl.divergence.distillation_forward`,
each patch installs the process-wide patches below, each removal undoes what was done for that model (a TRL trainer's
head options; TRL's own head where hf_fused withheld it) and the removal of the last patched model uninstalls the
patches. The model layer never imports this package.

Process-wide patches: one inventory (:data:`~hf_fused.integrations.inventory.PATCHES`), each entry a
:class:`~hf_fused.integrations.patching.ThirdPartyPatch` with ``install()`` and ``uninstall()``;
:func:`uninstall_all` puts every original back.

Trigger, for every entry: the first :func:`~hf_fused.apply_fused_loss` of the process (:func:`install_all`),
applied when the module in the second column is imported (at once if it is).

| Entry | Module (trigger) | Target | Why | Versions | How every other call passes through |
|---|---|---|---|---|---|
| ``PREDICTION_STEP`` | ``transformers.trainer`` | ``Trainer.prediction_step`` | Trainer gathers ``outputs.logits`` for metrics and ``predict()``: a patched model runs its original forward there | transformers >= 5.0 | loss-only steps and unpatched models: Trainer's own method |
| ``LIGER_KERNEL`` | ``transformers.trainer`` | ``apply_liger_kernel`` (the name ``Trainer.train`` calls) | Liger's fused cross-entropy replaces the instance's forward and would drop hf_fused's | transformers >= 5.0, Liger >= 0.8 | unpatched models: Liger's call; patched ones get Liger's layer kernels without its loss |
| ``TRL_FUSED_HEAD`` | ``trl.trainer.utils`` | ``add_fused_lm_head``, there and in each TRL module that imported it | TRL's trainers install a chunked head that reads ``lm_head.weight``, bypassing the patched forward | TRL 1.16 (checked at install; another shape: nothing wrapped, a warning) | unpatched models, except a patched policy's reference model: TRL's head |
| ``TRL_HEAD_ADAPTER_CHECKS`` (5) | ``trl.trainer.{sft,dpo,kto,rloo,grpo}_trainer`` | ``__init__`` of ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``RLOOTrainer``, ``GRPOTrainer`` | TRL refuses a PEFT adapter on lm_head, which hf_fused computes with; names the trainer being built (its reference model is patched like its policy) | TRL 1.16 | unpatched models: TRL's ``__init__`` and check |
| ``TRL_DISTILLATION`` | ``trl.trainer.distillation_trainer`` | ``_chunked_divergence_loss`` (the name ``DistillationTrainer._compute_loss`` calls) and ``DistillationTrainer.__init__`` | TRL's kernel reads ``lm_head.weight`` and bypasses the patched forward (and TRL refuses a PEFT adapter on lm_head): hf_fused answers a patched student's divergence in one pass, the adapter included; under FSDP TRL 1.16 leaves the teacher unprepared (trl#2580), so ``__init__`` prepares it with TRL's ``prepare_fsdp`` (the fix of trl#6573; :mod:`~hf_fused.integrations.trl.teacher_fsdp`, to go once TRL includes it) | TRL 1.16 (the function's parameters checked at install; another shape: nothing rebound, a warning) | a student that is not patched: TRL's function and kernel; unpatched models: TRL's ``__init__``, check and teacher; a teacher TRL wrapped itself: left as is |
| ``TRL_GKD`` | ``trl.experimental.gkd.gkd_trainer`` | ``GKDTrainer.compute_loss`` and ``GKDTrainer.__init__`` | GKD computes its divergence from both models' full logits: hf_fused computes it from hidden states for a patched student; its teacher under FSDP as ``TRL_DISTILLATION``'s | TRL 1.16 (``generalized_jsd_loss``'s parameters and ``compute_loss``'s calls checked at install; another shape: nothing wrapped, a warning) | an unpatched student: TRL's methods and teacher; a subclass's own ``generalized_jsd_loss``, ``return_outputs=True``, an unreadable teacher: TRL's method and a one-time warning saying why and what to do; a teacher TRL wrapped itself: left as is |
| ``TRL_ASYNC_DISTILLATION`` | ``trl.experimental.async_distillation.async_distillation_trainer`` | ``_chunked_jsd_loss`` (the name ``AsyncDistillationTrainer._compute_loss`` calls) and ``AsyncDistillationTrainer._compute_loss`` (names the student of the call) | TRL computes the student's loss against the teacher's top-k log-probs from fp32 ``[chunk, V]`` logits of ``lm_head.weight``, recomputed in backward: hf_fused answers a patched student's in one pass (:mod:`~hf_fused.integrations.trl.async_distillation`) | TRL 1.16 (both signatures checked at install; another shape: nothing rebound, a warning) | a student that is not patched: TRL's function |
| ``TRL_SERVER_DISTILLATION`` | ``trl.experimental.server_distillation.server_distillation_trainer`` | ``ServerDistillationTrainer.compute_loss`` | TRL builds the student's full ``[B, T, V]`` logits for a loss on the teacher's top-k: hf_fused computes a patched student's from its hidden states (:mod:`~hf_fused.integrations.trl.server_distillation`) | TRL 1.16 (the methods' parameters checked at install; another shape: nothing wrapped, a warning) | an unpatched student, ``return_outputs=True``, ``reverse_kl_top_1_mode="argmax"``: TRL's method |
| ``TRL_ORPO``, ``TRL_CPO`` | ``trl.experimental.orpo.orpo_trainer``, ``trl.experimental.cpo.cpo_trainer`` | ``ORPOTrainer.concatenated_forward``, ``CPOTrainer.concatenated_forward`` | both build the model's full ``[B, T, V]`` logits for their log-probs, NLL and logits metrics: hf_fused computes them for a patched model from its hidden states (:mod:`~hf_fused.integrations.trl.concatenated_forward`) | TRL 1.16 (``concatenated_forward``'s and ``concatenated_inputs``' parameters checked at install; another shape: nothing wrapped, a warning) | an unpatched model: TRL's method; an encoder-decoder, a subclass's own ``get_batch_loss_metrics``, labels that are not the input ids: TRL's method and a one-time warning saying why |
| ``TRL_ONLINE_DPO`` | ``trl.experimental.online_dpo.online_dpo_trainer`` | ``OnlineDPOTrainer._forward`` | it builds the model's full ``[B, T, V]`` logits for the completions' log-probs (policy and reference): hf_fused computes them for a patched model from its hidden states (:mod:`~hf_fused.integrations.trl.online_dpo`) | TRL 1.16 (``_forward``'s parameters checked at install; another shape: nothing wrapped, a warning) | an unpatched model: TRL's method; a batch with vision inputs: TRL's method and a one-time warning |
| the import hook | any watched module above | a finder first on ``sys.meta_path`` (:mod:`~hf_fused.integrations.import_hooks`) | apply the entries above when their module is imported, without importing it | Python's ``importlib.abc`` | other imports: it answers for the watched names only; modules keep their loader; gone once none is pending |

A wrapper that someone else has wrapped since cannot be taken out of their chain on uninstall: it then
passes every call straight through.

Per model, not process-wide (undone by :func:`~hf_fused.remove_fused_loss` or at the end of the call):
the model's ``forward`` and ``_replicate_for_data_parallel`` (the model layer); ``lm_head.forward`` during one
call (the intercept); ``get_output_embeddings`` during a TRL trainer's ``__init__``; the TRL head options of a
trainer (``_hf_fused_trl_head``), removed with the patch, TRL's own head then installed where hf_fused withheld it;
under tensor parallelism, a GRPO or RLOO trainer's ``accelerator`` and its TRL module's ``gather`` and
``gather_object`` during each of its scoring and loss calls (:mod:`~hf_fused.integrations.trl.tensor_parallel`).
"""

from ..model import ModelExtension, patched_models, register_extension
from .inventory import PATCHES, install_all, rebinds, uninstall_all
from .trl.divergence import CALL_KEYWORD as DISTILLATION_KEYWORD
from .trl.divergence import distillation_forward
from .trl.head import trl_fused_forward
from .trl.hooks import forget_trl_head, serve_trl_fused_head


def _install_patches(causal_lm) -> None:
    install_all()


def _uninstall_patches_after_the_last_model(causal_lm) -> None:
    if not patched_models():
        uninstall_all()


register_extension(ModelExtension(
    "third_party_patches", on_patch=_install_patches, on_remove=_uninstall_patches_after_the_last_model,
))
register_extension(ModelExtension(
    "trl_fused_head", call_keyword="fused_lm_head", forward=trl_fused_forward, on_patch=serve_trl_fused_head,
    on_remove=forget_trl_head,
))
register_extension(ModelExtension(
    "distillation", call_keyword=DISTILLATION_KEYWORD, forward=distillation_forward,
))

__all__ = ["PATCHES", "install_all", "rebinds", "uninstall_all"]
