"""Training under DeepSpeed ZeRO-2/3, DDP, FSDP1 and FSDP2, each launched the way users launch it:
``accelerate launch --config_file examples/distributed/<engine>.yaml`` with 2 CPU processes (gloo). On CPU ranks
accelerate would take an FSDP config for plain DDP; ``cpu_fsdp/sitecustomize.py`` makes it apply FSDP as on GPUs,
and every run checks which engine wrapped its model (``parity.assert_wrapped_by``).

Each case trains a tiny model for a few optimizer steps through a public entry point
(``hf_fused.FusedTrainer``, or ``transformers.Trainer`` on a model patched by ``apply_fused_loss``) and is
compared with the single-process, unpatched ``transformers.Trainer`` on the same global batch
(``ranks × per-device batch``, same sample order): every logged loss, and every updated parameter.

Tolerances (fp32, bf16 twins): tests/distributed/parity.py. The runs of one rank count share one launch
(``launch.SharedLaunches``, each run under its own engine's accelerate environment: ``ranks.launched_under``): each
test names its runs (the ``*_runs`` functions below), the first test to need a launch starts all of its runs, and
each test checks its own.
"""

from __future__ import annotations

import pytest
import torch

from launch import Run, SharedLaunches, gpus_short, load_train_result, planned_runs, run_cases, skip_if_gpus_short
from models import VOCAB
from parity import (BF16_STOCK, SMALL_TILES, assert_bf16_twin, assert_head_gathered_and_reduced_once_per_micro_batch,
                    assert_matches_reference)
from ranks import CUDA

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]

BATCH = 2  # per device
RANKS = 2
SEQ = 12  # positions per sample (train_worker.TinyDataset)

CASES = {
    # name: (accelerate config, model, trainer, options)
    # Small tiles (4 rows of the 128-token vocabulary) and lm_head's gathers and reductions counted.
    "zero3-FusedTrainer-ga2-small-tiles": (
        "zero3", "llama", "FusedTrainer",
        dict(ga=2, tile_budget_bytes=SMALL_TILES, count_head_events=True, track_vocab_tensors=True)),
    "zero3-Trainer+apply_fused_loss-tied-ga2-checkpointing": (
        "zero3", "qwen3-tied", "Trainer", dict(fused=True, ga=2, grad_ckpt=True)),
    "zero3-FusedTrainer-lora-on-lm_head": ("zero3", "llama", "FusedTrainer", dict(lora="lm_head")),
    "zero2-FusedTrainer-ga2": ("zero2", "llama", "FusedTrainer", dict(ga=2)),
    "ddp-FusedTrainer-tied": ("ddp", "qwen3-tied", "FusedTrainer", {}),
    "fsdp2-FusedTrainer-ga2": ("fsdp2", "llama", "FusedTrainer", dict(ga=2)),
    "fsdp2-FusedTrainer-lora-on-lm_head-checkpointing": (
        "fsdp2", "llama", "FusedTrainer", dict(lora="lm_head", grad_ckpt=True)),
    # FSDP1 (accelerate's default fsdp_version, and what TrainingArguments(fsdp=...) sets up): flat parameters;
    # lm_head.weight is a view into the root unit's, whole while the root is unsharded around the forward.
    "fsdp1-FusedTrainer-ga2": ("fsdp1", "llama", "FusedTrainer", dict(ga=2)),
    "fsdp1-Trainer+apply_fused_loss-tied-ga2-checkpointing": (
        "fsdp1", "qwen3-tied", "Trainer", dict(fused=True, ga=2, grad_ckpt=True)),
    "fsdp1-FusedTrainer-lora-on-lm_head": ("fsdp1", "llama", "FusedTrainer", dict(lora="lm_head")),
    # FSDP as transformers sets it up from TrainingArguments(fsdp="full_shard auto_wrap") under a plain
    # multi-process launch: FSDP2 (transformers 5's default) and FSDP1 (fsdp_config={"version": 1})
    "trainer-args-fsdp2-Trainer+apply_fused_loss-tied-ga2": (
        "ddp", "qwen3-tied", "Trainer", dict(fused=True, ga=2, trainer_fsdp=2)),
    "trainer-args-fsdp1-FusedTrainer-lora-on-lm_head-ga2": (
        "ddp", "llama", "FusedTrainer", dict(lora="lm_head", ga=2, trainer_fsdp=1)),
    # The rest of the engine × feature matrix (docs/distributed.md): every engine with Trainer +
    # apply_fused_loss, tied embeddings, a LoRA adapter on lm_head, GA 2 and gradient checkpointing.
    "zero2-Trainer+apply_fused_loss-tied-ga2-checkpointing": (
        "zero2", "qwen3-tied", "Trainer", dict(fused=True, ga=2, grad_ckpt=True)),
    "zero2-FusedTrainer-lora-on-lm_head-ga2-checkpointing": (
        "zero2", "llama", "FusedTrainer", dict(lora="lm_head", ga=2, grad_ckpt=True)),
    "fsdp2-Trainer+apply_fused_loss-tied": ("fsdp2", "qwen3-tied", "Trainer", dict(fused=True)),
    "ddp-Trainer+apply_fused_loss-lora-on-lm_head-ga2-checkpointing": (
        "ddp", "llama", "Trainer", dict(fused=True, lora="lm_head", ga=2, grad_ckpt=True)),
    # Uneven shards of lm_head (MODELS): FSDP2's rows on 2 ranks, and 3 ranks (``ranks``), where ZeRO-3 pads its
    # flat partition (131 × 32 = 4,192 elements = 3 × 1,397 + 1) and FSDP2 shards the rows 44 + 44 + 43.
    "fsdp2-Trainer+apply_fused_loss-tied-odd-vocab-ga2": (
        "fsdp2", "qwen3-tied-odd-vocab", "Trainer", dict(fused=True, ga=2)),
    "zero3-Trainer+apply_fused_loss-tied-odd-vocab-ga2-3-ranks": (
        "zero3", "qwen3-tied-odd-vocab", "Trainer", dict(fused=True, ga=2, ranks=3)),
    "fsdp2-Trainer+apply_fused_loss-tied-odd-vocab-ga2-3-ranks": (
        "fsdp2", "qwen3-tied-odd-vocab", "Trainer", dict(fused=True, ga=2, ranks=3)),
    "fsdp1-Trainer+apply_fused_loss-tied-odd-vocab-ga2-3-ranks": (
        "fsdp1", "qwen3-tied-odd-vocab", "Trainer", dict(fused=True, ga=2, ranks=3)),
}


