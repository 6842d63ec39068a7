"""TRL's experimental ``ServerDistillationTrainer`` on hf_fused: for a patched student its loss against the teacher
server's top-k log-probs comes from :func:`hf_fused.ops.sparse_distillation_loss` on the student's hidden states, with
exactly the stock trainer's objective (no ``[B, T, V]`` logits).

The teacher server is a stand-in at TRL's client boundary: ``VLLMClient``'s ``_get`` (``/v1/models``) and ``_post``
(``/v1/completions`` with ``prompt_logprobs``) are answered in-process from a tiny float64 teacher, in vLLM's response
format (its import gate and server check let through: the client itself needs neither) (per position the top candidates and the realized token, ranked), so TRL's ``get_sequence_logprobs`` formats
them and the trainer aligns them as it does against a real server; no network.

Each parity test trains the stock trainer and the patched one (patched before or after the trainer is built) from the
same student, data and seed for two optimizer steps (TRL's on-policy generation with the tiny model, gradient
accumulation 2) and compares every logged metric and every parameter's gradient at each step, then every parameter,
to ``1e-5`` relative; the patched run never runs TRL's losses on the student's full log-probs. Under TRL's default
``bf16=True`` TRL's logits are rounded to bf16 and hf_fused's are not: the twins are held to the bounds of
``GKDTrainer``'s (``test_trl_distillation.py``).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import hf_fused
import hf_fused.integrations.trl.server_distillation as server_integration
from models import EOS_ID, GradRecorder, assert_same_training, is_timing_metric, PAD_ID, WORDS, WORD_VOCAB, make_tokenizer, make_word_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
server_module = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")
vllm_client = pytest.importorskip("trl.generation.vllm_client")

RTOL = 1e-5
# The originals, so that each run counts its own calls.
_OP = server_integration.sparse_distillation_loss
_TRL_LOSSES = {name: getattr(server_module.ServerDistillationTrainer, name) for name in (
    "_compute_server_forward_kl_loss", "_compute_server_sparse_top_1_divergence_loss")}
PROMPTS = Dataset.from_dict({"prompt": [
    " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (3,), generator=torch.Generator().manual_seed(i)).tolist())
    for i in range(16)
]})


def _teacher(seed: int = 3) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=WORD_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD_ID,
                         eos_token_id=EOS_ID, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)
    return model


@pytest.fixture
def teacher_server(monkeypatch):
    """``VLLMClient`` answering from a tiny teacher: ``/v1/models`` names it, ``/v1/completions`` returns vLLM's
    ``prompt_logprobs`` (``None`` at position 0; else the top ``prompt_logprobs`` candidates and the realized token,
    ``{id: {"logprob", "rank"}}``, from the teacher's log-softmax at the request's temperature) for each sequence."""
    teacher = _teacher()

    def _get(self, url, **kwargs):
        assert url.endswith("/v1/models")
        return {"data": [{"id": "teacher"}]}

    def _post(self, url, json=None, **kwargs):
        assert url.endswith("/v1/completions") and json["max_tokens"] == 1
        choices = []
        for sequence in json["prompt"]:
            ids = torch.tensor([sequence])
            with torch.no_grad():
                logprobs = torch.log_softmax(teacher(ids).logits[0] / json["temperature"], dim=-1)
            response = [None]
            for position in range(1, len(sequence)):
                row = logprobs[position - 1]
                ranked = torch.argsort(row, descending=True).tolist()
                top = ranked[: json["prompt_logprobs"]]
                response.append({str(t): {"logprob": float(row[t]), "rank": ranked.index(t) + 1}
                                 for t in dict.fromkeys(top + [sequence[position]])})
            choices.append({"prompt_logprobs": response})
        return {"choices": choices}

    monkeypatch.setattr(vllm_client.VLLMClient, "_get", _get)
    monkeypatch.setattr(vllm_client.VLLMClient, "_post", _post)
    # the client's own gates: vLLM is only needed by the server it talks to, and there is no server to wait for
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_client.VLLMClient, "check_server", lambda self, *args, **kwargs: None)
    return teacher




class _Counting:
    """Counts calls of hf_fused's op (as the integration calls it) and of TRL's two loss methods on the student's
    full log-probs (``_compute_server_forward_kl_loss``, ``_compute_server_sparse_top_1_divergence_loss``)."""

    def __init__(self, monkeypatch):
        self.hf_fused = self.trl = 0

        def sparse_distillation_loss(*args, **kwargs):
            self.hf_fused += 1
            return _OP(*args, **kwargs)

        monkeypatch.setattr(server_integration, "sparse_distillation_loss", sparse_distillation_loss)
        for name, method in _TRL_LOSSES.items():
            monkeypatch.setattr(server_module.ServerDistillationTrainer, name, self._counted(method))

    def _counted(self, method):
        def counted(*args, **kwargs):
            self.trl += 1
            return method(*args, **kwargs)

        return counted


def _train(model, tmp_path, monkeypatch, *, patch, **config):
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    args = dict(output_dir=str(tmp_path / str(patch)), bf16=False, max_steps=2, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                learning_rate=1e-2, disable_tqdm=True, seed=0, dataloader_num_workers=0, optim="sgd",
                max_completion_length=5, teacher_model_server_url="http://teacher:8000")
    args.update(config)
    recorder = GradRecorder()
    if patch == "before":
        hf_fused.apply_fused_loss(model)
    trainer = ServerDistillationTrainer(model=model, args=ServerDistillationConfig(**args), train_dataset=PROMPTS,
                                        processing_class=make_tokenizer(), callbacks=[recorder])
    if patch == "after":
        hf_fused.apply_fused_loss(trainer.model)
    counting = _Counting(monkeypatch)
    trainer.train()
    logs = [{k: v for k, v in entry.items() if not is_timing_metric(k)} for entry in trainer.state.log_history]
    if patch:
        hf_fused.remove_fused_loss(trainer.model)
    return trainer, logs, recorder.steps, counting


@pytest.mark.parametrize("patch", ["before", "after"])
@pytest.mark.parametrize("beta,top_k,tail", [(0.0, 4, True), (0.0, 4, False), (0.0, 1, True), (1.0, 1, True),
                                             (0.5, 1, True)],
                         ids=["forward-kl-top4", "forward-kl-top4-renormalized", "forward-kl-top1", "reverse-kl",
                              "jsd"])
def test_server_distillation_matches_trl(beta, top_k, tail, patch, teacher_server, tmp_path, monkeypatch):
    """``beta = 0`` on the teacher's top-k (with the tail bucket or renormalized), ``beta = 1`` on the realized token,
    ``beta = 0.5`` on the teacher's top-1 and the realized token, with a sampling temperature on the last."""
    config = dict(beta=beta, loss_top_k=top_k, loss_add_tail=tail, temperature=0.7 if beta == 0.5 else 1.0)
    base = make_word_model()
    stock = _train(copy.deepcopy(base), tmp_path, monkeypatch, patch=None, **config)
    fused = _train(copy.deepcopy(base), tmp_path, monkeypatch, patch=patch, **config)
    assert_same_training(fused, stock)
    assert stock[3].hf_fused == 0 and stock[3].trl == 4
    assert fused[3].hf_fused == 4 and fused[3].trl == 0  # 2 steps × 2 micro-batches, no full log-probs


