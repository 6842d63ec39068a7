"""The GRPO parity harness: scripted rollouts (TRL's ``rollout_func``), a trainer built from one :class:`Case`, and
one function that runs TRL's own ``_generate_and_score_completions`` + ``_compute_loss`` + backward and returns
everything a parity claim needs (losses, every parameter gradient, every logged metric, the log-prob tensors
computed at generation time). The policy and tokenizer are :func:`models.make_word_model` and
:func:`models.make_tokenizer`.

Nothing here depends on hf_fused: the same harness runs ``trl.GRPOTrainer`` against itself (to prove
the harness is deterministic) and against ``hf_fused.FusedGRPOTrainer``.
"""

from __future__ import annotations

import copy
import math
import os
import queue
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from trl import GRPOConfig
from trl.trainer.utils import split_tensor_dict

from models import EOS_ID, NUM_SPECIAL, WORD_VOCAB, WORDS, make_tokenizer, make_word_model
from references import dense_logps, max_rel_err

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16

#: Where the trainers run: "cpu" (CI) or "cuda" (HF_FUSED_TEST_DEVICE=cuda on a GPU machine, where TRL's head is
#: its Triton kernel on the valid rows only and hf_fused picks its GPU backend).
DEVICE = os.environ.get("HF_FUSED_TEST_DEVICE", "cpu")


def length_reward(completions, completion_ids, **kwargs):
    """Deterministic reward with within-group variance (so advantages are non-zero)."""
    return [float(sum(ids) % 7) + 0.25 * len(ids) for ids in completion_ids]


def make_rollout(*, seed: int, max_completion_length: int, sampling_logps: bool = False, sampling_noise=0.5,
                 nan_token: bool = False, prompt_len=(3, 6)):
    """A ``rollout_func`` (TRL's public hook) that returns scripted prompts/completions.

    Completions have random lengths; some end with EOS, others are truncated at ``max_completion_length``.
    With ``sampling_logps`` it also returns "inference-engine" log-probs: the model's own log-probs plus
    Gaussian noise (like a vLLM mismatch), computed densely from ``trainer.model`` so both trainers get the
    same numbers. ``nan_token`` replaces one of them by ``None`` (what vLLM returns for an unscorable token).
    """
    gen = torch.Generator().manual_seed(seed)

    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    def rollout(prompts, trainer):
        prompt_ids, completion_ids = [], []
        for i in range(len(prompts)):
            p = torch.randint(NUM_SPECIAL, WORD_VOCAB, (rint(*prompt_len),), generator=gen).tolist()
            truncated = rint(0, 2) == 0  # a third of the completions hit max_completion_length without EOS
            n = max_completion_length if truncated else rint(1, max_completion_length)
            c = torch.randint(NUM_SPECIAL, WORD_VOCAB, (n,), generator=gen).tolist()
            if not truncated:
                c[-1] = EOS_ID
            prompt_ids.append(p)
            completion_ids.append(c)
        logprobs = None
        if sampling_logps:
            logprobs = []
            model = trainer.model
            for p, c in zip(prompt_ids, completion_ids):
                ids = torch.tensor([p + c])
                lp, _ = dense_logps(model, ids, torch.ones_like(ids), len(c), trainer.temperature, torch.float32)
                lp = lp[0].cpu() + sampling_noise * torch.randn(len(c), generator=gen)
                logprobs.append(lp.tolist())
            if nan_token:
                logprobs[1][0] = None
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout


PROMPTS = [f"prompt {w} {v}" for w, v in zip(WORDS[:16], WORDS[16:32])]


def grpo_config(tmp_path, **overrides) -> GRPOConfig:
    """The harness's ``GRPOConfig`` (fp32, scripted rollouts, no vLLM, logging every step), ``overrides`` applied."""
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        gradient_accumulation_steps=1,
        learning_rate=5e-2,
        bf16=False,
        report_to=[],
        use_vllm=False,
        logging_steps=1,
        save_strategy="no",
        seed=42,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        use_cpu=DEVICE == "cpu",
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


