"""Parity assertions shared by tests/distributed: an engine run against the single-process reference
(fp32), and a bf16 run against the single-process unpatched run under the same bf16 setting (bf16 twins).

A run is a dict ``{"losses", "params", "initial", "world"}``: logged loss per optimizer step, every
parameter after and before training as whole fp32 CPU tensors (canonical names), and the number of ranks.

fp32 tolerances:
- logged losses: relative 1e-5. The engines average the ranks' token sums in another order than one
  process does; measured differences are ≤ 1e-7 relative.
- parameters: ``‖θ − θ_ref‖ / ‖θ_ref − θ_0‖ ≤ 2e-5`` per tensor, i.e. relative to the training update.
  The optimizer is SGD (update = −lr · gradient, no clipping) so any gradient error shows in proportion;
  the *unpatched* model under ZeRO-3 already differs from the single process by up to 1.9e-6 (reduction
  order of the reduce-scatter; measured), and a real fault (a gradient reduced twice or not at all, a
  missing 1/world, lm_head's LoRA adapter not trained, a wrong GA normalization) moves it by O(1).
  Each element's difference counts one fp32 spacing of the reference's value less (:func:`update_errors`): a
  weight is stored rounded to that spacing, so two runs whose updates differ by any amount, however small, store
  values one spacing apart wherever their exact results fall on both sides of a rounding boundary. Where the update
  is small next to the weight, one such element is a large part of it: a 32-element LayerNorm weight near 1 moved
  by 2.2e-3 (norm) in 3 steps, where one element one spacing (2^-24) apart is 2.75e-5 of the update (TRL's DPO
  script under ZeRO-3, patched against one unpatched process; every other element equal).
"""

from __future__ import annotations

import torch

from hf_fused.ops.tiling import rows_per_tile

LOSS_RTOL = 1e-5
PARAM_RTOL = 2e-5


def assert_wrapped_by(got: dict, config, processes: int = 2) -> None:
    """The run's model was wrapped by the engine its accelerate ``config`` names (a name under
    examples/distributed/, or a config file's path whose name says the engine), launched on ``processes`` ranks: a
    run under an FSDP config that came back wrapped in DDP trained nothing sharded (accelerate does that on CPU
    ranks unless ``cpu_fsdp/sitecustomize.py`` lets it apply FSDP), and it would pass every parity check. One
    process under the DDP config is a plain process: nothing wraps it."""
    name = getattr(config, "stem", config)
    if name == "ddp" and processes == 1:
        return
    wrapper = got["wrapper"]
    if "zero" in name:
        assert wrapper == "DeepSpeedEngine", wrapper
    elif "fsdp1" in name:
        assert wrapper == "FullyShardedDataParallel", wrapper
    elif "fsdp" in name:  # fully_shard's per-class subclass, e.g. FSDPLlamaForCausalLM
        assert wrapper.startswith("FSDP") and wrapper != "FullyShardedDataParallel", wrapper
    else:
        assert name == "ddp" and wrapper == "DistributedDataParallel", (name, wrapper)


def update_errors(got: dict, ref: dict, same_start: bool = True) -> dict[str, float]:
    """Per parameter ``‖θ − θ_ref‖ / ‖θ_ref − θ_0,ref‖`` (0 for a tensor neither run moved; inf for one
    that only ``got`` moved), each element's ``|θ − θ_ref|`` less one fp32 spacing of ``θ_ref`` (one rounding of
    the stored value: the module's docstring says why). ``same_start``: both runs must have started from the same
    parameters."""
    assert got["params"].keys() == ref["params"].keys()
    errors = {}
    for name, ref_p in ref["params"].items():
        if same_start:
            assert torch.equal(got["initial"][name], ref["initial"][name]), f"{name}: runs started apart"
        update = (ref_p - ref["initial"][name]).norm()
        err = ((got["params"][name] - ref_p).abs() - _spacing(ref_p)).clamp(min=0).norm()
        errors[name] = float(err / update) if update > 0 else (0.0 if err == 0 else float("inf"))
    return errors


