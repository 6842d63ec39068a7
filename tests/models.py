"""Tiny causal LMs and tokenizers built from configs (no downloads), and the harness that compares a patched
model with its unpatched copy.

Two families, each with its own names:

* :func:`make_model` (:func:`make_config`, :func:`make_batch`): the model-layer suite's models, one per
  architecture in :data:`ARCHITECTURES`. Hidden size 32, 2 layers, 4 attention heads, a 128-token vocabulary
  (:data:`VOCAB`), fp32, a fixed seed. ``initializer_range`` is raised from the usual 0.02 so the logits are O(1):
  then the architectures' logit transforms (Gemma's soft-cap, Cohere's ``logit_scale``, Granite's
  ``logits_scaling``) change the loss visibly and a fused path that missed one would fail.
* :func:`make_word_model` and :func:`make_tokenizer`: the trainer suites' policy over a word-level vocabulary
  (:data:`WORDS`, :data:`WORD_VOCAB` tokens), for TRL's trainers, which tokenize text.

The parity harness (:func:`grads`, :func:`loss_and_grads`, :func:`patched_and_reference`) collects what
``references.assert_same_grads`` compares: the loss AND every parameter gradient; :func:`train_on_tokens` trains a
model with ``transformers.Trainer`` and returns its logged losses, grad norms and final parameters.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Trainer,
    TrainingArguments,
)

# -- the model-layer suite's models, one per architecture ----------------------------------------------------

HIDDEN = 32
LAYERS = 2
HEADS = 4
VOCAB = 128

#: Common config fields; every architecture accepts these.
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: name → (config class, model class, architecture-specific config fields).
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=8, sliding_window=None)),
    # final_logit_softcapping small so tanh actually bends O(1) logits
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=1.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=8,
             sliding_window=16),
    ),
    "gemma3_text": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=1.5, query_pre_attn_scalar=8, sliding_window=16),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "granite": (
        "GraniteConfig", "GraniteForCausalLM",
        dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
             output_router_logits=True, router_aux_loss_coef=0.1),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
             router_aux_loss_coef=0.1, sliding_window=None),
    ),
}

#: The architectures the per-architecture parity suite runs (MoE included).
ARCH_NAMES = list(ARCHITECTURES)


def make_config(arch: str = "llama", *, tie_word_embeddings: Optional[bool] = None, **overrides):
    """The ``transformers`` config of :func:`make_model` (eager attention); ``overrides`` replace its fields."""
    config_cls, _, extra = ARCHITECTURES[arch]
    fields = {**_COMMON, **extra, **overrides}
    if tie_word_embeddings is not None:
        fields["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, config_cls)(**fields)
    config._attn_implementation = "eager"
    return config


def make_model(arch: str = "llama", *, seed: int = 0, tie_word_embeddings: Optional[bool] = None, **overrides):
    """A tiny fp32 ``*ForCausalLM`` in train mode (dropouts are 0 in every config, so it is deterministic)."""
    config = make_config(arch, tie_word_embeddings=tie_word_embeddings, **overrides)
    model_cls = getattr(transformers, ARCHITECTURES[arch][1])
    torch.manual_seed(seed)
    model = model_cls(config).float()
    if tie_word_embeddings is False:
        assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    elif tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.train()
    return model


def make_batch(batch: int = 2, seq: int = 12, *, seed: int = 1, vocab: int = VOCAB, ignore: bool = True):
    """``(input_ids, attention_mask, labels)``; labels have -100 on a prompt prefix and on padding, with a
    different number of ignored tokens per row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    if ignore:
        for row in range(batch):
            prefix = 1 + (row * 3) % max(1, seq // 2)
            labels[row, :prefix] = -100
            if row % 2 == 1:  # right padding on odd rows
                pad = 2 + row % 3
                input_ids[row, -pad:] = 0
                attention_mask[row, -pad:] = 0
                labels[row, -pad:] = -100
    return input_ids, attention_mask, labels


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient by name (a missing gradient shows up as ``None``); names
    without ``torch.compile``'s ``_orig_mod.`` prefix."""
    return {n.replace("_orig_mod.", ""): (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()
            if p.requires_grad}


def loss_and_grads(model: torch.nn.Module, call: Callable[[torch.nn.Module], torch.Tensor], seed: Optional[int] = None):
    """Zero grads, run ``call(model)`` → scalar, backward; returns ``(loss, grads)``. With ``seed``, seeds the
    RNG right before the forward (so dropout masks match between two models)."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = call(model)
    loss.backward()
    return loss.detach(), grads(model)


def patched_and_reference(model: torch.nn.Module, **apply_kwargs):
    """``(patched, reference)``: ``reference`` is an unpatched deep copy taken before patching."""
    from hf_fused import apply_fused_loss

    reference = copy.deepcopy(model)
    apply_fused_loss(model, **apply_kwargs)
    return model, reference



# -- a tiny model trained with transformers.Trainer ----------------------------------------------------------


def token_dataset(n: int = 8, seed: int = 0, seq: int = 12) -> Dataset:
    """``n`` rows of ``seq`` random token ids of :data:`VOCAB`, each row's labels ignored (-100) on a prompt prefix
    of random length."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (seq,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, seq - 2, (1,), generator=g))] = -100
        rows.append(dict(input_ids=ids.tolist(), attention_mask=[1] * seq, labels=labels.tolist()))
    return Dataset.from_list(rows)


TRAIN, EVAL = token_dataset(8, seed=0), token_dataset(4, seed=1)


def trainer_args(tmp_path, **overrides) -> TrainingArguments:
    """3 logged steps on the CPU at a constant learning rate, batch 2, fp32, no saving; ``overrides`` applied."""
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", seed=0, data_seed=0,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3, logging_steps=1,
        learning_rate=5e-3, lr_scheduler_type="constant", warmup_steps=0, bf16=False, disable_tqdm=True,
        dataloader_num_workers=0, max_grad_norm=1.0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def train_on_tokens(model, tmp_path, **overrides):
    """``model`` trained by ``transformers.Trainer`` on :data:`TRAIN` (:func:`trainer_args` with ``overrides``):
    what :func:`trained` returns."""
    return trained(Trainer(model=model, args=trainer_args(tmp_path, **overrides), train_dataset=TRAIN))


def trained(trainer):
    """Train; the logged losses and grad norms, and the final parameters as one vector (float64)."""
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return (
        torch.tensor([e["loss"] for e in logs], dtype=torch.float64),
        torch.tensor([e["grad_norm"] for e in logs], dtype=torch.float64),
        torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()]),
    )

