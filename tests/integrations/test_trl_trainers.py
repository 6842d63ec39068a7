"""TRL's trainers on hf_fused: ``apply_fused_loss(model)`` (before or after the trainer is built) makes every
fused-head call of ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer`` and ``RLOOTrainer`` come from hf_fused's ops,
with exactly the stock trainer's objective.

Each parity test trains the stock trainer and the patched one from the same tiny model, data and seed for two
optimizer steps through ``trainer.train()`` and compares, at every step, the loss, every parameter's gradient
(captured just before the optimizer step, so gradient accumulation is included) and every logged metric, in
fp32 (``bf16=False``: TRL's configs default to autocast even on CPU) to ``1e-5`` relative. It also counts the
calls: the patched trainer runs hf_fused's op on every fused call and TRL's chunked head never.
GRPO's parity tests are in ``test_grpo_parity.py``.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from datasets import Dataset

import hf_fused
import hf_fused.integrations.trl.head as trl_head
from hf_fused.integrations.trl import TrlProtocolError
import trl.trainer.utils as trl_utils
from grpo_harness import VocabRows
from models import GradRecorder, WORDS, assert_same_gradients, is_timing_metric, make_tokenizer
from models import make_word_model as make_model
from references import logp_difference_tol

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

RTOL = 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Harness


def _sentence(i: int, n: int) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=g).tolist())




class _Counting:
    """Counts calls of hf_fused's ``linear_logprobs`` (as the TRL integration calls it) and of TRL's chunked head."""

    def __init__(self, monkeypatch):
        self.hf_fused = 0
        self.trl = 0
        fused, chunked = trl_head.linear_logprobs, trl_utils._ChunkedLogProbFunction
        counter = self

        def linear_logprobs(*args, **kwargs):
            counter.hf_fused += 1
            return fused(*args, **kwargs)

        class Chunked(chunked):
            @staticmethod
            def forward(*args, **kwargs):
                counter.trl += 1
                return chunked.forward(*args, **kwargs)

        monkeypatch.setattr(trl_head, "linear_logprobs", linear_logprobs)
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Chunked)


def _common_args(tmp_path, name, **overrides):
    args = dict(
        output_dir=str(tmp_path / name), bf16=False, max_steps=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=1, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
        learning_rate=1e-2, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        # SGD: Adam's first steps move every weight by ±lr whatever the gradient's size, so a 1e-7 gradient
        # difference on a near-zero entry becomes an lr-sized weight difference at step 2.
        optim="sgd",
    )
    args.update(overrides)
    return args


def _train(build, model, *, patch: str | None, fused_options=None, monkeypatch=None):
    """``build(model, callbacks)`` → trainer; ``patch``: None (stock), "before" or "after" the trainer is built."""
    recorder = GradRecorder()
    if patch == "before":
        hf_fused.apply_fused_loss(model, **(fused_options or {}))
    trainer = build(model, [recorder])
    if patch == "after":
        hf_fused.apply_fused_loss(trainer.model, **(fused_options or {}))
        if getattr(trainer, "ref_model", None) is not None:
            hf_fused.apply_fused_loss(trainer.ref_model, **(fused_options or {}))
    counting = _Counting(monkeypatch) if monkeypatch is not None else None
    trainer.train()
    logs = [{k: v for k, v in entry.items() if not is_timing_metric(k)} for entry in trainer.state.log_history]
    return trainer, logs, recorder.steps, counting


def _abs_floor(key: str, logged: dict) -> float:
    # A policy-gradient loss (RLOO, GRPO) is a sum of O(1) terms ±A·ratio whose advantages sum to ~0 per group:
    # fp32 rounding of ~1e-7 per term leaves a total of that size (TRL's own loss is 1.2e-7 where the exact one
    # is 0), so a loss gets an absolute floor; DPO's rewards are differences of log-probabilities, held to the
    # log-probabilities' own precision (references.logp_difference_tol); every other metric is compared to 1e-5
    # relative, 1e-7 absolute.
    return 2e-6 if "loss" in key else logp_difference_tol(key, logged)


def _assert_same_training(got, ref):
    (_, logs_a, grads_a, _), (_, logs_b, grads_b, _) = got, ref
    assert len(logs_a) == len(logs_b) and len(grads_a) == len(grads_b) == 2
    for a, b in zip(logs_a, logs_b):
        assert a.keys() == b.keys(), set(a) ^ set(b)
        for key in a:
            x, y = a[key], b[key]
            if isinstance(y, float) and math.isnan(y):
                assert math.isnan(x), key
            else:
                assert math.isclose(x, y, rel_tol=RTOL, abs_tol=_abs_floor(key, b)), (key, x, y)
    assert_same_gradients(grads_a, grads_b, RTOL)


def _parity(build, monkeypatch, *, patch="before", model=None, fused_options=None, ref_model=None):
    """Stock vs patched training; returns the patched run's call counts."""
    base = make_model() if model is None else model
    stock = _train(build, copy.deepcopy(base), patch=None, monkeypatch=monkeypatch)
    assert stock[3].trl > 0 and stock[3].hf_fused == 0  # the counters see TRL's head when it runs
    monkeypatch.undo()
    fused = _train(build, copy.deepcopy(base), patch=patch, fused_options=fused_options, monkeypatch=monkeypatch)
    _assert_same_training(fused, stock)
    counting = fused[3]
    assert counting.hf_fused > 0 and counting.trl == 0, (counting.hf_fused, counting.trl)
    return fused[0], counting


