"""Every way users call a patched model, through the entry points they use.

``apply_fused_loss`` + plain ``transformers.Trainer`` under its default-in-practice precision
(``bf16=True``: autocast on an fp32 model), evaluation that needs logits, a loss Trainer computes itself,
``return_dict=False``, accelerate's output wrapper, ``torch.compile`` (directly and ``Trainer(torch_compile=True)``),
saving and loading, and the models hf_fused refuses.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from transformers import Trainer

from models import EVAL, TRAIN, VOCAB, make_batch, make_model  # noqa: E402
from models import trainer_args as _args, train_on_tokens as _train, trained as _trained  # noqa: E402
from references import assert_close, rel_err as _rel  # noqa: E402

from hf_fused import apply_fused_loss, is_fused  # noqa: E402
from hf_fused.model import FusedLossBypassedWarning  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ---------------------------------------------------------------------------------- Trainer(bf16=True)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_trainer_bf16_is_no_further_from_fp32_than_unpatched(tmp_path, device):
    """The README's example on CPU: ``apply_fused_loss`` then ``Trainer(bf16=True)`` (autocast on an fp32
    model; it crashed in the first backward before). Three steps against the unpatched ``Trainer(bf16=True)``
    and an fp32 run: the final parameters (a vector, so its error is a stable statistic) are as close to
    the fp32 run's as the unpatched bf16 run's (within 1.25×, the bound the ops meet under autocast). The
    logged losses and grad norms are single numbers whose bf16 error cancels or not by chance, so they are
    held to the two bf16 runs agreeing: both round every layer to bf16 (2**-8 relative per rounding) and
    differ only in the head's roundings, which moves the loss by under 2**-8 and the grad norm by a few
    roundings (1e-2)."""
    base = make_model("qwen3", tie_word_embeddings=False).to(device)
    on = dict(use_cpu=device == "cpu")
    fp32 = _train(copy.deepcopy(base), tmp_path / "fp32", **on)
    eager = _train(copy.deepcopy(base), tmp_path / "eager", bf16=True, **on)
    fused = _train(apply_fused_loss(copy.deepcopy(base)), tmp_path / "fused", bf16=True, **on)
    e, f = _rel(eager[2], fp32[2]), _rel(fused[2], fp32[2])
    assert e > 0, "bf16 changed nothing: autocast was not on"
    assert f <= 1.25 * e, f"final parameters: fused bf16 error {f:.3g} vs unpatched bf16 {e:.3g}"
    assert float(((fused[0] - eager[0]) / eager[0]).abs().max()) <= 2.0**-8, (fused[0], eager[0])
    assert float(((fused[1] - eager[1]) / eager[1]).abs().max()) <= 1e-2, (fused[1], eager[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_autocast_gradients_no_further_from_fp32_than_unpatched(arch, device):
    """One forward+backward under bf16 autocast, every parameter's gradient (one vector) against the fp32
    unpatched model's: the patched model's error is at most 1.25× the unpatched model's under the same
    autocast (Gemma 2: soft-cap)."""
    base = make_model(arch, tie_word_embeddings=False).to(device)
    input_ids, attention_mask, labels = (t.to(device) for t in make_batch())

    def grad_vector(model, autocast):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    ref = grad_vector(copy.deepcopy(base), False)
    e = _rel(grad_vector(copy.deepcopy(base), True), ref)
    f = _rel(grad_vector(apply_fused_loss(copy.deepcopy(base)), True), ref)
    assert 0 < e and f <= 1.25 * e, f"fused bf16 gradient error {f:.3g} vs unpatched {e:.3g}"


# ---------------------------------------------------------------------------------- torch.compile


def test_compiled_patched_model_runs_the_fused_loss_and_matches_eager():
    """``torch.compile`` of a patched model with Dynamo on (AOTAutograd traces the patched forward and the op's
    backward; the ``aot_eager`` backend skips only inductor's code generation, a minute on 2 cores): no logits
    (the fused path ran, not a traced stock forward), and the loss and every gradient equal the unpatched eager
    model's (fp32, relative 1e-5, references.RTOL)."""
    import torch._dynamo

    base = make_model("llama", tie_word_embeddings=False)
    ref = copy.deepcopy(base)
    input_ids, attention_mask, labels = make_batch(seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(apply_fused_loss(base), backend="aot_eager")
    out = compiled(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    out.loss.backward()
    expected = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    expected.loss.backward()
    assert out.logits is None
    # The patch adds no graph break of its own around the backbone (a types.MethodType built in the forward was
    # one); what remains is the head's host sync and its autograd Function.
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert not [reason for reason in breaks if "<class 'method'>" in reason], list(breaks)
    assert_close(out.loss, expected.loss, "loss under torch.compile")
    for (name, p), q in zip(base.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"{name}.grad under torch.compile")


def test_trainer_torch_compile_matches_unpatched(tmp_path):
    """``Trainer(torch_compile=True)`` (the model compiled when the Trainer prepares it; ``aot_eager`` as in the
    test above) with ``apply_fused_loss`` against the unpatched model under the same setting: logged losses,
    grad norms and final parameters (fp32: relative 1e-5)."""
    import torch._dynamo

    base = make_model("qwen3", tie_word_embeddings=False)
    options = dict(torch_compile=True, torch_compile_backend="aot_eager")
    torch._dynamo.reset()
    stock = _train(copy.deepcopy(base), tmp_path / "stock", **options)
    torch._dynamo.reset()
    trainer = Trainer(model=apply_fused_loss(copy.deepcopy(base)), args=_args(tmp_path / "fused", **options),
                      train_dataset=TRAIN)
    fused = _trained(trainer)
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule), type(trainer.model_wrapped)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "Dynamo traced nothing"
    for what, f, s in zip(("losses", "grad norms", "parameters"), fused, stock):
        assert _rel(f, s) <= 1e-5, f"{what}: {_rel(f, s):.3g}"


# ---------------------------------------------------------------------------- evaluation needing logits


@pytest.mark.parametrize("entry", ["evaluate_compute_metrics", "predict", "preprocess_logits_for_metrics"])
def test_plain_trainer_predictions_are_real_logits(tmp_path, entry):
    base = make_model("llama")
    results = {}
    for name, model in (("unpatched", copy.deepcopy(base)), ("fused", apply_fused_loss(copy.deepcopy(base)))):
        seen = {}

        def compute_metrics(pred):
            seen["predictions"] = torch.as_tensor(pred.predictions)
            return {"mean_prediction": float(seen["predictions"].double().mean())}

        kwargs = dict(model=model, args=_args(tmp_path / name), eval_dataset=EVAL)
        if entry != "predict":
            kwargs["compute_metrics"] = compute_metrics
        if entry == "preprocess_logits_for_metrics":
            kwargs["preprocess_logits_for_metrics"] = lambda logits, labels: logits.argmax(-1)
        trainer = Trainer(**kwargs)
        if entry == "predict":
            out = trainer.predict(EVAL)
            results[name] = (torch.as_tensor(out.predictions), out.metrics["test_loss"])
        else:
            metrics = trainer.evaluate()
            results[name] = (seen["predictions"], metrics["eval_loss"])
        assert is_fused(trainer.model) == (name == "fused")
    (got, got_loss), (want, want_loss) = results["fused"], results["unpatched"]
    assert got.shape == want.shape and got.numel() > 0
    assert_close(got.double(), want.double(), what=f"{entry} predictions")
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)


def test_loss_only_evaluation_stays_fused(tmp_path):
    """Without compute_metrics Trainer evaluates the loss only: the fused path, no logits."""
    model = apply_fused_loss(make_model("llama"))
    calls = []
    original = model.lm_head.forward
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape[-1]))
    trainer = Trainer(model=model, args=_args(tmp_path), eval_dataset=EVAL)
    trainer.evaluate()
    assert calls and set(calls) == {0}, f"lm_head produced logits of width {set(calls)} in a loss-only evaluation"
    assert model.lm_head.forward == original


# ---------------------------------------------------------------------------- losses Trainer computes itself


@pytest.mark.parametrize("how", ["label_smoothing", "compute_loss_func"])
def test_trainer_loss_without_labels_warns_once_and_is_the_unpatched_one(tmp_path, how):
    overrides, trainer_kwargs = {}, {}
    if how == "label_smoothing":
        overrides["label_smoothing_factor"] = 0.1
    else:
        from transformers.loss.loss_utils import ForCausalLMLoss

        trainer_kwargs["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: ForCausalLMLoss(
            outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch
        )
    base = make_model("llama")
    logs = {}
    for name, model in (("unpatched", copy.deepcopy(base)), ("fused", apply_fused_loss(copy.deepcopy(base)))):
        trainer = Trainer(model=model, args=_args(tmp_path / name, **overrides), train_dataset=TRAIN, **trainer_kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        bypass = [w for w in caught if issubclass(w.category, FusedLossBypassedWarning)]
        assert len(bypass) == (1 if name == "fused" else 0), [str(w.message) for w in bypass]
        logs[name] = torch.tensor([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert_close(logs["fused"], logs["unpatched"], what=f"{how} losses")


def test_generation_does_not_warn():
    model = apply_fused_loss(make_model("llama"))
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLossBypassedWarning)
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)


# ----------------------------------------------------------------------------------- output layouts


def test_return_dict_false_keeps_transformers_tuple_positions():
    model = make_model("llama")
    ref = copy.deepcopy(model)
    apply_fused_loss(model)
    input_ids, attention_mask, labels = make_batch()
    with torch.no_grad():
        got = model(input_ids=input_ids, labels=labels, return_dict=False, use_cache=True)
        want = ref(input_ids=input_ids, labels=labels, return_dict=False, use_cache=True)
        dict_out = model(input_ids=input_ids, labels=labels)
    assert len(got) == len(want)
    assert got[1] is None and dict_out.logits is None  # the documented stand-in for the logits
    assert_close(got[0], want[0], what="tuple loss")
    assert type(got[2]) is type(want[2])  # past_key_values where the unpatched model has it


def test_outputs_survive_accelerates_fp32_output_wrapper():
    """Under mixed precision accelerate wraps forward with ``convert_outputs_to_fp32``, which rebuilds the
    output from its keys: ``entropy`` must still read as None when not requested, not raise."""
    from accelerate.utils import convert_outputs_to_fp32

    model = apply_fused_loss(make_model("llama"))
    input_ids, _, labels = make_batch()
    wrapped = convert_outputs_to_fp32(model.forward)
    out = wrapped(input_ids=input_ids, labels=labels, fused_output="logprobs")
    assert out.entropy is None and out.logprobs.shape == labels.shape
    out = wrapped(input_ids=input_ids, labels=labels, fused_output="logprobs", return_entropy=True)
    assert out.entropy.shape == labels.shape


# ------------------------------------------------------------------------------------------- saving


def test_torch_save_and_load_keep_the_patch(tmp_path):
    model = make_model("llama")
    ref = copy.deepcopy(model)
    apply_fused_loss(model, tile_budget_bytes=2**20)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert is_fused(loaded) and loaded._hf_fused.tile_budget_bytes == 2**20
    assert loaded.forward.__self__ is loaded
    input_ids, _, labels = make_batch()
    with torch.no_grad():
        out = loaded(input_ids=input_ids, labels=labels)
        assert out.logits is None
        assert_close(out.loss, ref(input_ids=input_ids, labels=labels).loss, what="loss after torch.load")


def test_save_pretrained_reloads_unpatched(tmp_path):
    model = apply_fused_loss(make_model("llama"))
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert not is_fused(reloaded)
    input_ids, _, labels = make_batch()
    with torch.no_grad():
        assert reloaded(input_ids=input_ids, labels=labels).logits.shape[-1] == VOCAB
    apply_fused_loss(reloaded)
    assert is_fused(reloaded)


# ------------------------------------------------------------------------------------------ refusals


def _bert_mlm():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2, decoder_start_token_id=0))


def _llama_classifier():
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(make_model("llama").config)


class _PlainModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8)

    def get_output_embeddings(self):
        return self.lm_head


@pytest.mark.parametrize("build,name,why", [
    (_bert_mlm, "BertForMaskedLM", "not a causal LM"),
    (_t5, "T5ForConditionalGeneration", "encoder-decoder"),
    (_llama_classifier, "LlamaForSequenceClassification", "could not find a causal LM"),
    (_PlainModule, "_PlainModule", "not one"),
])
def test_non_causal_models_are_refused_by_name(build, name, why):
    model = build()
    with pytest.raises(TypeError, match=why) as info:
        apply_fused_loss(model)
    assert name in str(info.value)
    assert not is_fused(model)


def test_lm_head_without_weight_is_not_implemented():
    model = make_model("llama", tie_word_embeddings=False)
    model.lm_head = nn.Sequential(nn.Linear(model.config.hidden_size, VOCAB, bias=False))
    with pytest.raises(NotImplementedError, match="Sequential"):
        apply_fused_loss(model)
    assert not is_fused(model)