# -- the trainer suites' policy and tokenizer over a word-level vocabulary ------------------------------------

SPECIALS = ["[PAD]", "[EOS]", "[UNK]"]
WORDS = (
    "the a an one two three four five six seven eight nine ten red green blue cat dog fish bird tree "
    "river stone cloud rain sun moon star is was are and or not yes no to of in on at by up down left "
    "right big small hot cold fast slow old new good bad"
).split()
PAD_ID, EOS_ID = 0, 1
NUM_SPECIAL = len(SPECIALS)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``SPECIALS + WORDS`` (whitespace split), padding on the left as TRL generates."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    fast.padding_side = "left"
    return fast


WORD_VOCAB = len(SPECIALS) + len(WORDS)


def make_word_model(arch: str = "llama", seed: int = 0, dtype=torch.float32, tie: bool = False):
    """A 2-layer, hidden-32 causal LM over :func:`make_tokenizer`'s vocabulary (random weights, deterministic in
    ``seed``), its head scaled up so that log-probs, entropies and ratios spread out: the trainer tests' policy.
    ``arch``: "llama", "qwen3" or "qwen3moe"."""
    common = dict(
        vocab_size=WORD_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        tie_word_embeddings=tie,
    )
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen3":
        config, cls = Qwen3Config(head_dim=8, **common), Qwen3ForCausalLM
    elif arch == "qwen3moe":  # MoE: TRL adds the router load-balancing loss (router_aux_loss_coef != 0)
        config = Qwen3MoeConfig(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                router_aux_loss_coef=0.05, **common)
        cls = Qwen3MoeForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    # Random init gives near-uniform next-token distributions; scale the head up so log-probs, entropies and
    # ratios spread out and every branch (clipping, masks) is exercised.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(16.0)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model


# -- stand-ins saved once per test session ---------------------------------------------------------------------