# ----------------------------------------------------------------------------------------------------------------
# SFT


def _sft_builder(tmp_path, dataset, **config):
    from trl import SFTConfig, SFTTrainer

    tokenizer = make_tokenizer()
    tokenizer.padding_side = "right"

    def build(model, callbacks):
        args = SFTConfig(**_common_args(tmp_path, "sft", **config))
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks)

    return build


_TEXT = Dataset.from_dict({"text": [_sentence(i, 4 + i % 5) for i in range(16)]})
_PROMPT_COMPLETION = Dataset.from_dict({
    "prompt": [_sentence(i, 2 + i % 3) for i in range(16)],
    "completion": [" " + _sentence(100 + i, 2 + i % 4) for i in range(16)],
})


@pytest.mark.parametrize("patch", ["before", "after"])
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_matches_trl(loss_type, patch, tmp_path, monkeypatch):
    _parity(_sft_builder(tmp_path, _TEXT, loss_type=loss_type, gradient_accumulation_steps=2), monkeypatch,
            patch=patch)


@pytest.mark.parametrize("variant", ["tied_embeddings", "gradient_checkpointing"])
def test_sft_model_variants_match_trl(variant, tmp_path, monkeypatch):
    config = dict(gradient_checkpointing=True) if variant == "gradient_checkpointing" else {}
    _parity(_sft_builder(tmp_path, _TEXT, **config), monkeypatch, model=make_model(tie=variant == "tied_embeddings"))


def test_sft_completion_only_matches_trl(tmp_path, monkeypatch):
    _parity(_sft_builder(tmp_path, _PROMPT_COMPLETION, completion_only_loss=True), monkeypatch)


def test_sft_use_liger_kernel_keeps_the_fused_head(tmp_path, monkeypatch):
    """``SFTConfig(use_liger_kernel=True)``: TRL switches Liger's fused cross-entropy off itself and hf_fused's
    Liger hook passes the call through, so a patched model keeps serving TRL's head (Liger's layer kernels are
    switched off here: they need CUDA; tests/test_trainer_liger.py has the GPU run). Same training as stock TRL
    with the same flag."""
    pytest.importorskip("liger_kernel")
    _parity(_sft_builder(tmp_path, _TEXT, use_liger_kernel=True,
                         liger_kernel_config=dict(rope=False, rms_norm=False, swiglu=False)), monkeypatch)