@dataclass
class Case:
    """One trainer configuration. ``config`` goes to GRPOConfig; the rest controls the harness."""

    config: dict = field(default_factory=dict)
    arch: str = "llama"
    peft: dict | None = None  # LoraConfig kwargs
    sampling_logps: bool = False  # rollout returns inference log-probs
    nan_token: bool = False
    vllm_is: bool = False  # enable TRL's vLLM importance-sampling correction path (use_vllm flipped after init)
    off_policy_noise: float = 0.0  # replace old_per_token_logps by dense log-probs + noise
    tie: bool = False
    dtype: torch.dtype = torch.float32
    scripted: bool = True  # False: no rollout_func, TRL generates with transformers' generate()


def build_trainer(trainer_cls, case: Case, tmp_path, *, model=None, **trainer_kwargs):
    from peft import LoraConfig

    cfg = grpo_config(tmp_path, **case.config)
    if model is None:
        model = make_word_model(case.arch, dtype=case.dtype, tie=case.tie)
    if cfg.beta != 0.0 and case.peft is None:
        # TRL re-creates the reference model from config._name_or_path. Save a slightly perturbed copy there so
        # the KL term (and its gradient) is not identically zero at the first step.
        path = tmp_path / f"ref_src_{trainer_cls.__name__}"
        ref_src = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in ref_src.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        ref_src.save_pretrained(path)
        model.config._name_or_path = str(path)
    peft_config = None
    if case.peft is not None:
        peft_config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **case.peft)
    trainer = trainer_cls(
        model=model,
        reward_funcs=length_reward,
        args=cfg,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=make_tokenizer(),
        peft_config=peft_config,
        rollout_func=make_rollout(
            seed=1234,
            max_completion_length=cfg.max_completion_length,
            sampling_logps=case.sampling_logps,
            nan_token=case.nan_token,
        ) if case.scripted else None,
        **trainer_kwargs,
    )
    if case.vllm_is:
        # Exercise TRL's vLLM importance-sampling correction without vLLM: the rollout supplies the sampling
        # log-probs, and a no-op generation backend absorbs the weight sync.
        trainer.use_vllm = True
        trainer.vllm_generation = _NoVLLM()
        trainer._last_loaded_step = 0
    return trainer


class _NoVLLM:
    def sync_weights(self):
        pass


def generation_rows(trainer):
    """The rows the RepeatSampler would hand to ``_generate_and_score_completions``."""
    args = trainer.args
    n_prompts = args.generation_batch_size // args.num_generations
    return [{"prompt": PROMPTS[i]} for i in range(n_prompts) for _ in range(args.num_generations)]


@dataclass
class StepResult:
    losses: list
    grads: dict
    metrics: dict
    inputs: dict


