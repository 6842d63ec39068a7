"""TRL's experimental ``AsyncDistillationTrainer`` on hf_fused: after ``apply_fused_loss(trainer.model)`` its student
loss against the teacher's top-k log-probs comes from :func:`hf_fused.ops.sparse_distillation_loss`, with exactly the
stock trainer's objective.

The teacher is a stand-in at TRL's own client boundary: TRL's rollout loop (``_AsyncRolloutLoop``, which the trainer's
rollout worker runs) generates and scores each sample, its two HTTP calls answered in-process (``_post``: the
student's ``/v1/completions`` with a fixed completion, the teacher's with vLLM's ``prompt_logprobs`` response, the
top-k candidates and the realized token per position, ranked, from a tiny teacher model in float64). So TRL's parsing,
padding to ``teacher_top_k + 1`` slots, packing and narrowing (``β > 0``) all run; no network. The scored samples reach
the trainer through its injected rollout worker, and weight sync goes to a no-op transfer (TRL's own test seams).

Each parity test trains the stock trainer and the patched one from the same saved student, samples and seed for two
optimizer steps (gradient accumulation 2, two packed samples per micro-batch) and compares, at every step, every
logged metric (``loss``, ``grad_norm``, ``jsd``, ``entropy``, ``teacher_entropy``, and per teacher
``teacher_jsd/<id>``, ``teacher_entropy/<id>``, ``teacher_token_frac/<id>``) and every parameter's gradient, then
every parameter, to ``1e-5`` relative; and counts the calls: the patched trainer runs hf_fused's op on every loss and
TRL's chunk function never. With ``bf16=True`` (autocast over fp32 weights) TRL's loss multiplies fp32 copies of
the bf16 hidden states and the fp32 weight; hf_fused meets them in fp32 too: the metrics hold the same bounds at both
steps, the gradients at the first; after it the bf16 backbone's roundings spread both runs (a hidden-state gradient
1e-7 apart in fp32 can round 2⁻⁸ apart in bf16), so the second step's gradients and the final parameters are held to
the bf16 twins' rule: the patched run no further from the fp32 run than the stock bf16 run (1.25×).
"""

from __future__ import annotations

import asyncio
import os
import queue
import types

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import hf_fused
import hf_fused.integrations.trl.async_distillation as async_integration
from grpo_harness import FixedRollouts, NoWeightTransfer
from models import EOS_ID, GradRecorder, assert_same_training, PAD_ID, WORDS, WORD_VOCAB, make_tokenizer, make_word_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trainer_module = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
worker_module = pytest.importorskip("trl.experimental.async_distillation.async_rollout_worker")

RTOL = 1e-5
TOP_K = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


# ----------------------------------------------------------------------------------------------------------------
# The stand-in servers


def _teacher(seed: int) -> LlamaForCausalLM:
    """A 2-layer, hidden-48 Llama over the student's vocabulary, its head scaled so that its top-k is peaked."""
    config = LlamaConfig(vocab_size=WORD_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD_ID,
                         eos_token_id=EOS_ID, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)
    return model