def test_sft_packing_matches_trl(tmp_path, monkeypatch):
    # Packing (padding-free, BFD): position_ids restart at each document, no attention mask.
    _parity(_sft_builder(tmp_path, _TEXT, packing=True, max_length=16, per_device_train_batch_size=2), monkeypatch)


# ----------------------------------------------------------------------------------------------------------------
# DPO


_PREFERENCES = Dataset.from_dict({
    "prompt": [_sentence(i, 2 + i % 3) for i in range(16)],
    "chosen": [" " + _sentence(200 + i, 2 + i % 4) for i in range(16)],
    "rejected": [" " + _sentence(300 + i, 1 + i % 5) for i in range(16)],
})


def _perturbed(model, seed=99, scale=0.05):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def _dpo_builder(tmp_path, ref_source=None, peft=False, **config):
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    def build(model, callbacks):
        args = DPOConfig(**_common_args(tmp_path, "dpo", **config))
        return DPOTrainer(
            model=model, ref_model=None if ref_source is None else copy.deepcopy(ref_source), args=args,
            train_dataset=_PREFERENCES, processing_class=make_tokenizer(), callbacks=callbacks,
            peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
            if peft else None,
        )

    return build


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", ["sigmoid", "sft"]])
def test_dpo_matches_trl(loss_type, tmp_path, monkeypatch):
    model = make_model()
    trainer, _ = _parity(_dpo_builder(tmp_path, ref_source=_perturbed(model), loss_type=loss_type), monkeypatch,
                         model=model)
    assert hf_fused.is_fused(trainer.ref_model), "the reference model should run through hf_fused too"


def test_dpo_wpo_weighting_matches_trl(tmp_path, monkeypatch):
    # use_weighting reads log_sum_sq_probs from the fused head.
    model = make_model()
    _parity(_dpo_builder(tmp_path, ref_source=_perturbed(model), use_weighting=True), monkeypatch, model=model)


def test_dpo_peft_reference_matches_trl(tmp_path, monkeypatch):
    # PEFT: the reference is the policy with its adapter disabled (no ref_model).
    _parity(_dpo_builder(tmp_path, peft=True), monkeypatch)


def test_dpo_patched_after_matches_trl(tmp_path, monkeypatch):
    model = make_model()
    _parity(_dpo_builder(tmp_path, ref_source=_perturbed(model)), monkeypatch, model=model, patch="after")


# ----------------------------------------------------------------------------------------------------------------
# KTO


_UNPAIRED = Dataset.from_dict({
    "prompt": [_sentence(i, 2 + i % 3) for i in range(16)],
    "completion": [" " + _sentence(400 + i, 2 + i % 4) for i in range(16)],
    "label": [i % 3 != 0 for i in range(16)],
})


def _kto_builder(tmp_path, ref_source, **config):
    from trl import KTOConfig, KTOTrainer

    def build(model, callbacks):
        args = KTOConfig(**_common_args(tmp_path, "kto", **{"per_device_train_batch_size": 8, **config}))
        return KTOTrainer(model=model, ref_model=copy.deepcopy(ref_source), args=args, train_dataset=_UNPAIRED,
                          processing_class=make_tokenizer(), callbacks=callbacks)

    return build


@pytest.mark.parametrize("patch", ["before", "after"])
def test_kto_matches_trl(patch, tmp_path, monkeypatch):
    model = make_model()
    trainer, _ = _parity(_kto_builder(tmp_path, _perturbed(model)), monkeypatch, model=model, patch=patch)
    assert hf_fused.is_fused(trainer.ref_model)


# ----------------------------------------------------------------------------------------------------------------
# RLOO


def _reward(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 7) + 0.25 * len(ids) for ids in completion_ids]