def run_step(trainer, case: Case, *, noise_seed: int = 7) -> StepResult:
    """One generation batch: TRL's ``_generate_and_score_completions``, then ``_compute_loss`` + backward on each
    of its ``steps_per_generation`` micro-batches (gradients accumulate as in ``Trainer.training_step``)."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    inputs = trainer._generate_and_score_completions(generation_rows(trainer))
    if case.off_policy_noise:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        base, _ = dense_logps(model, ids, am, inputs["completion_ids"].size(1), trainer.temperature, torch.float32)
        gen = torch.Generator().manual_seed(noise_seed)
        noise = case.off_policy_noise * torch.randn(base.shape, generator=gen).to(base.device)
        inputs["old_per_token_logps"] = base + noise * inputs["completion_mask"]
    saved_inputs = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                    for k, v in inputs.items()}
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    losses = []
    for mb in split_tensor_dict(inputs, trainer.args.steps_per_generation):
        loss = trainer._compute_loss(model, mb)
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return StepResult(losses, grads, metrics, saved_inputs)


def assert_same_step(a: StepResult, b: StepResult, rtol: float = 1e-5, atol: float = 1e-7, metric_rtol=None,
                     loss_atol: float = 2e-6):
    """Loss values, every parameter gradient, every logged metric and every generation-time tensor agree.

    Loss values get an absolute floor ``loss_atol``: a GRPO loss is a sum of O(1) terms ``±A·ratio`` (or
    ``±A·logp``) that cancel, so fp32 rounding of O(1e-7) per term shows up as ~1e-5 *relative* error on a
    small total (TRL's own fp32 loss differs from a float64 oracle by ~1e-5 relative on the VESPO case).
    """
    metric_rtol = rtol if metric_rtol is None else metric_rtol
    assert len(a.losses) == len(b.losses)
    for la, lb in zip(a.losses, b.losses):
        assert math.isclose(la, lb, rel_tol=rtol, abs_tol=max(atol, loss_atol)), (a.losses, b.losses)
    assert set(a.grads) == set(b.grads), set(a.grads) ^ set(b.grads)
    assert len(a.grads) > 0
    bad = {}
    for n in a.grads:
        err = max_rel_err(a.grads[n], b.grads[n])
        if err > rtol and (a.grads[n] - b.grads[n]).abs().max().item() > atol:
            bad[n] = err
    assert not bad, f"gradient mismatch (rel err): {bad}"
    skip = {"step_time"}
    assert set(a.metrics) == set(b.metrics), set(a.metrics) ^ set(b.metrics)
    for k in a.metrics:
        if k in skip or "/time" in k:
            continue
        va, vb = a.metrics[k], b.metrics[k]
        assert len(va) == len(vb), (k, va, vb)
        for x, y in zip(va, vb):
            if isinstance(x, float) and math.isnan(x):
                assert math.isnan(y), (k, va, vb)
            else:
                assert math.isclose(x, y, rel_tol=metric_rtol, abs_tol=atol), (k, va, vb)
    assert set(a.inputs) == set(b.inputs)
    for k, v in a.inputs.items():
        w = b.inputs[k]
        if isinstance(v, torch.Tensor):
            assert v.shape == w.shape, k
            if v.is_floating_point():
                assert torch.allclose(v.double(), w.double(), rtol=rtol, atol=1e-6, equal_nan=True), (k, v, w)
            else:
                assert torch.equal(v, w), k
        else:
            assert v == w, k


def max_grad_relerr(a: StepResult, b: StepResult) -> float:
    """The largest :func:`references.max_rel_err` over the parameters' gradients of two steps."""
    return max(max_rel_err(a.grads[n], b.grads[n]) for n in a.grads)


def dense_trainer_class(base):
    """``base`` (a GRPOTrainer subclass) with log-probs/entropies from the full logits in the model's dtype: with a
    float64 model, a float64 oracle for the whole objective (TRL's loss code, exact log-probs)."""

    class DenseGRPOTrainer(base):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **kwargs):
            from hf_fused import original_forward_only

            with original_forward_only(model):  # the oracle builds the full logits on purpose
                out = model(input_ids=input_ids, attention_mask=attention_mask)
            logits = out.logits[:, -logits_to_keep - 1 : -1] / self.temperature
            logp_all = logits.log_softmax(-1)
            logp = logp_all.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
            keep = attention_mask[:, -logits_to_keep:].bool()
            ent = -(logp_all.exp() * logp_all).sum(-1) if compute_entropy else None
            logp = logp.masked_fill(~keep, 0.0)
            ent = None if ent is None else ent.masked_fill(~keep, 0.0)
            return logp, ent, None

    return DenseGRPOTrainer


def copy_weights(src, dst):
    """Copy every parameter of ``src`` into the same-named parameter of ``dst`` (any dtype)."""
    dst_params = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            dst_params[name].copy_(p)


# --- memory: the largest vocabulary-sized activation a block computes --------------------------------------------