#: Options of a run that its single-process reference does not take (hf_fused's, or the test's instruments).
HARNESS = ("fused", "tile_budget_bytes", "count_head_events", "track_vocab_tensors", "trainer_fsdp")


def reference_run(model: str, engine: str | None = None, ranks: int = RANKS, **options) -> Run:
    """The single-process unpatched Trainer run for a run on ``ranks`` ranks: one process on ``ranks`` times the
    per-rank batch. ``engine``: None for a plain process, or an engine config launched with one process."""
    return Run.of(engine, 1, dict(model=model, trainer="Trainer", batch=BATCH * ranks, **options))


def engine_runs(name: str) -> list[Run]:
    """``[reference, run]`` of ``CASES[name]`` (none where the test skips)."""
    config, model, trainer, options = CASES[name]
    options = dict(options)
    ranks = options.pop("ranks", RANKS)
    if gpus_short(ranks):
        return []
    reference = reference_run(model, ranks=ranks, **{k: v for k, v in options.items() if k not in HARNESS})
    return [reference, Run.of(config, ranks, dict(model=model, trainer=trainer, batch=BATCH, **options))]


def bf16_runs(config: str) -> list[Run]:
    """``[fused, stock, fp32]``: ``FusedTrainer(bf16=True)`` under ``config``, its unpatched twin (``BF16_STOCK``),
    the fp32 reference."""
    engine, processes = BF16_STOCK[config]
    if processes == 1:
        stock = reference_run("llama", engine, bf16=True)
    else:
        stock = Run.of(engine, processes, dict(model="llama", trainer="Trainer", batch=BATCH, bf16=True))
    fused = Run.of(config, RANKS, dict(model="llama", trainer="FusedTrainer", batch=BATCH, bf16=True))
    return [fused, stock, reference_run("llama")]


def context_parallel_runs() -> list[Run]:
    """``[stock, fused, fp32]`` under fsdp2_cp2.yaml (GPUs only)."""
    if not CUDA:
        return []
    common = dict(model="llama", trainer="Trainer", batch=BATCH, ga=2, bf16=True, attn="sdpa", no_padding=True)
    # one data-parallel rank: the fp32 run takes the per-rank batch
    return [Run.of("fsdp2_cp2", RANKS, common), Run.of("fsdp2_cp2", RANKS, dict(common, fused=True)),
            reference_run("llama", ranks=1, ga=2, attn="sdpa", no_padding=True)]