def _rloo_builder(tmp_path, model, beta=0.0, **config):
    from trl import RLOOConfig, RLOOTrainer

    if beta:
        # TRL re-creates the reference model from config._name_or_path.
        path = tmp_path / "ref"
        _perturbed(model).save_pretrained(path)
        model.config._name_or_path = str(path)
    prompts = Dataset.from_dict({"prompt": [_sentence(i, 3) for i in range(16)]})

    def build(model, callbacks):
        args = RLOOConfig(**_common_args(tmp_path, "rloo", **{
            "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 5, "beta": beta,
            "temperature": 0.8, **config}))
        return RLOOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=prompts,
                           processing_class=make_tokenizer(), callbacks=callbacks)

    return build


@pytest.mark.parametrize("beta,patch", [(0.0, "before"), (0.05, "before"), (0.05, "after")])
def test_rloo_matches_trl(beta, patch, tmp_path, monkeypatch):
    model = make_model()
    trainer, _ = _parity(_rloo_builder(tmp_path, model, beta), monkeypatch, model=model, patch=patch)
    if beta:
        assert hf_fused.is_fused(trainer.ref_model)


# ----------------------------------------------------------------------------------------------------------------
# Failing loudly


def test_fused_call_without_a_trl_head_raises():
    model = hf_fused.apply_fused_loss(make_model())
    ids = torch.randint(3, 20, (2, 6))
    with pytest.raises(TrlProtocolError, match="no TRL trainer added a fused head"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)


def test_changed_trl_protocol_is_refused_loudly(monkeypatch):
    """A TRL whose add_fused_lm_head takes other arguments: nothing is wrapped, a warning says TRL's head will be
    used, and a fused call on a patched model raises instead of guessing."""
    def add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",), chunk_size=4096):
        raise AssertionError("not called here")

    hf_fused.integrations.uninstall_all()  # installed afresh below, on the changed TRL
    monkeypatch.setattr(trl_utils, "add_fused_lm_head", add_fused_lm_head)
    try:
        with pytest.warns(UserWarning, match="TRL's trainers will use TRL's own fused head"):
            model = hf_fused.apply_fused_loss(make_model())
        assert trl_utils.add_fused_lm_head is add_fused_lm_head
        ids = torch.randint(3, 20, (2, 6))
        with pytest.raises(TrlProtocolError, match="add_fused_lm_head takes"):
            model(input_ids=ids, labels=ids, fused_lm_head=True)
    finally:
        hf_fused.integrations.uninstall_all()  # the next patch installs on TRL's own head again


def test_changed_trl_head_closure_is_refused_loudly():
    """A TRL head whose forward no longer closes over its options: apply_fused_loss after the trainer refuses."""
    model = make_model()

    def make_head(original_forward):
        def _fused_forward(self, *args, fused_lm_head=False, **kwargs):
            return original_forward(*args, **kwargs)
        return _fused_forward

    head = make_head(model.forward)
    head.__code__ = head.__code__.replace(co_filename=os.path.join(os.sep, "x", "trl", "trainer", "utils.py"))
    model.forward = head.__get__(model)
    with pytest.raises(TrlProtocolError, match="closes over"):
        hf_fused.apply_fused_loss(model)


# ----------------------------------------------------------------------------------------------------------------
# A LoRA adapter on lm_head: TRL refuses it (its head would read the bare weight); on a patched model it trains.

LORA_HEAD = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"],
                 init_lora_weights=False)