def assert_matches_stock_under_engine(fused: dict, stock: dict, config: str, steps: int = 2) -> None:
    """A patched run against the unpatched (stock) run of the same trainer under the same engine ``config`` and 2
    ranks (worker results with ``"logs"``, every logged entry per step, and ``"fused_calls"``): hf_fused computed the
    head in the patched run and never in the stock one, under ZeRO-3 always with lm_head partitioned (its gather
    path); every numeric metric of every step within :data:`LOSS_RTOL` (+ 1e-7 absolute: fp32 sums in another
    order); every parameter within :data:`PARAM_RTOL` of stock's update (SGD: a gradient error shows in proportion),
    both from the same start, at least half of them moved."""
    import math

    assert fused["world"] == 2 and fused["fused_calls"]["all"] > 0
    if config == "zero3":
        assert fused["lm_head_numel"] == 0 and fused["fused_calls"]["partitioned"] == fused["fused_calls"]["all"]
    assert stock["fused_calls"]["all"] == 0

    assert len(fused["logs"]) == len(stock["logs"]) == steps
    for step, (f, s) in enumerate(zip(fused["logs"], stock["logs"])):
        assert f.keys() == s.keys()
        for key, ref in s.items():
            if key in ("step_time",) or not isinstance(ref, (int, float)):
                continue
            assert math.isclose(f[key], ref, rel_tol=LOSS_RTOL, abs_tol=1e-7), f"step {step} {key}: {f[key]} vs {ref}"
    moved = 0
    for name, ref in stock["params"].items():
        assert torch.equal(fused["initial"][name], stock["initial"][name])
        update = (ref - stock["initial"][name]).norm()
        err = (fused["params"][name] - ref).norm()
        if update > 0:
            moved += 1
            assert err <= PARAM_RTOL * update, f"{name}: ‖θ−θ_stock‖/‖Δθ_stock‖ = {float(err / update):.3g}"
        else:
            assert err == 0, name
    assert moved >= len(stock["params"]) // 2


def _spacing(t: torch.Tensor) -> torch.Tensor:
    """The distance from each element of fp32 ``t`` to the next fp32 value away from zero."""
    magnitude = t.float().abs()
    return torch.nextafter(magnitude, torch.tensor(float("inf"))) - magnitude


def assert_matches_reference(got: dict, ref: dict, ranks: int = 2) -> None:
    """fp32: every logged loss within ``LOSS_RTOL``, every parameter within ``PARAM_RTOL`` of the update, and
    lm_head (its LoRA adapter under PEFT; the embedding when tied) trained, with the backbone."""
    assert got["world"] == ranks
    assert len(got["losses"]) == len(ref["losses"]) > 0
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: logged loss {a} vs reference {b}"
    errors = update_errors(got, ref)
    for name, err in errors.items():
        assert err <= PARAM_RTOL, f"{name}: ‖θ−θ_ref‖/‖Δθ_ref‖ = {err:.3g}"
    moved = [n for n in errors if not torch.equal(ref["params"][n], ref["initial"][n])]
    assert any("lm_head" in n or "embed_tokens" in n for n in moved) and len(moved) >= 4, moved


#: bf16 twins (see :func:`assert_bf16_twin` for why each bound).
BF16_LOSS_RTOL = 2.0**-8
BF16_NO_FURTHER = 1.25
BF16_PER_TENSOR = 0.25


def _distance(a: dict, b: dict, fp32: dict) -> float:
    """``‖θ_a − θ_b‖ / ‖Δθ_fp32‖`` with all parameters as one vector (a stable statistic under bf16, whose
    per-tensor errors cancel or add up by chance)."""
    names = sorted(fp32["params"])
    diff = torch.cat([(a["params"][n] - b["params"][n]).double().flatten() for n in names])
    update = torch.cat([(fp32["params"][n] - fp32["initial"][n]).double().flatten() for n in names])
    return float(diff.norm() / update.norm())


def assert_bf16_twin(fused: dict, stock: dict, fp32: dict, ranks: int = 2, stock_ranks: int = 1) -> None:
    """bf16 twin of :func:`assert_matches_reference`: ``fused`` (hf_fused under the engine, ``ranks``
    processes, bf16) against ``stock`` (the unpatched model under the same bf16 setting, in one process or on
    ``stock_ranks`` under the same engine) and
    ``fp32`` (the unpatched single-process fp32 run), all from the same model and global batch:

    1. every logged loss within 2^-8 relative of stock's: both round every layer to bf16 alike (2^-8
       relative per rounding) and differ in the head's roundings (the stock head rounds the logits to bf16,
       the fused op keeps them in fp32) and in the ranks' summation order;
    2. the parameters, as one vector, no further from fp32 than stock's (within 1.25×, the bound the
       non-distributed twins hold hf_fused's ops to under autocast, tests/test_fused_trainer.py): the
       engine adds no error of its own to hf_fused's bf16 numerics;
    3. every parameter tensor within 0.25 of the update of stock's. bf16 changes a 3-step run by percents
       of the update per tensor (stock vs fp32: up to 11 %), and the rank count alone by as much: two
       unpatched ZeRO-2 runs, 1 and 2 processes, differ by up to 12 % (a LayerNorm weight ≈ 1 is stored in
       bf16 at a spacing of 2^-7, coarse next to its update). A distribution fault (a gradient reduced twice
       or never, a missing 1/world, an adapter left untrained) moves a tensor by O(1) of its update.
    """
    assert_bf16_twins([(fused, stock, fp32)], ranks, stock_ranks)


def assert_bf16_twins(runs: list[tuple[dict, dict, dict]], ranks: int = 2, stock_ranks: int = 1) -> None:
    """:func:`assert_bf16_twin` over ``(fused, stock, fp32)`` runs of several seeds: bounds 1 and 3 for each seed,
    bound 2 on the distances pooled over the seeds (root of the summed squares). One 3-step run's distance is one
    draw of how the first roundings that differ grow: TRL's SFT script under DeepSpeed bf16 with gradient
    accumulation 1 gave fused/stock ratios of 1.33, 0.31, 1.00 and 0.84 at seeds 0-3 (pooled over 0-2: 0.45), while the
    bound is a claim about hf_fused's rounding, which hf_fused's op meets alone (more accurate than bf16 logits:
    tests/test_ops_mixed_precision.py)."""
    fused_sq = stock_sq = 0.0
    for fused, stock, fp32 in runs:
        assert fused["world"] == ranks and stock["world"] == stock_ranks
        assert len(fused["losses"]) == len(stock["losses"]) == len(fp32["losses"]) > 0
        for step, (f, s) in enumerate(zip(fused["losses"], stock["losses"])):
            assert abs(f - s) <= BF16_LOSS_RTOL * abs(s), f"step {step}: fused bf16 loss {f} vs stock bf16 {s}"
        fused_sq += _distance(fused, fp32, fp32) ** 2
        stock_sq += _distance(stock, fp32, fp32) ** 2
        for name, err in update_errors(fused, stock).items():
            assert err <= BF16_PER_TENSOR, f"{name}: ‖θ−θ_stock‖/‖Δθ_stock‖ = {err:.3g}"
    fused_err, stock_err = fused_sq ** 0.5, stock_sq ** 0.5
    assert 0 < stock_err, "bf16 changed nothing: mixed precision was not on"
    assert fused_err <= BF16_NO_FURTHER * stock_err, (
        f"parameters: fused bf16 {fused_err:.3g} vs stock bf16 {stock_err:.3g} of the fp32 update")


#: bf16 mixed precision per engine, and where its unpatched twin runs under the same bf16 setting, as
#: ``(config, processes)``: DeepSpeed (``bf16.enabled``) holds bf16 weights beside fp32 master weights, and
#: accelerate's FSDP1 and FSDP2 plugins hold bf16 parameters and reduce gradients in bf16 (``param_dtype`` and
#: ``reduce_dtype``, beside autocast), which one plain process does not reproduce: the same config on as many ranks
#: (2; also the same split of the batch, and the launch the patched run is in); DDP autocasts an fp32 model, as one
#: plain process with ``bf16=True`` does.
BF16_STOCK = {"zero3": ("zero3", 2), "zero2": ("zero2", 2), "fsdp2": ("fsdp2", 2), "fsdp1": ("fsdp1", 2),
              "ddp": (None, 1)}

#: A tile budget of 4 rows of a 128-token vocabulary (``rows_per_tile(128, 6144)``): a loss call over a micro-batch
#: of 2 rows of 12 tokens runs several tiles.
SMALL_TILES = 6144


def assert_head_gathered_and_reduced_once_per_micro_batch(got: dict, micro_batches: int, tokens_per_micro_batch: int,
                                                          vocab: int) -> None:
    """Under ZeRO-3, per forward+backward of one micro-batch (trained with ``tile_budget_bytes=SMALL_TILES``):
    DeepSpeed gathers lm_head.weight once for lm_head's call (the fused loss is computed inside it), hf_fused
    gathers it once for the backward (however many tiles the op runs), and its gradient reaches DeepSpeed's reduce
    hook exactly once."""
    assert rows_per_tile(vocab, SMALL_TILES) < tokens_per_micro_batch // 2, "the op should run several tiles"
    counts = got["head_counts"]
    assert counts == {"deepspeed_forward_fetches": micro_batches, "hf_fused_gathers": micro_batches,
                      "reductions": micro_batches}, counts