class _Servers:
    """Answers the rollout loop's ``_post(base_url, path, payload, timeout)``: the student's server with a completion
    fixed by the prompt (deterministic, so every run sees the same samples), a teacher's with vLLM's
    ``prompt_logprobs`` for the sequence it is handed (``None`` at position 0; else the top ``prompt_logprobs``
    candidates and the realized token, ``{id: {"logprob", "rank"}}``, from the teacher's float64 log-softmax at
    ``temperature``)."""

    def __init__(self, student_url: str, teachers: dict):
        self.student_url, self.teachers = student_url, teachers  # url -> model

    async def __call__(self, base_url, path, payload, timeout, max_retries=3):
        assert path == "/v1/completions"
        if base_url == self.student_url:
            g = torch.Generator().manual_seed(sum(payload["prompt"]) * 31 + len(payload["prompt"]))
            n = int(torch.randint(3, payload["max_tokens"] + 1, (), generator=g))
            tokens = torch.randint(len(WORDS) // 4, WORD_VOCAB, (n,), generator=g).tolist()
            return {"choices": [{"token_ids": tokens}]}
        model = self.teachers[base_url]
        ids = torch.tensor([payload["prompt"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].double() / payload["temperature"], dim=-1)
        response = [None]
        for position in range(1, ids.shape[1]):
            row = logprobs[position - 1]
            ranked = torch.argsort(row, descending=True).tolist()
            top = ranked[: payload["prompt_logprobs"]]
            realized = int(ids[0, position])
            entries = {str(t): {"logprob": float(row[t]), "rank": ranked.index(t) + 1}
                       for t in dict.fromkeys(top + [realized])}
            response.append(entries)
        return {"choices": [{"prompt_logprobs": response}]}


def _scored_samples(prompts: Dataset, teachers: dict, *, top_k=TOP_K, temperature=1.0, max_tokens=6) -> list:
    """Every row of ``prompts`` generated and scored by TRL's ``_AsyncRolloutLoop`` against the stand-in servers:
    its ``RolloutSample``s, in order."""
    urls = {teacher_id: f"http://teacher-{teacher_id}" for teacher_id in teachers}
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    value = types.SimpleNamespace(value=0)
    loop = worker_module._AsyncRolloutLoop(
        model_name="student", dataset=prompts, processing_class=tokenizer, eos_token_ids=[EOS_ID],
        rollout_buffer=queue.Queue(), model_version_value=value, heartbeat_value=value, failed_event=None,
        exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(), vllm_server_url="http://student",
        teacher_server_urls=urls, teacher_top_k=top_k, teacher_temperature=temperature, max_tokens=max_tokens)
    loop.teacher_model_names = {teacher_id: teacher_id for teacher_id in teachers}
    loop._post = _Servers("http://student", {urls[t]: model for t, model in teachers.items()})
    return [asyncio.run(loop._generate_and_score_one(i, row)) for i, row in enumerate(prompts)]


def _prompts(n=12, teacher_ids=None) -> Dataset:
    """``n`` one-turn prompts of three words (a run consumes 8 samples; the data loader reads one batch ahead)."""
    g = torch.Generator().manual_seed(7)
    rows = {"prompt": [[{"role": "user", "content": " ".join(WORDS[j] for j in
                                                           torch.randint(0, len(WORDS), (3,), generator=g).tolist())}]
                       for _ in range(n)]}
    if teacher_ids:
        rows["teacher_id"] = [teacher_ids[i % len(teacher_ids)] for i in range(n)]
    return Dataset.from_dict(rows)


# ----------------------------------------------------------------------------------------------------------------
# Harness




class _Counting:
    """Counts calls of hf_fused's op (as the integration calls it) and of TRL's chunk function."""

    def __init__(self, monkeypatch):
        self.hf_fused = self.trl = 0
        op, chunk = async_integration.sparse_distillation_loss, trainer_module._jsd_loss_chunk

        def sparse_distillation_loss(*args, **kwargs):
            self.hf_fused += 1
            return op(*args, **kwargs)

        def _jsd_loss_chunk(*args, **kwargs):
            self.trl += 1
            return chunk(*args, **kwargs)

        monkeypatch.setattr(async_integration, "sparse_distillation_loss", sparse_distillation_loss)
        monkeypatch.setattr(trainer_module, "_jsd_loss_chunk", _jsd_loss_chunk)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("student")
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    make_word_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _train(student_dir, tmp_path, samples, monkeypatch, *, patch, teacher_ids=("default",), **config):
    """One run of ``AsyncDistillationTrainer`` on ``samples``; ``patch``: hf_fused applied to ``trainer.model`` after
    the trainer is built (it loads the student itself). Returns ``(trainer, logs, grads per step, counting)``."""
    from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer

    # TRL reads the CUDA device's name for its MFU metric at construction; there is none here.
    monkeypatch.setattr(trainer_module, "get_peak_flops_per_device", lambda *args, **kwargs: None)
    args = AsyncDistillationConfig(
        output_dir=str(tmp_path / ("fused" if patch else "stock")),
        # fp32 runs are held to 1e-5 at both steps: eager attention's backward is plain matmuls, while SDPA's CPU
        # kernel turned a 4e-7 difference in its upstream gradient into 1.6e-4 at one position (second step, AVX2)
        model_init_kwargs={"attn_implementation": "sdpa" if config.get("bf16") else "eager"},
        dtype="float32", use_cpu=True, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        token_budget=0, teacher_top_k=TOP_K, teacher_server_urls={t: f"http://teacher-{t}" for t in teacher_ids},
        logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-2, optim="sgd", seed=0,
        disable_tqdm=True, **config)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    recorder = GradRecorder()
    trainer = AsyncDistillationTrainer(model=student_dir, args=args, train_dataset=_prompts(len(samples)),
                                       processing_class=tokenizer, callbacks=[recorder],
                                       rollout_worker=FixedRollouts(samples), weight_transfer=NoWeightTransfer())
    if patch:
        hf_fused.apply_fused_loss(trainer.model)
    counting = _Counting(monkeypatch)
    trainer.train()
    logs = [{k: v for k, v in entry.items() if not _is_timing(k)} for entry in trainer.state.log_history]
    if patch:
        hf_fused.remove_fused_loss(trainer.model)
    return trainer, logs, recorder.steps, counting


def _is_timing(key: str) -> bool:
    return (key.startswith(("perf/", "train_")) or "runtime" in key or "per_second" in key or "wait" in key
            or "time_in_queue" in key or "total_flos" in key)


def _assert_no_further_from_fp32(got, stock, fp32, ratio=1.25):
    """The bf16 twins after a step: the patched run's second-step gradients and final parameters no further from
    the fp32 run's than the stock bf16 run's (``ratio`` times, in norm per tensor)."""
    pairs = [(got[2][1], stock[2][1], fp32[2][1])]
    pairs.append(tuple({n: p.detach() for n, p in run[0].model.named_parameters()} for run in (got, stock, fp32)))
    for ours, theirs, exact in pairs:
        for name in exact:
            err, stock_err = (ours[name] - exact[name]).norm(), (theirs[name] - exact[name]).norm()
            assert err <= ratio * stock_err + 1e-7 * exact[name].norm(), (name, float(err), float(stock_err))


def _parity(student_dir, tmp_path, monkeypatch, samples, **config):
    stock = _train(student_dir, tmp_path, samples, monkeypatch, patch=False, **config)
    monkeypatch.undo()
    fused = _train(student_dir, tmp_path, samples, monkeypatch, patch=True, **config)
    if config.get("bf16"):
        # One step to RTOL; after it, bf16 autocast's rounding of the backbone's activations and gradients (a value
        # on a bf16 rounding boundary flips by 2⁻⁸ for a 1e-7 difference in fp32) moves both runs apart from the
        # fp32 run's: the patched one no further than the stock one.
        assert_same_training(fused, stock, steps_at_rtol=1)
        monkeypatch.undo()
        fp32 = _train(student_dir, tmp_path, samples, monkeypatch, patch=False, **dict(config, bf16=False))
        _assert_no_further_from_fp32(fused, stock, fp32)
    else:
        assert_same_training(fused, stock)
    assert stock[3].hf_fused == 0 and stock[3].trl > 0
    assert fused[3].trl == 0 and fused[3].hf_fused == 4  # 2 steps × 2 micro-batches
    return stock, fused


# ----------------------------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def samples():
    return _scored_samples(_prompts(), {"default": _teacher(3)})


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta,add_tail_bucket", [(0.0, True), (0.0, False), (1.0, True), (0.5, True)],
                         ids=["forward-kl", "forward-kl-renormalized", "reverse-kl", "jsd"])
def test_async_distillation_matches_trl(beta, add_tail_bucket, bf16, student_dir, samples, tmp_path, monkeypatch):
    """TRL's default (``β = 0``: forward KL on the teacher's top-k with the tail bucket), its renormalized variant,
    and the narrowed supports of ``β = 1`` (the realized token) and ``β = 0.5`` (the teacher's top-1 and the realized
    token, deduplicated), in fp32 and under ``bf16=True``."""
    _, (_, logs, _, _) = _parity(student_dir, tmp_path, monkeypatch, samples, beta=beta,
                                 add_tail_bucket=add_tail_bucket, bf16=bf16)
    assert all(key in logs[0] for key in ("jsd", "entropy", "teacher_entropy")) and logs[0]["jsd"] > 0


def test_teacher_temperature(student_dir, tmp_path, monkeypatch):
    """``teacher_temperature`` tempers the student's logits in TRL's loss (the server tempers the teacher's)."""
    samples = _scored_samples(_prompts(), {"default": _teacher(3)}, temperature=0.7)
    _parity(student_dir, tmp_path, monkeypatch, samples, teacher_temperature=0.7)


def test_multi_teacher_statistics(student_dir, tmp_path, monkeypatch):
    """Two teachers (MOPD): each sample routed by its ``teacher_id`` to its teacher's server; the per-teacher
    ``teacher_jsd``, ``teacher_entropy`` and ``teacher_token_frac`` are stock TRL's."""
    ids = ("math", "code")
    samples = _scored_samples(_prompts(teacher_ids=list(ids)), {"math": _teacher(3), "code": _teacher(4)})
    assert {s.teacher_id for s in samples} == set(ids)
    _, (_, logs, _, _) = _parity(student_dir, tmp_path, monkeypatch, samples, teacher_ids=ids, beta=0.5)
    for teacher_id in ids:
        for key in ("teacher_jsd", "teacher_entropy", "teacher_token_frac"):
            assert f"{key}/{teacher_id}" in logs[0]


def test_wider_support_than_the_top_k(student_dir, tmp_path, monkeypatch):
    """A realized token outside the teacher's top-k widens its position to ``k + 1`` candidates (vLLM reports it);
    the other positions pad the last slot with ``-1`` / ``-inf``: both kinds are in the samples, and the loss is
    stock TRL's."""
    samples = _scored_samples(_prompts(), {"default": _teacher(5)}, top_k=2)
    slots = np.concatenate([(s.teacher_topk_ids[s.completion_mask == 1] != -1).sum(-1) for s in samples])
    assert {2, 3} <= set(slots.tolist())
    _parity(student_dir, tmp_path, monkeypatch, samples)


def test_unpatched_student_uses_trls_function(student_dir, samples, tmp_path, monkeypatch):
    """With another model patched in the process (the inventory installed), an unpatched student's loss is TRL's."""
    other = hf_fused.apply_fused_loss(make_word_model(seed=1))
    try:
        _, _, _, counting = _train(student_dir, tmp_path, samples, monkeypatch, patch=False)
    finally:
        hf_fused.remove_fused_loss(other)
    assert counting.hf_fused == 0 and counting.trl > 0


def test_direct_call_matches_trls_chunked_function():
    """``_chunked_jsd_loss`` called by name with a patched model's lm_head weight (no trainer): the five outputs of
    TRL's function (summed loss, divergence, entropy, teacher entropy, per-teacher statistics), and the gradients."""
    model = make_word_model()
    head = model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    n, k = 17, 5
    hidden = torch.randn(n, head.weight.shape[1], generator=g)
    ids = torch.randint(0, WORD_VOCAB, (n, k), generator=g)
    valid = torch.rand(n, k, generator=g) > 0.2
    valid[:, 0] = True
    teacher = torch.log_softmax(torch.randn(n, WORD_VOCAB, generator=g) * 3, -1).gather(1, ids)
    index = torch.randint(0, 2, (n,), generator=g)
    args = (None, 1.0, None, torch.where(valid, ids, -1), teacher, valid, 0.5, 0.8, True, index, 2, 4)
    original = trainer_module._chunked_jsd_loss
    h_ref = hidden.clone().requires_grad_()
    ref = original(h_ref, head.weight, *args)
    ref[0].backward()
    ref_grads = h_ref.grad, head.weight.grad.clone()
    head.weight.grad = None
    hf_fused.apply_fused_loss(model)
    try:
        assert getattr(trainer_module._chunked_jsd_loss, "__hf_fused__", False)
        h = hidden.clone().requires_grad_()
        out = trainer_module._chunked_jsd_loss(h, model.get_output_embeddings().weight, *args)
        out[0].backward()
    finally:
        hf_fused.remove_fused_loss(model)
    for ours, theirs in zip(out, ref):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert (ours.detach() - theirs.detach()).abs().max() <= RTOL * theirs.abs().max() + 1e-7
    for ours, theirs in zip((h.grad, model.get_output_embeddings().weight.grad), ref_grads):
        assert (ours - theirs).abs().max() <= RTOL * theirs.abs().max() + 1e-7