def _head_adapter_trainer(name, model, tmp_path):
    from peft import LoraConfig
    from trl import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RLOOConfig, RLOOTrainer,
                     SFTConfig, SFTTrainer)

    common = dict(processing_class=make_tokenizer(), peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA_HEAD))
    prompts = Dataset.from_dict({"prompt": [_sentence(i, 3) for i in range(16)]})
    rl = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=5)
    if name == "sft":
        return SFTTrainer(model=model, args=SFTConfig(**_common_args(tmp_path, name)), train_dataset=_TEXT, **common)
    if name == "dpo":
        return DPOTrainer(model=model, args=DPOConfig(**_common_args(tmp_path, name)), train_dataset=_PREFERENCES,
                          **common)
    if name == "kto":
        return KTOTrainer(model=model, args=KTOConfig(**_common_args(tmp_path, name, per_device_train_batch_size=8)),
                          train_dataset=_UNPAIRED, **common)
    if name == "rloo":
        return RLOOTrainer(model=model, reward_funcs=_reward, args=RLOOConfig(**_common_args(tmp_path, name, **rl)),
                           train_dataset=prompts, **common)
    return GRPOTrainer(model=model, reward_funcs=_reward, args=GRPOConfig(**_common_args(tmp_path, name, **rl)),
                       train_dataset=prompts, **common)


@pytest.mark.parametrize("name", ["sft", "dpo", "kto", "rloo", "grpo"])
def test_lora_on_lm_head_trains_under_each_trainer(name, tmp_path):
    with pytest.raises(ValueError, match="lm_head"):
        _head_adapter_trainer(name, make_model(), tmp_path)  # TRL on its own
    trainer = _head_adapter_trainer(name, hf_fused.apply_fused_loss(make_model()), tmp_path)
    head = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lm_head.lora_" in n}
    assert len(head) == 2 and all(trainer.model.get_parameter(n).requires_grad for n in head)
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
    for n, before in head.items():
        assert not torch.equal(trainer.model.get_parameter(n), before), f"{n} did not train"


def test_lora_on_lm_head_sft_gradients_match_dense_logits(tmp_path):
    """SFT's loss on a patched PEFT model with an adapter on lm_head, against the same loss from the full logits of
    the original forward (the adapter applied by PEFT's own layer): every gradient, the adapter's included."""
    from hf_fused.model import original_forward_only

    trainer = _head_adapter_trainer("sft", hf_fused.apply_fused_loss(make_model()), tmp_path)
    model = trainer.model
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    n_tokens = (batch["labels"][:, 1:] != -100).sum()

    model.zero_grad()
    trainer.compute_loss(model, dict(batch), num_items_in_batch=n_tokens).backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    with original_forward_only(model):
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    targets = batch["labels"][:, 1:]
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    (-(logp * (targets != -100)).sum() / n_tokens).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            err = (fused[n] - p.grad).norm() / p.grad.norm()
            assert err <= RTOL, (n, err.item())
    assert any("lm_head.lora_B" in n and g.abs().sum() > 0 for n, g in fused.items())


# ----------------------------------------------------------------------------------------------------------------
# MoE (router load-balancing loss), assistant-only SFT, bf16 twins


def test_sft_moe_aux_loss_matches_trl(tmp_path, monkeypatch):
    trainer, _ = _parity(_sft_builder(tmp_path, _TEXT), monkeypatch, model=make_model("qwen3moe"))
    assert "aux_loss" in trainer.state.log_history[0]


def test_dpo_moe_aux_loss_matches_trl(tmp_path, monkeypatch):
    model = make_model("qwen3moe")
    trainer, _ = _parity(_dpo_builder(tmp_path, ref_source=_perturbed(model)), monkeypatch, model=model)
    assert "aux_loss" in trainer.state.log_history[0]


_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} [EOS]"
    "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
)
_CONVERSATIONS = Dataset.from_dict({"messages": [
    [{"role": "user", "content": _sentence(i, 3)}, {"role": "assistant", "content": _sentence(500 + i, 2 + i % 3)},
     {"role": "user", "content": _sentence(600 + i, 2)}, {"role": "assistant", "content": _sentence(700 + i, 3)}]
    for i in range(16)
]})


