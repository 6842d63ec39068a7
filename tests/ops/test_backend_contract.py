"""The typed backend contract (:mod:`hf_fused.ops.backends.protocol`): both backends meet it, every method takes
one :class:`~hf_fused.ops.head_inputs.HeadInputs` first, and a call in the old positional convention fails."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from hf_fused.ops import LogitTransform
from hf_fused.ops.backends import Backend, HeadPass, NeededGrads, TokenLossBackend, TorchReferenceBackend
from hf_fused.ops.head_inputs import HeadInputs

from references import make_head_inputs

METHODS = ("logprobs_with_grads", "logprobs_forward", "logprobs_backward", "token_loss_with_grads")


def _backends():
    out = [TorchReferenceBackend()]
    try:
        from hf_fused.ops.backends.triton_cublas import TritonCublasBackend
    except ImportError:  # no triton
        return out
    return out + [TritonCublasBackend()]


BACKENDS = _backends()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_both_backends_satisfy_the_protocol(backend):
    assert isinstance(backend, Backend) and isinstance(backend, TokenLossBackend)


def test_an_object_without_the_methods_is_not_a_backend():
    class Partial:
        name = "partial"

        def logprobs_forward(self, head, *, return_entropy=False, statistics=()):
            raise NotImplementedError

    assert not isinstance(Partial(), Backend)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_method_takes_the_head_first_and_its_flags_by_keyword(backend, method):
    signature = inspect.signature(getattr(backend, method))
    params = list(signature.parameters.values())
    hints = typing.get_type_hints(getattr(type(backend), method))
    assert params[0].name == "head" and hints["head"] is HeadInputs
    keyword_only = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword_only >= ({"need"} if method != "logprobs_forward" else {"return_entropy", "statistics"})
    assert len(params) <= 6  # the head plus the method's own per-call arguments


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_the_old_positional_convention_fails_clearly(backend):
    hidden, weight, bias, labels = make_head_inputs((5,), 8, 11, seed=1)
    rows = torch.arange(5)
    with pytest.raises(TypeError, match="positional argument"):
        backend.logprobs_forward(hidden, weight, bias, labels, rows, LogitTransform(), None, False)
    with pytest.raises(TypeError, match="positional argument"):
        backend.logprobs_with_grads(hidden, weight, bias, labels, rows, torch.ones(5), LogitTransform(), None, False,
                                    True, True, True)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_forward_methods_return_a_head_pass(backend):
    hidden, weight, bias, labels = (t.detach() for t in make_head_inputs((6,), 8, 11, seed=2))
    rows = torch.tensor([0, 2, 3, 5])
    head = HeadInputs(hidden, weight, bias, labels, rows, LogitTransform(), 1 << 20)
    stats = backend.logprobs_forward(head, return_entropy=True, statistics=("is_top1",))
    assert isinstance(stats, HeadPass) and stats.grads is None
    assert stats.logprobs.shape == stats.entropy.shape == stats.lse.shape == (4,)
    assert set(stats.statistics) == {"is_top1"}
    one_pass = backend.logprobs_with_grads(head, torch.ones(4), need=NeededGrads(True, True, True))
    if one_pass is not None:  # the GPU backend may leave the one pass to the planner's two passes
        assert isinstance(one_pass, HeadPass) and one_pass.entropy is None and one_pass.statistics == {}
        rows_of_hidden = 6 if one_pass.grads.hidden_scattered else 4  # the whole gradient, or the kept rows'
        assert one_pass.grads.hidden.shape == (rows_of_hidden, 8) and one_pass.grads.bias.shape == (11,)
        torch.testing.assert_close(one_pass.logprobs, stats.logprobs)
    grads = backend.logprobs_backward(head, stats.lse, None, torch.ones(4), None, need=NeededGrads(False, True, False))
    assert grads.hidden is None and grads.weight.shape == (11, 8) and grads.bias is None


def test_needed_grads_any():
    assert not NeededGrads(False, False, False).any
    assert NeededGrads(False, False, True).any and NeededGrads(hidden=True, weight=False, bias=False).any