#: DeepSpeed's Ulysses sequence parallelism (examples/distributed/zero3_sp2.yaml): the 2 ranks share each row (one
#: data-parallel rank), SDPA attention, unpadded rows with ``position_ids`` (its dataloader adapter requires them).
SP_ROWS = dict(attn="sdpa", no_padding=True, position_ids=True)
SP_CASES = {
    "Trainer+apply_fused_loss": ("llama", "Trainer", dict(fused=True)),
    "FusedTrainer-tied-checkpointing": ("qwen3-tied", "FusedTrainer", dict(grad_ckpt=True)),
    "FusedTrainer-lora-on-lm_head": ("llama", "FusedTrainer", dict(lora="lm_head")),
}




def ulysses_runs(name: str) -> list[Run]:
    """``[reference, run]`` of ``SP_CASES[name]``."""
    model, trainer, options = SP_CASES[name]
    reference = reference_run(model, ranks=1, **SP_ROWS, **{k: v for k, v in options.items() if k != "fused"})
    return [reference, Run.of("zero3_sp2", RANKS, dict(model=model, trainer=trainer, batch=BATCH, **SP_ROWS,
                                                       **options))]


def ulysses_ga_runs() -> list[Run]:
    """``[stock, fused]`` under zero3_sp2.yaml with gradient accumulation 2."""
    common = dict(model="llama", trainer="Trainer", batch=BATCH, ga=2, **SP_ROWS)
    return [Run.of("zero3_sp2", RANKS, common), Run.of("zero3_sp2", RANKS, dict(common, fused=True))]


def ulysses_bf16_runs() -> list[Run]:
    """``[stock, fused, fp32]``: the unpatched and the fused bf16 run under zero3_sp2.yaml, the fp32 reference."""
    common = dict(model="llama", batch=BATCH, bf16=True, **SP_ROWS)
    return [Run.of("zero3_sp2", RANKS, dict(common, trainer="Trainer")),
            Run.of("zero3_sp2", RANKS, dict(common, trainer="FusedTrainer")),
            reference_run("llama", ranks=1, **SP_ROWS)]


PLANS = {
    "test_engine_training_matches_single_process_reference": engine_runs,
    "test_bf16_training_matches_unpatched_bf16": bf16_runs,
    "test_context_parallel_bf16_matches_stock_under_it": context_parallel_runs,
    "test_ulysses_sequence_parallel_matches_single_process_reference": ulysses_runs,
    "test_ulysses_sequence_parallel_gradient_accumulation_matches_stock_under_it": ulysses_ga_runs,
    "test_ulysses_sequence_parallel_bf16_matches_stock_under_it": ulysses_bf16_runs,
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, saved_models) -> SharedLaunches:
    """Every run of this module's selected tests, one launch per rank count, every engine's runs in it (the tiny models saved once)."""
    return SharedLaunches(tmp_path_factory.mktemp("engine_runs"), planned_runs(request, PLANS),
                          lambda runs, dirs: run_cases(runs, dirs, model_dirs=saved_models), load_train_result,
                          key=lambda run: run.rank_count)


def _needs_deepspeed(config: str) -> None:
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")


@pytest.mark.parametrize("name", list(CASES))
def test_engine_training_matches_single_process_reference(name, runs):
    config, _, _, options = CASES[name]
    _needs_deepspeed(config)
    ranks = options.get("ranks", RANKS)
    skip_if_gpus_short(ranks)
    ref, got = (runs(run) for run in engine_runs(name))  # the engine's run checks the engine wrapped the model
    assert got["head_calls"] > 0, "hf_fused never computed the head"
    if config == "zero3":
        assert got["lm_head_numel"] == 0, "ZeRO-3 should have partitioned lm_head's weight"
    assert_matches_reference(got, ref, ranks=ranks)
    if options.get("count_head_events"):
        assert_head_gathered_and_reduced_once_per_micro_batch(got, micro_batches=len(ref["losses"]) * options["ga"],
                                                              tokens_per_micro_batch=BATCH * SEQ, vocab=VOCAB)
    if options.get("track_vocab_tensors"):
        assert_no_full_vocabulary_logits(got)


def assert_no_full_vocabulary_logits(got: dict) -> None:
    """No op in training produced a vocabulary-wide fp32 tensor larger than the tile budget (a micro-batch has
    BATCH·12 token rows; stock training makes ``[BATCH, 12, V]`` logits and their gradient, twice the budget).
    Bytes, not rows: each backend plans its own tile within the budget (the torch reference 4 rows beside its
    fp32 working copies, the Triton backend 11 rows of one buffer its gradient kernel overwrites in place)."""
    tile_bytes = got["max_vocab_rows"] * VOCAB * 4
    assert 0 < tile_bytes <= SMALL_TILES < BATCH * SEQ * VOCAB * 4, got["max_vocab_rows"]