_VIEW_OPS = {"t", "transpose", "permute", "view", "_unsafe_view", "expand", "alias", "detach", "slice", "select",
             "unsqueeze", "squeeze", "as_strided", "reshape", "unbind", "split", "chunk", "lift_fresh"}


class VocabRows:
    """Inside ``with VocabRows(vocab) as rec:``, ``rec.max_rows`` is the largest number of rows of any freshly
    computed (non-view) tensor whose last dimension is ``vocab`` and which has more than ``min_numel`` elements
    (``(H + 8)·V`` leaves out the ``[V, H]`` parameters and gradients)."""

    def __init__(self, vocab: int, min_numel: int = 0):
        self.vocab, self.min_numel, self.rows = vocab, min_numel, []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.__name__.split(".")[0] not in _VIEW_OPS:
                    for t in out if isinstance(out, (tuple, list)) else [out]:
                        if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == outer.vocab
                                and t.numel() > outer.min_numel):
                            outer.rows.append(t.numel() // outer.vocab)
                return out

        self._mode = Record()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    @property
    def max_rows(self) -> int:
        return max(self.rows, default=0)


def train_and_log(cls, case: "Case", tmp_path):
    """``trainer.train()`` of ``cls`` on ``case``: the log history without timings, and each parameter's update."""
    trainer = build_trainer(cls, case, tmp_path)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [{k: v for k, v in entry.items() if "time" not in k and "per_second" not in k}
            for entry in trainer.state.log_history]
    return logs, {n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}


def count_backend_calls(monkeypatch):
    """Counts, from now on, the torch backend's one-pass forwards that compute gradients (``"one_pass"``: a token
    loss's or a hinted log-prob call's) and its recompute backwards (``"logprobs_backward"``); ``(counts, the dtypes
    the counted calls' matmul operands were in)``."""
    from hf_fused.ops import get_backend

    backend = get_backend(torch.device("cpu"), "torch")
    calls = {"one_pass": 0, "logprobs_backward": 0}
    dtypes = set()  # the dtype each call's matmul operands are in (backends take the head as given, HeadInputs)
    for name, key in (("token_loss_with_grads", "one_pass"), ("logprobs_with_grads", "one_pass"),
                      ("logprobs_backward", "logprobs_backward")):
        original = getattr(backend, name)

        def counted(*args, _key=key, _original=original, **kwargs):
            if _key == "logprobs_backward" or kwargs["need"].any:  # one-pass calls that compute gradients
                calls[_key] += 1
                dtypes.add(args[0].operand_dtype)
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, name, counted)
    return calls, dtypes


def count_heads(monkeypatch) -> dict:
    """Counts, from now on, the calls of hf_fused's log-prob op as the TRL integration makes them (``"hf_fused"``)
    and of TRL's chunked head (``"trl"``)."""
    import hf_fused.integrations.trl.head as integration
    import trl.trainer.utils as trl_utils

    counts = {"hf_fused": 0, "trl": 0}
    op, chunked = integration.linear_logprobs, trl_utils._ChunkedLogProbFunction

    def counted_op(*args, **kwargs):
        counts["hf_fused"] += 1
        return op(*args, **kwargs)

    class Counted(chunked):
        @staticmethod
        def forward(*args, **kwargs):
            counts["trl"] += 1
            return chunked.forward(*args, **kwargs)

    monkeypatch.setattr(integration, "linear_logprobs", counted_op)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Counted)
    return counts


class FixedRollouts:
    """TRL's ``RolloutWorkerProtocol`` (its experimental trainers fed by a rollout worker) in-process: a queue already
    holding the scored samples (copies). Running out is an error, not a wait: the trainer polls an empty queue
    every few seconds and asks the worker's health, which raises here."""

    def __init__(self, samples):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(copy.deepcopy(sample))

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        raise RuntimeError("the test's rollouts ran out: give the worker more samples")


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol`` (its experimental trainers that sync weights to a vLLM server) with nothing
    to send to: what tests pass as ``weight_transfer`` where no server runs."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass
