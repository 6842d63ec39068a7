"""TRL's distillation trainers on hf_fused: ``apply_fused_loss(student)`` (before or after the trainer is built) makes
``DistillationTrainer``'s ``_chunked_divergence_loss`` and ``GKDTrainer``'s ``compute_loss`` come from
:func:`hf_fused.ops.linear_distillation_loss`, with exactly the stock trainer's objective.

Each parity test trains the stock trainer and the patched one from the same tiny student, teacher (another width:
hidden 48 against the student's 32), data and seed for two optimizer steps through ``trainer.train()`` (TRL's
on-policy generation loop with the tiny model, gradient accumulation 2) and compares, at every step, every logged
metric and every parameter's gradient (captured before the optimizer step), then every parameter, to ``1e-5``
relative. It also counts the calls: the patched trainer runs hf_fused's op on every loss and TRL's kernel never.

Precision. ``DistillationTrainer`` with TRL's default ``bf16=True`` computes its loss in fp32 on CPU: it runs the
loss through ``_ForwardRedirection``, which puts its own function in place of the forward that accelerate wrapped in
autocast; so bf16 is held to the fp32 bounds. ``GKDTrainer`` calls the models' forwards, so under ``bf16=True`` both
heads compute from bf16 operands and TRL's rounds the logits to bf16 where hf_fused keeps them in fp32: the bf16
twins agree to 3e-2 relative in loss and metrics and in gradient direction (cosine ≥ 0.999), and the patched run's
parameters are no further from the fp32 run's than the stock run's (within 1.25×).
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import hf_fused
import hf_fused.integrations.trl.divergence as divergence
from hf_fused.model import FusedLossBypassedWarning
from grpo_harness import VocabRows
from models import EOS_ID, GradRecorder, assert_same_training, is_timing_metric, PAD_ID, WORDS, WORD_VOCAB, make_tokenizer, make_word_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_distillation = pytest.importorskip("trl.trainer.distillation_trainer")

RTOL = 1e-5
TEACHER_HIDDEN = 48


# ----------------------------------------------------------------------------------------------------------------
# Harness


def _sentence(i: int, n: int) -> str:
    g = torch.Generator().manual_seed(i)
    return " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def make_teacher(hidden: int = TEACHER_HIDDEN, seed: int = 3) -> LlamaForCausalLM:
    """A 2-layer Llama over the student's vocabulary, ``hidden`` wide, its head scaled up as the student's is."""
    config = LlamaConfig(vocab_size=WORD_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD_ID,
                         eos_token_id=EOS_ID, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)
    return model


PROMPTS = Dataset.from_dict({"prompt": [_sentence(i, 3) for i in range(16)]})
#: GKD's conversations: a chat template that joins the turns (GKD's collator tokenizes them through it).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CONVERSATIONS = Dataset.from_dict({"messages": [
    [{"role": "user", "content": _sentence(i, 3)}, {"role": "assistant", "content": _sentence(100 + i, 2 + i % 3)}]
    for i in range(16)
]})




class _Counting:
    """Counts calls of hf_fused's op (as the TRL integration calls it) and of TRL's chunked divergence kernel."""

    def __init__(self, monkeypatch):
        self.hf_fused = 0
        self.trl = 0
        op, kernel = divergence.linear_distillation_loss, trl_distillation.ChunkedDivergenceFunction
        counter = self

        def linear_distillation_loss(*args, **kwargs):
            counter.hf_fused += 1
            return op(*args, **kwargs)

        class Kernel(kernel):
            @staticmethod
            def forward(*args, **kwargs):
                counter.trl += 1
                return kernel.forward(*args, **kwargs)

        monkeypatch.setattr(divergence, "linear_distillation_loss", linear_distillation_loss)
        monkeypatch.setattr(trl_distillation, "ChunkedDivergenceFunction", Kernel)


def _common_args(tmp_path, name, **overrides):
    args = dict(
        output_dir=str(tmp_path / name), bf16=False, max_steps=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
        learning_rate=1e-2, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        optim="sgd",  # Adam's first steps move every weight by ±lr whatever the gradient's size
    )
    args.update(overrides)
    return args


def _distillation_builder(tmp_path, teacher, **config):
    from trl import DistillationConfig, DistillationTrainer

    def build(model, callbacks, **kwargs):
        args = DistillationConfig(**_common_args(tmp_path, "distill", max_completion_length=5, **config))
        return DistillationTrainer(model=model, teacher_model=copy.deepcopy(teacher), args=args,
                                   train_dataset=PROMPTS, processing_class=make_tokenizer(), callbacks=callbacks,
                                   **kwargs)

    return build


def _gkd_builder(tmp_path, teacher, trainer_cls=None, **config):
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE

    def build(model, callbacks):
        args = GKDConfig(**_common_args(tmp_path, "gkd", max_new_tokens=5, **config))
        return (trainer_cls or GKDTrainer)(model=model, teacher_model=copy.deepcopy(teacher), args=args,
                                           train_dataset=CONVERSATIONS, processing_class=tokenizer,
                                           callbacks=callbacks)

    return build


def _train(build, model, *, patch, monkeypatch=None):
    """``build(model, callbacks)`` → trainer; ``patch``: None (stock), "before" or "after" the trainer is built.
    Returns ``(trainer, logs, grads per step, counting)``."""
    recorder = GradRecorder()
    if patch == "before":
        hf_fused.apply_fused_loss(model)
    trainer = build(model, [recorder])
    if patch == "after":
        hf_fused.apply_fused_loss(trainer.model)
    counting = _Counting(monkeypatch) if monkeypatch is not None else None
    trainer.train()
    logs = [{k: v for k, v in entry.items() if not is_timing_metric(k)} for entry in trainer.state.log_history]
    return trainer, logs, recorder.steps, counting


def _parity(build, monkeypatch, *, patch="before", student=None):
    """Stock vs patched training; returns the patched run's ``(trainer, logs, grads, counting)``."""
    base = make_word_model() if student is None else student
    stock = _train(build, copy.deepcopy(base), patch=None, monkeypatch=monkeypatch)
    monkeypatch.undo()
    fused = _train(build, copy.deepcopy(base), patch=patch, monkeypatch=monkeypatch)
    assert_same_training(fused, stock)
    return stock, fused


