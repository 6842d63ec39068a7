"""The statistics kernel (``triton_kernels.stats_kernel``) on its own, against float64.

Runs the compiled kernel where CUDA is available, else under Triton's interpreter on CPU (conftest sets
TRITON_INTERPRET=1): a row folded chunk by chunk into the
running statistics, with masked tails, rows shorter than one column block, tied maxima inside one lane, across
lanes and across chunks (the first one must win, ``torch.argmax``'s rule), a bias and the logit transforms.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops.backends.triton_cublas import triton_kernels as TK  # noqa: E402

from references import apply_transform as _transform  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ties(v):
    return [(3, 5), (9, min(40, v - 3)), (0, v - 1), (v - 20, v - 2)]


def _tied_logits(n, v, seed):
    """Logits of standard deviation 4 whose rows repeat their maximum at chosen columns: row 0 inside one
    8-column lane (3, 5), row 1 in two lanes of one block (9, 40), row 2 in the first and in the last column
    (chunk boundaries fall between them), row 3 across the last, partial column block."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 4
    top = z.abs().max() + 1
    for row, cols in enumerate(_ties(v)):
        z[row, list(cols)] = top
    return z


@pytest.mark.parametrize("block", [64, 512])
@pytest.mark.parametrize("v, chunks", [(37, 1), (1024, 1), (1037, 1), (1037, 3), (300, 2)])
@pytest.mark.parametrize("kw", [{}, {"softcap": 30.0, "temperature": 0.7}, {"logit_scale": 0.5}],
                         ids=["plain", "softcap-temperature", "scale"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_statistics_match_float64(block, v, chunks, kw, bias):
    n = 6
    raw = _tied_logits(n, v, seed=v + chunks)
    b = torch.randn(v, generator=torch.Generator().manual_seed(1)) if bias else None
    if bias:  # keep the ties tied after the bias: the tied columns get equal biases
        for cols in _ties(v):
            b[list(cols)] = 0.0
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(2))
    raw, labels, b = raw.to(DEVICE), labels.to(DEVICE), (b.to(DEVICE) if bias else None)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    m, s, t, zy = torch.full((n,), float("-inf"), **f32), torch.zeros(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
    z_sum, sum_sq = torch.zeros(n, **f32), torch.zeros(n, **f32)
    arg = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    scalars = dict(
        logit_scale=float(kw.get("logit_scale", 1.0)), softcap=float(kw.get("softcap", 1.0)),
        inv_temperature=1.0 / kw.get("temperature", 1.0), HAS_BIAS=bias, SOFTCAP="softcap" in kw,
        SCALED="logit_scale" in kw or "temperature" in kw,
    )
    bounds = [round(i * v / chunks) for i in range(chunks + 1)]
    for c0, c1 in zip(bounds, bounds[1:]):
        tile = raw[:, c0:c1].contiguous()
        TK.stats_kernel[(n,)](
            tile, tile.stride(0), c1 - c0, c0, b if bias else labels, labels, m, s, t, zy, z_sum, arg, sum_sq,
            ENTROPY=True, SUM_Z=True, ARGMAX=True, SUM_SQ=True, BLOCK_V=block, **scalars,
        )

    z = _transform(raw.double() + (b.double() if bias else 0.0), kw)
    p = z.softmax(-1)
    lse = m.double() + s.double().log()
    torch.testing.assert_close(lse, z.logsumexp(-1), rtol=0, atol=1e-5 * z.abs().max().item())
    # Σ exp(z − m)·z / Σ exp(z − m) = Σ p·z; fp32 sums of ~1000 terms of size ≤ |z|
    torch.testing.assert_close((t / s).double(), (p * z).sum(-1), rtol=1e-5, atol=1e-5)
    # the transform in fp32 (the soft-cap's tanh as 2·sigmoid(2x) − 1: a few fp32 ulps of the cap)
    torch.testing.assert_close(zy.double(), z.gather(1, labels[:, None])[:, 0], rtol=0,
                               atol=1e-6 * z.abs().max().item())
    torch.testing.assert_close(z_sum.double(), z.sum(-1), rtol=1e-5, atol=1e-4 * math.sqrt(v))
    torch.testing.assert_close((sum_sq / s**2).double().log(), (p**2).sum(-1).log(), rtol=0, atol=1e-5)
    assert arg.tolist() == z.argmax(-1).tolist()