@pytest.mark.parametrize("config", list(BF16_STOCK))
def test_bf16_training_matches_unpatched_bf16(config, runs):
    """bf16 twin of the fp32 cases: ``FusedTrainer(bf16=True)`` under the engine (2 ranks) against the
    unpatched ``Trainer(bf16=True)`` under the same bf16 setting (``BF16_STOCK``), and both against the fp32
    reference (``parity.assert_bf16_twin``: losses within 2^-8, parameters no further from fp32 than stock
    bf16's, every tensor within 0.25 of the update of stock's; why those bounds: there)."""
    _needs_deepspeed(config)
    fused, stock, fp32 = (runs(run) for run in bf16_runs(config))
    assert_bf16_twin(fused, stock, fp32, stock_ranks=BF16_STOCK[config][1])


@pytest.mark.skipif(not CUDA, reason="accelerate's context parallelism needs GPUs (it refuses a ParallelismConfig on "
                                     "CPU ranks); HF_FUSED_TEST_DEVICE=cuda runs it")
def test_context_parallel_bf16_matches_stock_under_it(runs):
    """Context parallelism (examples/distributed/fsdp2_cp2.yaml: both ranks share each sequence, torch's ring
    attention, FSDP2 over the same 2 ranks): the Trainer hands the model ``shift_labels`` split like the inputs, and
    hf_fused computes each rank's share of the loss from its own hidden states. In bf16, as the config trains: torch's
    ring attention handles the flash and memory-efficient SDPA kernels, not the math kernel fp32 falls back to
    (pytorch/pytorch#147793). ``apply_fused_loss`` + ``Trainer`` against the unpatched ``Trainer`` under the same
    config, and both against the fp32 single-process run on the same sequences (``parity.assert_bf16_twin``); SDPA
    attention and unpadded rows, as context parallelism requires."""
    stock, fused, fp32 = (runs(run) for run in context_parallel_runs())
    assert stock["head_calls"] == 0 and fused["head_calls"] > 0
    assert fused["head_positions"] == SEQ // 2, "each rank's head should see half of every sequence"
    assert_bf16_twin(fused, stock, fp32, ranks=2, stock_ranks=2)


@pytest.mark.parametrize("name", list(SP_CASES))
def test_ulysses_sequence_parallel_matches_single_process_reference(name, runs):
    """Under Ulysses the dataloader adapter hands both ranks their half of the same rows, with ``shift_labels``;
    transformers' Trainer weights the ranks' losses by their label tokens (``deepspeed_sp_compute_loss``). With
    one micro-batch per step that is the mean over the whole rows, so the run must equal the single-process
    unpatched run on those rows (losses and every parameter, fp32 bounds); each rank's head must have seen half
    of each row (a run where both ranks trained whole rows would fail the reference anyway, but this says why)."""
    _needs_deepspeed("zero3_sp2")
    ref, got = (runs(run) for run in ulysses_runs(name))
    assert got["head_calls"] > 0 and got["head_positions"] == SEQ // 2, (got["head_calls"], got["head_positions"])
    assert_matches_reference(got, ref, ranks=2)


def test_ulysses_sequence_parallel_gradient_accumulation_matches_stock_under_it(runs):
    """With gradient accumulation, transformers' Ulysses path averages the micro-batches' losses (it turns off
    ``num_items_in_batch``), which no single-process run reproduces: hf_fused against the unpatched model under the
    same config, fp32 bounds."""
    _needs_deepspeed("zero3_sp2")
    stock, fused = (runs(run) for run in ulysses_ga_runs())
    assert stock["head_calls"] == 0 and fused["head_positions"] == stock["model_positions"] == SEQ // 2
    assert_matches_reference(fused, stock, ranks=2)


def test_ulysses_sequence_parallel_bf16_matches_stock_under_it(runs):
    """bf16 twin: ``FusedTrainer(bf16=True)`` and the unpatched ``Trainer(bf16=True)`` under the same Ulysses
    config (DeepSpeed's bf16: bf16 weights, fp32 master weights), both against the fp32 single-process run
    (``parity.assert_bf16_twin``)."""
    _needs_deepspeed("zero3_sp2")
    stock, fused, fp32 = (runs(run) for run in ulysses_bf16_runs())
    assert fused["head_positions"] == stock["model_positions"] == SEQ // 2
    assert_bf16_twin(fused, stock, fp32, ranks=2, stock_ranks=2)