# ----------------------------------------------------------------------------------------------------------------
# DistillationTrainer


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("patch", ["before", "after"])
def test_distillation_matches_trl(patch, bf16, tmp_path, monkeypatch):
    """TRL's defaults (``beta=1.0``: reverse KL, temperature 1, ``bf16=True``; and fp32), on-policy generation, a
    teacher of another width, gradient accumulation 2."""
    stock, fused = _parity(_distillation_builder(tmp_path, make_teacher(), bf16=bf16), monkeypatch, patch=patch)
    assert stock[3].trl > 0 and stock[3].hf_fused == 0  # the counters see TRL's kernel when it runs
    assert fused[3].hf_fused == 4 and fused[3].trl == 0  # 2 steps × 2 micro-batches
    assert {"loss", "entropy", "grad_norm", "completions/mean_length"} <= fused[1][0].keys()


@pytest.mark.parametrize("beta,temperature", [(0.0, 2.0), (0.5, 0.7)])
def test_distillation_divergences_match_trl(beta, temperature, tmp_path, monkeypatch):
    """Forward KL and the generalized JSD, with a sampling temperature (applied to both models' logits)."""
    build = _distillation_builder(tmp_path, make_teacher(), beta=beta, temperature=temperature)
    _, fused = _parity(build, monkeypatch)
    assert fused[3].hf_fused > 0 and fused[3].trl == 0


def test_unpatched_student_keeps_trls_kernel(tmp_path, monkeypatch):
    """With hf_fused's patches installed (another model is patched), an unpatched student's loss is TRL's kernel."""
    hf_fused.apply_fused_loss(make_word_model())  # the inventory installed
    build = _distillation_builder(tmp_path, make_teacher(), max_steps=1)
    _, _, _, counting = _train(build, make_word_model(), patch=None, monkeypatch=monkeypatch)
    assert counting.trl > 0 and counting.hf_fused == 0


def _loss_call_args(seed: int = 0, *, student_width: int = 32, teacher_width: int = TEACHER_HIDDEN):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, :] = 0
    return dict(student_hidden_states=torch.randn(3, 5, student_width, generator=g),
                teacher_hidden_states=torch.randn(3, 5, teacher_width, generator=g), completion_mask=mask)


#: What TRL's ``_compute_loss`` reads from each architecture's config: (logit scale, final soft-cap).
TRL_TRANSFORMS = {"gemma2": (1.0, 1.0), "cohere": (0.5, None), "granite": (0.25, None)}


@pytest.mark.parametrize("arch", list(TRL_TRANSFORMS))
def test_the_students_measured_transform_answers_trls_call(arch):
    """``_chunked_divergence_loss`` called as ``DistillationTrainer`` calls it, on a student with a soft-cap (Gemma 2)
    or a logit scale (Cohere, Granite), and a biased teacher with its own scale and soft-cap: the answer for the
    patched student (its transform as hf_fused measured it on its forward) equals TRL's function given TRL's reading
    of the config (loss, entropy sum, count, every gradient), with ``num_items_in_batch``."""
    from models import make_model

    student = hf_fused.apply_fused_loss(make_model(arch))
    vocab, width = student.get_output_embeddings().weight.shape
    g = torch.Generator().manual_seed(1)
    teacher_weight, teacher_bias = 4 * torch.randn(vocab, TEACHER_HIDDEN, generator=g), torch.randn(vocab, generator=g)
    call = _loss_call_args(student_width=width)
    scale, softcap = TRL_TRANSFORMS[arch]
    common = dict(teacher_lm_head_weight=teacher_weight, beta=0.5, num_items_in_batch=torch.tensor(9.0),
                  teacher_lm_head_bias=teacher_bias, student_logit_scale=scale, teacher_logit_scale=0.5,
                  student_final_logit_softcapping=softcap, teacher_final_logit_softcapping=7.0, temperature=0.7)
    results = []
    for function in (trl_distillation._chunked_divergence_loss, trl_distillation._chunked_divergence_loss.__wrapped__):
        student.zero_grad()
        hidden = call["student_hidden_states"].clone().requires_grad_()
        loss, entropy_sum, n_valid = function(
            hidden, call["teacher_hidden_states"], student.get_output_embeddings().weight,
            completion_mask=call["completion_mask"], **common)
        loss.backward()
        results.append((loss, entropy_sum, n_valid, hidden.grad, student.get_output_embeddings().weight.grad.clone()))
    (ours, theirs) = results
    assert int(ours[2]) == int(theirs[2]) == 8
    for what, a, b in zip(("loss", "entropy_sum", "", "d_hidden", "d_weight"), ours, theirs):
        assert torch.allclose(a.float(), b.float(), rtol=RTOL, atol=1e-7), what


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "v_proj", "lm_head"])


def test_lora_on_the_students_lm_head_trains_with_its_adapter(tmp_path):
    """TRL refuses a LoRA adapter on lm_head (its kernel reads the bare weight); on a patched student it passes and
    trains, and the loss's gradients are those of the divergence computed from the full logits of the PEFT model
    (the adapter applied by PEFT's own layer): every trainable parameter, the adapter's included."""
    build = _distillation_builder(tmp_path, make_teacher(), max_steps=1)
    with pytest.raises(ValueError, match="lm_head"):
        build(make_word_model(), [], peft_config=_lora_config())  # TRL on its own

    trainer = build(hf_fused.apply_fused_loss(make_word_model()), [], peft_config=_lora_config())
    model = trainer.model
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    n_items = inputs["num_items_in_batch"]
    model.zero_grad()
    trainer.compute_loss(model, inputs).backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.zero_grad()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].size(1)
    hidden = trainer._get_last_hidden_state(model, ids, attention, keep)
    student_logp = model.get_output_embeddings()(hidden).float().log_softmax(-1)  # PEFT's layer, adapter included
    with torch.no_grad():
        teacher_hidden = trainer._get_last_hidden_state(trainer.teacher_model, ids, attention, keep)
        teacher_logp = trainer.teacher_model.get_output_embeddings()(teacher_hidden).float().log_softmax(-1)
    reverse_kl = (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)  # beta = 1
    (reverse_kl * inputs["completion_mask"]).sum().div(n_items).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            err = (fused[n] - p.grad).norm() / p.grad.norm()
            assert err <= RTOL, (n, err.item())
    assert any("lm_head.lora_B" in n and g.abs().sum() > 0 for n, g in fused.items())

    head = {n: p.detach().clone() for n, p in model.named_parameters() if "lm_head.lora_" in n}
    assert len(head) == 2
    trainer.train()
    for n, before in head.items():
        assert not torch.equal(model.get_parameter(n), before), f"{n} did not train"


def test_changed_trl_function_is_refused_loudly(monkeypatch):
    """A TRL whose ``_chunked_divergence_loss`` takes other arguments: nothing is rebound, a warning says TRL's kernel
    will be used."""
    def _chunked_divergence_loss(student_hidden_states, teacher_hidden_states, beta, chunk_size=4096):
        raise AssertionError("not called here")

    hf_fused.integrations.uninstall_all()
    monkeypatch.setattr(trl_distillation, "_chunked_divergence_loss", _chunked_divergence_loss)
    try:
        with pytest.warns(UserWarning, match="DistillationTrainer will compute its loss with TRL's own kernel"):
            hf_fused.apply_fused_loss(make_word_model())
        assert trl_distillation._chunked_divergence_loss is _chunked_divergence_loss
    finally:
        hf_fused.integrations.uninstall_all()  # the next patch installs on TRL's own function again


# ----------------------------------------------------------------------------------------------------------------
# GKDTrainer


@pytest.mark.parametrize("lmbda,beta,patch", [(0.0, 0.5, "before"), (1.0, 0.5, "after"), (0.5, 0.0, "before"),
                                              (1.0, 1.0, "before")])
def test_gkd_matches_trl(lmbda, beta, patch, tmp_path, monkeypatch):
    """GKD's generalized JSD (its default β = 0.5; forward and reverse KL) off-policy (the dataset's completions,
    ``lmbda=0``), on-policy (the student's generations, ``lmbda=1``) and mixed, from hidden states."""
    build = _gkd_builder(tmp_path, make_teacher(), lmbda=lmbda, beta=beta)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLossBypassedWarning)  # the student's logits are never built
        _, fused = _parity(build, monkeypatch, patch=patch)
    assert fused[3].hf_fused == 4


def test_gkd_under_bf16_is_a_close_twin_of_trl(tmp_path, monkeypatch):
    """TRL's default ``bf16=True`` (autocast on CPU): see the module docstring for the bounds."""
    teacher, student = make_teacher(), make_word_model()
    runs = {}
    for name, bf16, patch in (("stock", True, None), ("fused", True, "before"), ("fp32", False, None)):
        build = _gkd_builder(tmp_path, teacher, lmbda=1.0, bf16=bf16)
        runs[name] = _train(build, copy.deepcopy(student), patch=patch,
                            monkeypatch=monkeypatch if name == "fused" else None)
    (_, logs_a, grads_a, counting), (_, logs_b, grads_b, _) = runs["fused"], runs["stock"]
    assert counting.hf_fused == 4
    for a, b in zip(logs_a, logs_b):
        assert a.keys() == b.keys()
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=3e-2, abs_tol=2e-2), (key, a[key], b[key])
    for ga, gb in zip(grads_a, grads_b):
        flat_a, flat_b = (torch.cat([g.flatten() for g in grads.values()]) for grads in (ga, gb))
        assert torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0) >= 0.999
    fp32 = dict(runs["fp32"][0].model.named_parameters())
    initial = dict(student.named_parameters())

    def distance(run):  # from the fp32 run's parameters, relative to the fp32 update
        params = dict(runs[run][0].model.named_parameters())
        return max(((params[n] - fp32[n]).norm() / (fp32[n] - initial[n]).norm()).item() for n in fp32)

    assert distance("fused") <= 1.25 * distance("stock"), (distance("fused"), distance("stock"))