def test_sft_assistant_only_matches_trl(tmp_path, monkeypatch):
    from trl import SFTConfig, SFTTrainer

    tokenizer = make_tokenizer()
    tokenizer.padding_side = "right"
    tokenizer.chat_template = _CHAT_TEMPLATE

    def build(model, callbacks):
        args = SFTConfig(**_common_args(tmp_path, "sft_assistant", assistant_only_loss=True))
        return SFTTrainer(model=model, args=args, train_dataset=_CONVERSATIONS, processing_class=tokenizer,
                          callbacks=callbacks)

    trainer, _ = _parity(build, monkeypatch)
    batch = next(iter(trainer.get_train_dataloader()))
    scored, real = int((batch["labels"] != -100).sum()), int(batch["attention_mask"].sum())
    assert 0 < scored < real  # the assistant mask really leaves the user turns out


@pytest.mark.parametrize("trainer_name", ["sft", "dpo", "kto", "rloo"])
def test_bf16_autocast_close_to_trl(trainer_name, tmp_path, monkeypatch):
    """TRL's configs default to bf16=True, i.e. autocast on CPU. Both heads then read bf16 operands; TRL's CPU head
    also rounds each logit to bf16 before its fp32 statistics while hf_fused keeps the logits in fp32. With this
    model's logits |z| ≲ 20 that rounding (2^-9 relative) moves a log-prob by up to ~0.04 and the loss and metrics by
    ~1e-2 relative, so the twins agree to 3e-2 relative; gradients agree in direction (cosine ≥ 0.999)."""
    model = make_model()
    if trainer_name == "sft":
        build = _sft_builder(tmp_path, _TEXT, bf16=True)
    elif trainer_name == "dpo":
        build = _dpo_builder(tmp_path, ref_source=_perturbed(model), bf16=True)
    elif trainer_name == "kto":
        build = _kto_builder(tmp_path, _perturbed(model), bf16=True)
    else:
        build = _rloo_builder(tmp_path, model, beta=0.05, bf16=True)
    (_, logs_b, grads_b, _) = _train(build, copy.deepcopy(model), patch=None)
    (_, logs_a, grads_a, counting) = _train(build, copy.deepcopy(model), patch="before", monkeypatch=monkeypatch)
    assert counting.hf_fused > 0 and counting.trl == 0
    for a, b in zip(logs_a, logs_b):
        assert a.keys() == b.keys()
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=3e-2, abs_tol=2e-2), (key, a[key], b[key])
    for ga, gb in zip(grads_a, grads_b):
        flat_a = torch.cat([g.flatten() for g in ga.values()])
        flat_b = torch.cat([g.flatten() for g in gb.values()])
        assert torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0) >= 0.999


# ----------------------------------------------------------------------------------------------------------------
# Logit transforms (read from the forward by hf_fused, from the config by TRL) and evaluation


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_sft_with_a_logit_transform_matches_trl(arch, tmp_path, monkeypatch):
    from models import make_model as make_arch_model

    _parity(_sft_builder(tmp_path, _TEXT), monkeypatch, model=make_arch_model(arch))


@pytest.mark.parametrize("trainer_name", ["sft", "dpo"])
def test_evaluate_matches_trl(trainer_name, tmp_path, monkeypatch):
    model = make_model()
    if trainer_name == "sft":
        build = _sft_builder(tmp_path, _TEXT)
        eval_dataset = _TEXT.select(range(6))
    else:
        build = _dpo_builder(tmp_path, ref_source=_perturbed(model))
        eval_dataset = _PREFERENCES.select(range(6))
    results = []
    for patch in (False, True):
        m = copy.deepcopy(model)
        if patch:
            hf_fused.apply_fused_loss(m)
        trainer = build(m, [])
        counting = _Counting(monkeypatch)
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        assert (counting.hf_fused > 0 and counting.trl == 0) if patch else (counting.trl > 0)
        monkeypatch.undo()
        results.append({k: v for k, v in metrics.items() if not is_timing_metric(k)})
    want, got = results
    assert got.keys() == want.keys() and "eval_loss" in want
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=RTOL, abs_tol=1e-7), (key, got[key], want[key])


# ----------------------------------------------------------------------------------------------------------------
# Memory: on hf_fused no vocabulary-sized activation beyond one tile, whatever the number of tokens

def _largest_vocab_activation(trainer, vocab: int, hidden: int) -> int:
    """Rows of the largest freshly computed ``[..., V]`` tensor during one optimizer step of ``trainer.train()``
    (max_steps=1), the ``[V, H]`` parameters and gradients left out."""
    with VocabRows(vocab, min_numel=(hidden + 8) * vocab) as rec:
        trainer.train()
    return rec.max_rows


@pytest.mark.parametrize("name", ["sft", "dpo", "kto", "rloo"])
def test_no_vocab_sized_activation_on_hf_fused(name, tmp_path):
    from models import WORD_VOCAB as VOCAB_SIZE

    hidden, tile_rows = 32, 4
    builders = {
        "sft": lambda: _sft_builder(tmp_path, _TEXT, max_steps=1, per_device_train_batch_size=8),
        "dpo": lambda: _dpo_builder(tmp_path, ref_source=_perturbed(make_model()), max_steps=1,
                                    per_device_train_batch_size=8),
        "kto": lambda: _kto_builder(tmp_path, _perturbed(make_model()), max_steps=1),
        "rloo": lambda: _rloo_builder(tmp_path, make_model(), max_steps=1, per_device_train_batch_size=8),
    }
    budget = dict(tile_budget_bytes=3 * 4 * VOCAB_SIZE * tile_rows)  # the torch backend's 3 fp32 [rows, V] buffers
    fused = builders[name]()(hf_fused.apply_fused_loss(make_model(), **budget), [])
    assert _largest_vocab_activation(fused, VOCAB_SIZE, hidden) <= hidden + 8
    # control: TRL's own CPU head scores every position in one [N, V] block, and the check sees it
    stock = builders[name]()(make_model(), [])
    assert _largest_vocab_activation(stock, VOCAB_SIZE, hidden) > hidden + 8


# ----------------------------------------------------------------------------------------------------------------
# The protocol answer itself, field by field, against TRL's head on the same model


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("aligned", ["labels", "shift_labels"])
@pytest.mark.parametrize("masked", ["some", "all"])
def test_every_field_equals_trls_head(arch, aligned, masked):
    """``model(..., fused_lm_head=True)`` on a patched model against TRL's own head on an unpatched copy: every field
    (values, and the gradients of a loss that uses log-probs and entropy), with a temperature, with and without
    ``num_items_in_batch``; an all-ignored batch still gives a differentiable zero (TRL's ``masked_scatter``)."""
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    stock, patched = make_model(arch), make_model(arch)
    trl_utils.add_fused_lm_head(stock, temperature=0.7, outputs=outputs)
    hf_fused.apply_fused_loss(patched)
    trl_utils.add_fused_lm_head(patched, temperature=0.7, outputs=outputs)  # hf_fused records the options
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (3, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :2] = -100
    if masked == "all":
        labels[:] = -100
    call = {aligned: labels}
    if arch == "qwen3moe":
        call["output_router_logits"] = True
    results = []
    for model in (stock, patched):
        model.zero_grad()
        for num_items in (None, 7):
            out = model(input_ids=ids, attention_mask=attention, fused_lm_head=True, num_items_in_batch=num_items,
                        **call)
            (out.loss + (out.entropy * out.log_probs.detach()).sum()).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    for field in ("loss", "aux_loss", *outputs, "label_mask"):
        a, b = getattr(got, field), getattr(want, field)
        if b is None:
            assert a is None, field
        elif b.dtype == torch.bool:
            assert torch.equal(a, b), field
        else:
            assert a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=1e-6), (field, (a - b).abs().max())
    assert got.log_probs.requires_grad
    assert want_grads.keys() == got_grads.keys()
    for name, b in want_grads.items():
        assert (got_grads[name] - b).abs().max() <= RTOL * b.abs().max() + 1e-7, name
