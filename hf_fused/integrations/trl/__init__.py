"""TRL's fused-LM-head protocol, served by hf_fused's ops on models patched by :func:`hf_fused.apply_fused_loss`.

TRL ≥ 1.16's ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``RLOOTrainer``, ``GRPOTrainer`` and the experimental
``AsyncGRPOTrainer`` (its packed-tree rows as ``shift_labels``; patched after it is built) install their own
chunked head with ``trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`` and
then call ``model(..., labels=labels, fused_lm_head=True)``, which returns a ``FusedCausalLMOutput``
(``loss``, ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``, ``label_mask``,
``aux_loss``). That head runs the backbone and reads ``lm_head.weight`` itself, so a patched forward is
bypassed. The one switch, :func:`hf_fused.apply_fused_loss`, makes hf_fused answer that call instead, whatever
the order:

* **patched before the trainer is built**: ``add_fused_lm_head`` is wrapped (in ``trl.trainer.utils`` and in every
  loaded TRL module that imported it; :data:`.hooks.TRL_FUSED_HEAD`, one entry of the inventory in
  :mod:`hf_fused.integrations`) when TRL's trainers are imported, at once if they already are: patching itself
  never imports TRL (:mod:`.hooks`). For a patched model the wrapper only
  records the trainer's head options; hf_fused's forward answers ``fused_lm_head=True``. A model that is not
  patched gets TRL's head, except a reference model added while a trainer whose policy is patched is being
  built: it is patched too (same ``tile_budget_bytes`` / ``backend``), so reference log-probs come from
  hf_fused's ops as well.
* **patched after**: TRL's head is already the model's forward (possibly wrapped by accelerate's autocast);
  its options are read from it (:func:`serve_trl_fused_head`) and the patched forward, which sits outside it,
  answers ``fused_lm_head=True``. Without ``fused_lm_head`` the call passes through TRL's head unchanged, so
  generation is the original.

The experimental ``ORPOTrainer`` and ``CPOTrainer`` never install that head (they read the full logits); for a patched
model their ``concatenated_forward`` is answered through the same call (:mod:`.concatenated_forward`), and
``OnlineDPOTrainer``'s ``_forward`` by the patched forward's log-probs (:mod:`.online_dpo`).

:func:`hf_fused.remove_fused_loss` takes the options off the model again and, where hf_fused had withheld TRL's
head (patched before the trainer was built), installs TRL's own head with them (:func:`forget_trl_head`).

The answer (:func:`trl_fused_forward`) runs the model's original forward with ``labels=None`` and the lm_head
call intercepted (:func:`hf_fused.model.intercept_lm_head`), and computes every field TRL's head would return from
the states lm_head receives: log-probs, entropy and the gradient-free statistics (``is_top1``, ``mean_logits``,
``log_sum_sq_probs``) in one pass with :func:`hf_fused.ops.linear_logprobs` (``statistics=``), ``loss`` and
``label_mask`` as TRL defines them. A PEFT adapter on lm_head is part of the head (TRL's head would read the bare weight).

TRL's distillation trainers do not use this protocol: their loss is a student–teacher divergence. For a patched
student it comes from :func:`hf_fused.ops.linear_distillation_loss` (:mod:`.divergence`): ``DistillationTrainer``'s
``_chunked_divergence_loss`` is answered from the hidden states and heads TRL passes (:mod:`.distillation`), and
``GKDTrainer.compute_loss`` from both models' hidden states instead of their full logits (:mod:`.gkd`).

While a TRL trainer is built around a patched model, its "no PEFT adapter on lm_head" check is let through:
hf_fused computes the head with the adapter, so a LoRA adapter on lm_head trains.

If TRL's head changes shape (``add_fused_lm_head``'s signature, ``FusedCausalLMOutput``'s fields, the
closure of the forward it installs), nothing is wrapped and a fused call raises, saying why.

Modules: :mod:`.protocol` (TRL 1.16's shape, recognised or refused), :mod:`.hooks` (installation, reference
models, the lm_head-adapter check), :mod:`.head` (the answer to a fused call), :mod:`.divergence` (a patched
student's divergence from a teacher), :mod:`.distillation` and :mod:`.gkd` (the two distillation trainers).
"""

from .head import trl_fused_forward
from .hooks import forget_trl_head, lm_head_adapter_hidden_from_trl, serve_trl_fused_head, trl_head_options
from .protocol import TrlHeadOptions, TrlProtocolError

__all__ = [
    "TrlHeadOptions",
    "TrlProtocolError",
    "forget_trl_head",
    "lm_head_adapter_hidden_from_trl",
    "serve_trl_fused_head",
    "trl_fused_forward",
    "trl_head_options",
]
