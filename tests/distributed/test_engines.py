"""Training under DeepSpeed ZeRO-2/3, DDP, FSDP1 and FSDP2, each launched the way users launch it:
``accelerate launch --config_file examples/distributed/<engine>.yaml`` with 2 CPU processes (gloo). On CPU ranks
accelerate would take an FSDP config for plain DDP; ``cpu_fsdp/sitecustomize.py`` makes it apply FSDP as on GPUs,
and every run checks which engine wrapped its model (``parity.assert_wrapped_by``).

Each case trains a tiny model for a few optimizer steps through a public entry point
(``hf_fused.FusedTrainer``, or ``transformers.Trainer`` on a model patched by ``apply_fused_loss``) and is
compared with the single-process, unpatched ``transformers.Trainer`` on the same global batch
(``ranks × per-device batch``, same sample order): every logged loss, and every updated parameter.

Tolerances (fp32, bf16 twins): tests/distributed/parity.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_fused.ops.tiling import rows_per_tile
from launch import train
from parity import assert_bf16_twin, assert_matches_reference
from ranks import CUDA
from tiny_models import VOCAB, make_model

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]

BATCH = 2  # per device
RANKS = 2
SEQ = 12  # positions per sample (train_worker.TinyDataset)
#: rows_per_tile(128, 6144) = 4 rows per tile: a loss call runs several tiles.
TILE_BUDGET = 6144

#: Tiny models by name: (architecture, tied embeddings, config overrides). A prime vocabulary (131) splits
#: unevenly over 2 ranks: FSDP2 shards the tied lm_head / embedding's rows 66 + 65, the last shard padded (the
#: 128k-256k vocabularies divide by 2 but not always by the world size, and GPT-2's 50,257 by none). ZeRO-3 splits
#: each parameter's flat numel instead, 131 × 32 here: even.
MODELS = {"llama": ("llama", False, {}), "qwen3-tied": ("qwen3", True, {}),
          "qwen3-tied-odd-vocab": ("qwen3", True, dict(vocab_size=131))}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Each tiny model saved once (workers load it with ``from_pretrained``, so ZeRO-3 builds it partitioned)."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, (arch, tied, overrides) in MODELS.items():
        make_model(arch, tie_word_embeddings=tied, **overrides).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="session")
def references(tmp_path_factory, model_dirs):
    """Single-process unpatched Trainer runs, one per (model, engine, options), computed on first use.
    ``engine``: None for a plain process, or an engine config launched with one process (DeepSpeed's bf16
    keeps bf16 weights, so its single-process bf16 reference is DeepSpeed's too)."""
    root = tmp_path_factory.mktemp("references")
    cache = {}

    def get(model: str, engine: str | None = None, ranks: int = RANKS, **options) -> dict:
        """The reference for a run on ``ranks`` ranks: one process on ``ranks`` times the per-rank batch."""
        key = (model, engine, ranks, tuple(sorted(options.items())))
        if key not in cache:
            case = dict(model_dir=model_dirs[model], out=str(root / f"ref{len(cache)}.pt"), trainer="Trainer",
                        batch=BATCH * ranks, **options)
            cache[key] = train(case, engine, processes=1)
        return cache[key]

    return get


CASES = {
    # name: (accelerate config, model, trainer, options)
    # Small tiles (4 rows of the 128-token vocabulary) and lm_head's gathers and reductions counted.
    "zero3-FusedTrainer-ga2-small-tiles": (
        "zero3", "llama", "FusedTrainer",
        dict(ga=2, tile_budget_bytes=TILE_BUDGET, count_head_events=True, track_vocab_tensors=True)),
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


@pytest.mark.parametrize("name", list(CASES))
def test_engine_training_matches_single_process_reference(name, tmp_path, model_dirs, references):
    config, model, trainer, options = CASES[name]
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    options = dict(options)
    ranks = options.pop("ranks", RANKS)
    if CUDA and torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs")
    harness = ("fused", "tile_budget_bytes", "count_head_events", "track_vocab_tensors", "trainer_fsdp")
    reference_options = {k: v for k, v in options.items() if k not in harness}
    ref = references(model, ranks=ranks, **reference_options)  # one process on ranks × the per-rank batch
    case = dict(model_dir=model_dirs[model], out=str(tmp_path / "run.pt"), trainer=trainer, batch=BATCH, **options)
    got = train(case, config, processes=ranks)  # checks the engine wrapped the model
    assert got["head_calls"] > 0, "hf_fused never computed the head"
    if config == "zero3":
        assert got["lm_head_numel"] == 0, "ZeRO-3 should have partitioned lm_head's weight"
    assert_matches_reference(got, ref, ranks=ranks)
    if options.get("count_head_events"):
        assert_head_gathered_and_reduced_once_per_micro_batch(got, micro_batches=len(ref["losses"]) * options["ga"])
    if options.get("track_vocab_tensors"):
        assert_no_full_vocabulary_logits(got)


def assert_no_full_vocabulary_logits(got: dict) -> None:
    """No op in training produced a vocabulary-wide fp32 tensor larger than the tile budget (a micro-batch has
    BATCH·12 token rows; stock training makes ``[BATCH, 12, V]`` logits and their gradient, twice the budget).
    Bytes, not rows: each backend plans its own tile within the budget (the torch reference 4 rows beside its
    fp32 working copies, the Triton backend 11 rows of one buffer its gradient kernel overwrites in place)."""
    tile_bytes = got["max_vocab_rows"] * VOCAB * 4
    assert 0 < tile_bytes <= TILE_BUDGET < BATCH * 12 * VOCAB * 4, got["max_vocab_rows"]


def assert_head_gathered_and_reduced_once_per_micro_batch(got: dict, micro_batches: int) -> None:
    """Under ZeRO-3, per forward+backward of one micro-batch: DeepSpeed gathers lm_head.weight once for
    lm_head's call (the fused loss is computed inside it), hf_fused gathers it once for the backward
    (however many tiles the op runs), and its gradient reaches DeepSpeed's reduce hook exactly once."""
    tokens_per_micro_batch = BATCH * 12
    assert rows_per_tile(VOCAB, TILE_BUDGET) < tokens_per_micro_batch // 2, "the op should run several tiles"
    counts = got["head_counts"]
    assert counts == {"deepspeed_forward_fetches": micro_batches, "hf_fused_gathers": micro_batches,
                      "reductions": micro_batches}, counts


#: bf16 mixed precision per engine, and where its unpatched twin runs under the same bf16 setting, as
#: ``(config, processes)``: DeepSpeed (``bf16.enabled``) keeps bf16 weights and fp32 master weights, so the same
#: config in one process; DDP autocasts an fp32 model, as one plain process with ``bf16=True`` does; accelerate's
#: FSDP1 and FSDP2 plugins also hold bf16 parameters and reduce gradients in bf16 (``param_dtype`` and
#: ``reduce_dtype``, beside autocast), which one process does not reproduce: the same config on as many ranks.
BF16_STOCK = {"zero3": ("zero3", 1), "zero2": ("zero2", 1), "fsdp2": ("fsdp2", RANKS), "fsdp1": ("fsdp1", RANKS),
              "ddp": (None, 1)}


@pytest.mark.parametrize("config", list(BF16_STOCK))
def test_bf16_training_matches_single_process_unpatched_bf16(config, tmp_path, model_dirs, references):
    """bf16 twin of the fp32 cases: ``FusedTrainer(bf16=True)`` under the engine (2 ranks) against the
    unpatched ``Trainer(bf16=True)`` under the same bf16 setting (``BF16_STOCK``), and both against the fp32
    reference (``parity.assert_bf16_twin``: losses within 2^-8, parameters no further from fp32 than stock
    bf16's, every tensor within 0.25 of the update of stock's; why those bounds: there)."""
    if config.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    engine, processes = BF16_STOCK[config]
    if processes == 1:
        stock = references("llama", engine, bf16=True)
    else:
        stock = train(dict(model_dir=model_dirs["llama"], out=str(tmp_path / "stock.pt"), trainer="Trainer",
                           batch=BATCH, bf16=True), engine, processes=processes)
    case = dict(model_dir=model_dirs["llama"], out=str(tmp_path / "run.pt"), trainer="FusedTrainer", batch=BATCH,
                bf16=True)
    assert_bf16_twin(train(case, config), stock, references("llama"), stock_ranks=processes)


@pytest.mark.skipif(not CUDA, reason="accelerate's context parallelism needs GPUs (it refuses a ParallelismConfig on "
                                     "CPU ranks); HF_FUSED_TEST_DEVICE=cuda runs it")
def test_context_parallel_bf16_matches_stock_under_it(tmp_path, model_dirs, references):
    """Context parallelism (examples/distributed/fsdp2_cp2.yaml: both ranks share each sequence, torch's ring
    attention, FSDP2 over the same 2 ranks): the Trainer hands the model ``shift_labels`` split like the inputs, and
    hf_fused computes each rank's share of the loss from its own hidden states. In bf16, as the config trains: torch's
    ring attention handles the flash and memory-efficient SDPA kernels, not the math kernel fp32 falls back to
    (pytorch/pytorch#147793). ``apply_fused_loss`` + ``Trainer`` against the unpatched ``Trainer`` under the same
    config, and both against the fp32 single-process run on the same sequences (``parity.assert_bf16_twin``); SDPA
    attention and unpadded rows, as context parallelism requires."""
    common = dict(model_dir=model_dirs["llama"], trainer="Trainer", batch=BATCH, ga=2, bf16=True, attn="sdpa",
                  no_padding=True)
    stock = train(dict(common, out=str(tmp_path / "stock.pt")), "fsdp2_cp2")
    fused = train(dict(common, out=str(tmp_path / "fused.pt"), fused=True), "fsdp2_cp2")
    assert stock["head_calls"] == 0 and fused["head_calls"] > 0
    assert fused["head_positions"] == SEQ // 2, "each rank's head should see half of every sequence"
    # one data-parallel rank: the fp32 run takes the per-rank batch
    fp32 = references("llama", ranks=1, ga=2, attn="sdpa", no_padding=True)
    assert_bf16_twin(fused, stock, fp32, ranks=2, stock_ranks=2)


#: DeepSpeed's Ulysses sequence parallelism (examples/distributed/zero3_sp2.yaml): the 2 ranks share each row (one
#: data-parallel rank), SDPA attention, unpadded rows with ``position_ids`` (its dataloader adapter requires them).
SP_ROWS = dict(attn="sdpa", no_padding=True, position_ids=True)
SP_CASES = {
    "Trainer+apply_fused_loss": ("llama", "Trainer", dict(fused=True)),
    "FusedTrainer-tied-checkpointing": ("qwen3-tied", "FusedTrainer", dict(grad_ckpt=True)),
    "FusedTrainer-lora-on-lm_head": ("llama", "FusedTrainer", dict(lora="lm_head")),
}


@pytest.mark.parametrize("name", list(SP_CASES))
def test_ulysses_sequence_parallel_matches_single_process_reference(name, tmp_path, model_dirs, references):
    """Under Ulysses the dataloader adapter hands both ranks their half of the same rows, with ``shift_labels``;
    transformers' Trainer weights the ranks' losses by their label tokens (``deepspeed_sp_compute_loss``). With
    one micro-batch per step that is the mean over the whole rows, so the run must equal the single-process
    unpatched run on those rows (losses and every parameter, fp32 bounds); each rank's head must have seen half
    of each row (a run where both ranks trained whole rows would fail the reference anyway, but this says why)."""
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    model, trainer, options = SP_CASES[name]
    harness = ("fused",)
    ref = references(model, ranks=1, **SP_ROWS, **{k: v for k, v in options.items() if k not in harness})
    case = dict(model_dir=model_dirs[model], out=str(tmp_path / "run.pt"), trainer=trainer, batch=BATCH, **SP_ROWS,
                **options)
    got = train(case, "zero3_sp2")
    assert got["head_calls"] > 0 and got["head_positions"] == SEQ // 2, (got["head_calls"], got["head_positions"])
    assert_matches_reference(got, ref, ranks=2)


def test_ulysses_sequence_parallel_gradient_accumulation_matches_stock_under_it(tmp_path, model_dirs):
    """With gradient accumulation, transformers' Ulysses path averages the micro-batches' losses (it turns off
    ``num_items_in_batch``), which no single-process run reproduces: hf_fused against the unpatched model under the
    same config, fp32 bounds."""
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    common = dict(model_dir=model_dirs["llama"], trainer="Trainer", batch=BATCH, ga=2, **SP_ROWS)
    stock = train(dict(common, out=str(tmp_path / "stock.pt")), "zero3_sp2")
    fused = train(dict(common, out=str(tmp_path / "fused.pt"), fused=True), "zero3_sp2")
    assert stock["head_calls"] == 0 and fused["head_positions"] == stock["model_positions"] == SEQ // 2
    assert_matches_reference(fused, stock, ranks=2)


def test_ulysses_sequence_parallel_bf16_matches_stock_under_it(tmp_path, model_dirs, references):
    """bf16 twin: ``FusedTrainer(bf16=True)`` and the unpatched ``Trainer(bf16=True)`` under the same Ulysses
    config (DeepSpeed's bf16: bf16 weights, fp32 master weights), both against the fp32 single-process run
    (``parity.assert_bf16_twin``)."""
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    common = dict(model_dir=model_dirs["llama"], batch=BATCH, bf16=True, **SP_ROWS)
    stock = train(dict(common, out=str(tmp_path / "stock.pt"), trainer="Trainer"), "zero3_sp2")
    fused = train(dict(common, out=str(tmp_path / "fused.pt"), trainer="FusedTrainer"), "zero3_sp2")
    assert fused["head_positions"] == stock["model_positions"] == SEQ // 2
    assert_bf16_twin(fused, stock, references("llama", ranks=1, **SP_ROWS), ranks=2, stock_ranks=2)