#: Tiny models other processes load with ``from_pretrained`` (tests/distributed), by name; conftest's
#: ``saved_models`` fixture saves each once per test session. A prime vocabulary (131) splits unevenly over 2 or 3
#: ranks: FSDP2 shards a tied lm_head / embedding's rows 66 + 65 (44 + 44 + 43), the last shard padded (the
#: 128k-256k vocabularies divide by 2 but not always by the world size, and GPT-2's 50,257 by none).
def preference_dataset(rows: int = 8):
    """Preference pairs (``prompt``, ``chosen``, ``rejected``) in :func:`make_tokenizer`'s words, of varied lengths."""
    from datasets import Dataset

    def sentence(i: int, n: int) -> str:
        return " ".join(WORDS[(7 * i + 3 * k) % len(WORDS)] for k in range(n))

    return Dataset.from_dict({"prompt": [sentence(i, 2 + i % 3) for i in range(rows)],
                              "chosen": [" " + sentence(50 + i, 2 + i % 4) for i in range(rows)],
                              "rejected": [" " + sentence(90 + i, 1 + i % 5) for i in range(rows)]})


SAVED_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": lambda: make_model("llama", tie_word_embeddings=False),
    "qwen3-tied": lambda: make_model("qwen3", tie_word_embeddings=True),
    "qwen3-tied-odd-vocab": lambda: make_model("qwen3", tie_word_embeddings=True, vocab_size=131),
    "word-llama": lambda: make_word_model("llama"),
}


def count_calls(monkeypatch, module, name: str) -> dict:
    """Counts, from now on, the calls of ``module.name`` (a function looked up there at call time):
    ``{"calls": n}``."""
    counts = {"calls": 0}
    function = getattr(module, name)

    def counted(*args, **kwargs):
        counts["calls"] += 1
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return counts


class GradRecorder(transformers.TrainerCallback):
    """A trainer callback that records every trainable parameter's gradient at each optimizer step (after
    accumulation, before clipping): what the trainer suites compare between a patched and a stock run."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad and p.grad is not None})


def is_timing_metric(key: str) -> bool:
    """A logged value that measures time (runtime, throughput): differs between two identical runs."""
    return "runtime" in key or "per_second" in key or key.endswith("time") or "/time" in key


def assert_same_gradients(got: list, ref: list, rtol: float) -> None:
    """Each step's recorded gradients (:class:`GradRecorder`'s ``{name: tensor}`` per step) in ``got`` against
    ``ref``'s same steps: the same parameters, each within ``rtol`` of its largest entry (1e-7 absolute); and the
    reference's first step moved something."""
    for step, (ga, gb) in enumerate(zip(got, ref)):
        assert ga.keys() == gb.keys() and ga, set(ga) ^ set(gb)
        for name in gb:
            scale = gb[name].abs().max().item()
            err = (ga[name] - gb[name]).abs().max().item()
            assert err <= rtol * scale + 1e-7, f"step {step} grad {name}: {err:.3g} vs scale {scale:.3g}"
    assert any(g.abs().sum() > 0 for g in ref[0].values())


def assert_same_training(got, ref, *, rtol: float = 1e-5, steps_at_rtol: int = 2) -> None:
    """Two ``(trainer, logs, gradient steps, counters)`` runs of two optimizer steps trained alike: every logged
    metric at every step, the first ``steps_at_rtol`` steps' gradients (each parameter's to ``rtol`` of its largest
    entry) and, with both steps, the final parameters, to ``rtol`` (1e-7 absolute)."""
    (trainer_a, logs_a, grads_a, _), (trainer_b, logs_b, grads_b, _) = got, ref
    assert len(logs_a) == len(logs_b) and len(grads_a) == len(grads_b) == 2
    for a, b in zip(logs_a, logs_b):
        assert a.keys() == b.keys(), set(a) ^ set(b)
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=rtol, abs_tol=1e-7), (key, a[key], b[key])
    assert_same_gradients(grads_a[:steps_at_rtol], grads_b, rtol)
    if steps_at_rtol < 2:
        return
    for (name, a), (_, b) in zip(trainer_a.model.named_parameters(), trainer_b.model.named_parameters()):
        assert (a - b).abs().max() <= rtol * b.abs().max() + 1e-7, name