def test_missing_teacher_logprobs_raise_trls_error(teacher_server, tmp_path, monkeypatch):
    """A teacher that returns no log-prob for the realized token at a completion position (``beta > 0``): the patched
    trainer raises TRL's error, as the stock one does."""
    real = vllm_client.VLLMClient._format_sequence_logprobs

    def without_actual(choice, sequence, prompt_length, top_logprobs):
        out = real(choice, sequence, prompt_length, top_logprobs)
        out["actual_logprobs"] = [[float("-inf")] for _ in out["actual_logprobs"]]
        return out

    monkeypatch.setattr(vllm_client.VLLMClient, "_format_sequence_logprobs", staticmethod(without_actual))
    for patch in (None, "before"):
        with pytest.raises(ValueError, match="missing actual-token logprobs"):
            _train(make_word_model(), tmp_path, monkeypatch, patch=patch, beta=1.0, max_steps=1)


def test_a_subclass_loss_keeps_trls_method_with_one_warning(teacher_server, tmp_path, monkeypatch):
    """A subclass with its own loss on the full log-probs: TRL's ``compute_loss`` runs (the subclass's loss is what
    trains), and one warning says why and what to do."""
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    from hf_fused.model import FusedLossBypassedWarning

    class Doubled(ServerDistillationTrainer):
        def _compute_server_forward_kl_loss(self, *args, **kwargs):
            return 2 * super()._compute_server_forward_kl_loss(*args, **kwargs)

    args = ServerDistillationConfig(output_dir=str(tmp_path / "sub"), bf16=False, max_steps=2,
                                    per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no",
                                    disable_tqdm=True, max_completion_length=5, beta=0.0, loss_top_k=2,
                                    teacher_model_server_url="http://teacher:8000")
    model = hf_fused.apply_fused_loss(make_word_model())
    trainer = Doubled(model=model, args=args, train_dataset=PROMPTS, processing_class=make_tokenizer())
    counting = _Counting(monkeypatch)
    with pytest.warns(FusedLossBypassedWarning, match="overrides _compute_server_forward_kl_loss") as caught:
        trainer.train()
    assert len([w for w in caught if issubclass(w.category, FusedLossBypassedWarning)]) == 1
    assert counting.hf_fused == 0 and counting.trl == 2
    hf_fused.remove_fused_loss(model)


def test_server_distillation_under_bf16_is_a_close_twin_of_trl(teacher_server, tmp_path, monkeypatch):
    """TRL's default ``bf16=True`` (autocast on CPU): TRL's student logits come from bf16 operands rounded to bf16,
    hf_fused's from the same operands in fp32 (as ``GKDTrainer``'s twins in ``test_trl_distillation.py``): loss and
    metrics within 3e-2, gradient cosine >= 0.999 at each step, and the patched run's parameters no further from the
    fp32 run's than the stock bf16 run's (1.25x, relative to the fp32 update)."""
    base = make_word_model()
    runs = {name: _train(copy.deepcopy(base), tmp_path, monkeypatch, patch=patch, bf16=bf16, beta=0.0, loss_top_k=4)
            for name, bf16, patch in (("stock", True, None), ("fused", True, "before"), ("fp32", False, None))}
    (_, logs_a, grads_a, counting), (_, logs_b, grads_b, _) = runs["fused"], runs["stock"]
    assert counting.hf_fused == 4 and counting.trl == 0
    for a, b in zip(logs_a, logs_b):
        assert a.keys() == b.keys()
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=3e-2, abs_tol=2e-2), (key, a[key], b[key])
    for ga, gb in zip(grads_a, grads_b):
        flat_a, flat_b = (torch.cat([g.flatten() for g in grads.values()]) for grads in (ga, gb))
        assert torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0) >= 0.999
    fp32 = dict(runs["fp32"][0].model.named_parameters())
    initial = dict(base.named_parameters())

    def distance(run):  # from the fp32 run's parameters, relative to the fp32 update
        params = dict(runs[run][0].model.named_parameters())
        return max(((params[n] - fp32[n]).norm() / (fp32[n] - initial[n]).norm()).item() for n in fp32)

    assert distance("fused") <= 1.25 * distance("stock"), (distance("fused"), distance("stock"))