def test_gkd_with_its_own_divergence_says_why_and_what_to_do(tmp_path, monkeypatch):
    """A ``GKDTrainer`` subclass with its own ``generalized_jsd_loss`` (a divergence of the logits hf_fused cannot
    know): TRL's ``compute_loss`` runs (the same training as the unpatched subclass) and one warning says why and
    what to do."""
    from trl.experimental.gkd import GKDTrainer

    class SkewedGKD(GKDTrainer):
        @staticmethod
        def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                                 reduction="batchmean", num_items_in_batch=None):
            return GKDTrainer.generalized_jsd_loss(student_logits, 0.5 * teacher_logits, labels, beta, temperature,
                                                   reduction, num_items_in_batch)

    build = _gkd_builder(tmp_path, make_teacher(), trainer_cls=SkewedGKD, lmbda=0.0)
    stock = _train(build, make_word_model(), patch=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = _train(build, make_word_model(), patch="before", monkeypatch=monkeypatch)
    said = [str(w.message) for w in caught if issubclass(w.category, FusedLossBypassedWarning)]
    assert len(said) == 1, said
    assert "SkewedGKD overrides generalized_jsd_loss" in said[0] and "DistillationTrainer" in said[0]
    assert fused[3].hf_fused == 0
    assert_same_training(fused, stock)


def test_gkd_with_a_teacher_head_hf_fused_cannot_read_says_so(tmp_path, monkeypatch):
    """A teacher whose lm_head is not a linear map hf_fused can read: TRL's ``compute_loss``, the same training as
    stock, and one warning naming the teacher's head."""

    class ScaledHead(torch.nn.Linear):
        def forward(self, hidden):
            return 2 * super().forward(hidden)

    teacher = make_teacher()
    head = ScaledHead(TEACHER_HIDDEN, WORD_VOCAB, bias=False)
    head.weight = teacher.lm_head.weight
    teacher.lm_head = head
    build = _gkd_builder(tmp_path, teacher, lmbda=0.0)
    stock = _train(build, make_word_model(), patch=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = _train(build, make_word_model(), patch="before", monkeypatch=monkeypatch)
    said = [str(w.message) for w in caught if issubclass(w.category, FusedLossBypassedWarning)]
    assert len(said) == 1 and "cannot read the teacher's head" in said[0] and "ScaledHead" in said[0], said
    assert fused[3].hf_fused == 0
    assert_same_training(fused, stock)


# ----------------------------------------------------------------------------------------------------------------
# Memory: no [tokens, vocab] tensor on hf_fused


def _largest_vocab_activation(trainer, vocab: int) -> int:
    """The most rows of a freshly computed tensor with the vocabulary as its last dimension, over training (the
    ``[V, H]`` parameters and gradients of both models left out)."""
    with VocabRows(vocab, min_numel=(TEACHER_HIDDEN + 8) * vocab) as rec:
        trainer.train()
    return rec.max_rows


@pytest.mark.parametrize("name", ["distillation", "gkd"])
def test_no_vocab_sized_activation_on_hf_fused(name, tmp_path):
    """One step on 8 sequences of 5 completion tokens (40 rows, and more for GKD's prompts): no tensor with the
    vocabulary as its last dimension has more rows than generation's ``[8, V]`` logits, with tiles of 4 rows.
    Control: stock GKD builds both models' ``[B, T, V]`` logits and the check sees them (TRL's distillation kernel
    is chunked too)."""
    tile_rows, generation_rows = 4, 8
    budget = dict(tile_budget_bytes=6 * 4 * WORD_VOCAB * tile_rows)  # the plain-PyTorch pass's 6 fp32 [rows, V] buffers
    builders = {"distillation": _distillation_builder, "gkd": _gkd_builder}
    build = builders[name](tmp_path, make_teacher(), max_steps=1, per_device_train_batch_size=generation_rows,
                           gradient_accumulation_steps=1, **({"lmbda": 1.0} if name == "gkd" else {}))
    assert _largest_vocab_activation(build(hf_fused.apply_fused_loss(make_word_model(), **budget), []),
                                     WORD_VOCAB) <= generation_rows
    if name == "gkd":
        assert _largest_vocab_activation(build(make_word_model(), []), WORD_VOCAB) > 5 * generation_rows
