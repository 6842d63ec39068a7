"""The gradients' one rounding on the GPU (``backends/triton_cublas/scaled_round.py``) gives PyTorch's bits.

``torch.mul(src, factor, out=out)`` (an fp32 product rounded once to ``out``'s dtype) is the reference: the kernel
replaces it in :meth:`HeadGrads.input_grads` of the GPU backend's gradients (``HeadGrads.mul_into``) only for
speed, so every element must be equal, for each output dtype, a factor given as a Python float or as a 0-d device
tensor (the upstream gradient), in place, and sizes that leave a partial block.
"""

import pytest
import torch

from hf_fused.ops import grads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("factor", [1.0, 0.37, "tensor"])
@pytest.mark.parametrize("n", [1, 4095, 4096 * 3 + 17])
def test_scaled_round_gives_torch_bits(dtype, factor, n):
    from hf_fused.ops.backends.triton_cublas.scaled_round import scaled_round_

    g = torch.Generator(device="cuda").manual_seed(n)
    # values spread over many binades, so that rounding ties and subnormal-free small values both occur
    src = torch.randn(n, generator=g, device="cuda") * torch.exp2(torch.randint(-20, 20, (n,), device="cuda",
                                                                               generator=g).float())
    f = torch.tensor(0.7310586, device="cuda") if factor == "tensor" else factor
    out = torch.empty(n, dtype=dtype, device="cuda")
    scaled_round_(out, src, f)
    assert torch.equal(out, torch.mul(src, f, out=torch.empty_like(out)))
    if dtype == torch.float32:
        ref = src * f
        scaled_round_(src, src, f)  # in place
        assert torch.equal(src, ref)


@pytest.mark.gpu
def test_input_grads_route_through_the_kernel_and_refuse_bad_input(monkeypatch):
    from hf_fused.ops.backends.triton_cublas import scaled_round

    calls = []
    original = scaled_round.scaled_round_
    monkeypatch.setattr(scaled_round, "scaled_round_", lambda *a: (calls.append(a[0].shape), original(*a)))
    hidden = torch.zeros(3, 8, dtype=torch.bfloat16, device="cuda")
    weight = torch.zeros(5, 8, dtype=torch.bfloat16, device="cuda")
    head = grads.HeadGrads(hidden=torch.randn(3, 8, device="cuda"), weight=torch.randn(5, 8, device="cuda"),
                           mul_into=scaled_round.mul_into)  # what the GPU backend's gradients carry
    d_h, d_w, _ = head.input_grads(hidden, weight, None, torch.arange(3, device="cuda"),
                                   torch.tensor(0.5, device="cuda"))
    assert calls == [(3, 8), (5, 8)] and d_h.dtype == d_w.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="fp32 accumulator"):
        original(torch.empty(4, device="cuda"), torch.empty(4, dtype=torch.bfloat16, device="cuda"), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        original(torch.empty(4, 2, device="cuda").t(), torch.empty(2, 4, device="cuda"), 1.0)
    with pytest.raises(ValueError, match="elements"):
        original(torch.empty(4, device="cuda"), torch.empty(5, device="cuda"), 1.0)
    with pytest.raises(ValueError, match="one element on cuda"):
        original(torch.empty(4, device="cuda"), torch.empty(4, device="cuda"), torch.tensor(1.0))


def test_the_gpu_backends_gradients_carry_its_rounding():
    """The GPU backend lends its kernels to the gradients it returns (``HeadGrads.mul_into``, and ``scale_pair`` with
    a compensated pair), so that :mod:`hf_fused.ops.grads` needs no import of the backend; on CPU tensors
    ``mul_into`` is ``torch.mul``'s product (the same bits), and a plain ``HeadGrads`` uses ``torch.mul``."""
    pytest.importorskip("triton")
    from hf_fused.ops.backends.triton_cublas import compensated_pair, scaled_round
    from hf_fused.ops.backends.triton_cublas.plan import forced_plans
    from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan
    from hf_fused.ops.head_inputs import HeadInputs, NeededGrads
    from hf_fused.ops.logit_transform import LogitTransform
    from hf_fused.ops.backends import get_backend

    assert grads.HeadGrads().mul_into is grads.torch_mul_into
    src, out = torch.randn(7, 5), torch.empty(7, 5, dtype=torch.bfloat16)
    scaled_round.mul_into(out, src, 0.3)
    assert torch.equal(out, (src * 0.3).bfloat16())
    g = torch.Generator().manual_seed(0)
    n, h, v = 16, 32, 256
    head = HeadInputs(torch.randn(n, h, generator=g).bfloat16(), torch.randn(v, h, generator=g).bfloat16(), None,
                      torch.randint(0, v, (n,), generator=g), torch.arange(n), LogitTransform(), None)
    backend, need = get_backend(torch.device("cpu"), "triton"), NeededGrads(True, True, False)
    for accumulator in ("fp32", "pair"):
        with forced_plans(one_pass=OnePassPlan(8, accumulator, 0)):
            out = backend.logprobs_with_grads(head, torch.ones(n), need=need).grads
        assert out.mul_into is scaled_round.mul_into
        assert out.scale_pair is compensated_pair.compensated_scale_  # bf16 hidden states: their gradient's pair too
    assert backend.logprobs_backward(head, torch.zeros(n), None, torch.ones(n), None, need=need).mul_into is \
        scaled_round.mul_into
