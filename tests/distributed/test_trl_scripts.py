"""TRL's scripts with hf_fused's one change, launched as users launch them.

SFT: TRL's SFT script with the model passed through ``apply_fused_loss`` before ``SFTTrainer``
(``examples/distributed/trl_sft.py``), ``accelerate launch --config_file examples/distributed/<engine>.yaml
examples/distributed/trl_sft.py --tiny ...`` on 2 CPU processes (gloo), under DeepSpeed ZeRO-2 and ZeRO-3,
FSDP2 and DDP, against the same script run unpatched (``--no_fused_loss``: TRL's own head) in one plain process
on the same global batch (per-device batch × 2, same seed, same sample order), with gradient accumulation 2.

Compared: every logged metric of every step (loss, grad_norm, entropy, mean_token_accuracy, num_tokens; loss
and metrics relative 1e-5: fp32 sums in another order), and every parameter when training ends (whole, as
tests/distributed/script_runner.py reads it) relative to the update (``parity.assert_matches_reference``:
2e-5; SGD at a constant rate without clipping, so the update is −lr·gradient and any gradient error shows in
proportion). ``--tiny`` lines all have the same token count, so no rank pads differently from the single
process. Also checked: hf_fused computed the head on every rank (a
script whose patch silently did nothing would match its reference exactly), under ZeRO-3 on a partitioned
lm_head, and TRL's head never did in the reference.

The same script launched as users launch it, without the runner, under FSDP2: it ends, and the model its
``save_model`` wrote is the reference's trained model.

SFT with a LoRA adapter on lm_head (``--use_peft --lora_target_modules q_proj v_proj lm_head``) under ZeRO-3
and FSDP2: TRL's own head refuses that adapter, so there is no unpatched script to compare with; the reference
is the same script in one process (the fused SFT loss with an adapter on lm_head is checked against the full
logits in tests/test_trl_trainers.py). Same tolerances; the adapter of lm_head trains.

SFT under DeepSpeed's Ulysses sequence parallelism (``zero3_sp2.yaml``): against TRL's own head under it.

DPO and KTO: TRL's scripts with the policy through ``apply_fused_loss`` (``trl_dpo.py``, ``trl_kto.py``) under
every engine, DPO against the unpatched script in one process (also with LoRA on lm_head, whose reference is the
disabled adapter), KTO against the unpatched script under the same engine (its KL term pairs rows within a rank's
batch). Every logged metric and every parameter.

GRPO and RLOO: TRL's GRPO script with ``FusedGRPOTrainer`` in place of ``GRPOTrainer``
(``examples/distributed/trl_grpo.py --tiny``) and its RLOO script with the policy through ``apply_fused_loss``
(``trl_rloo.py``), against the same script stock (``--no_fused_loss``) under the same engine: generation samples
per rank, so a single process would draw other completions; under the same engine, seed and (to fp32 rounding)
weights both draw the same ones. Every logged metric (loss, grad_norm, rewards, entropy, clip ratios, completion
lengths) and every parameter, with the same tolerances; hf_fused ran on every rank and not in the stock run.

Each test names the script runs it compares (the ``*_runs`` functions at the end); the runs of every engine on 2
ranks share one launch of the runner (``launch.SharedLaunches``, stock runs first; each run under its own config's
accelerate environment, ``ranks.launched_under``), the single-process runs another, and a reference several tests
compare with runs once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from launch import CONFIGS, HERE, Run, SharedLaunches, accelerate_launch, planned_runs
from parity import BF16_STOCK, PARAM_RTOL, assert_bf16_twin, assert_bf16_twins, assert_matches_reference, update_errors
from ranks import CUDA
from script_runs import assert_hf_fused_ran, launch_scripts, load_script_run, script_run
from references import logp_difference_tol

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]

SCRIPT = CONFIGS / "trl_sft.py"
GRPO_SCRIPT = CONFIGS / "trl_grpo.py"
BATCH = 2  # per device
RANKS = 2
#: SGD at a constant rate, no clipping, fp32 (TRL's configs default to bf16), no checkpoints.
ARGS = ["--tiny", "--max_steps", "3", "--gradient_accumulation_steps", "2", "--optim", "sgd",
        "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--weight_decay", "0", "--max_grad_norm", "0",
        "--bf16", "False", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--seed", "0",
        "--disable_tqdm", "True", *([] if CUDA else ["--use_cpu"])]


def reference_run() -> Run:
    """The SFT script unpatched in one process on both ranks' batch."""
    return script_run(SCRIPT, *ARGS, "--no_fused_loss", "--per_device_train_batch_size", str(BATCH * RANKS))


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp2", "fsdp1", "ddp"])
def test_trl_sft_script_matches_unpatched_single_process(engine, runs):
    _needs_deepspeed(engine)
    reference, got = (runs(run) for run in sft_runs(engine))

    assert_hf_fused_ran(got, reference, engine)
    assert_matches_reference(got, reference, ranks=RANKS)
    assert_same_metrics(got, reference)


def logged_metrics(run: dict) -> set[str]:
    """The metrics a script logged at its first step, besides the loss (compared on its own) and the step."""
    return {k for k in run["logs"][0] if k not in ("loss", "step")}


SFT_METRICS = ("grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "learning_rate", "epoch")

def assert_same_metrics(got: dict, reference: dict, keys=SFT_METRICS) -> None:
    """Every metric in ``keys`` (by default those SFTTrainer logs besides the loss) at every step, relative 1e-5
    (fp32 sums in another order); differences of log-probabilities (``LOGP_DIFFERENCES``) absolute 1e-5 of the
    log-probabilities they come from."""
    for step, (g, r) in enumerate(zip(got["logs"], reference["logs"])):
        assert g.keys() == r.keys()
        for key in keys:
            abs_tol = logp_difference_tol(key, r)
            assert math.isclose(g[key], r[key], rel_tol=1e-5, abs_tol=abs_tol), f"step {step} {key}: {g[key]} vs {r[key]}"


def test_trl_sft_script_as_users_launch_it_under_fsdp2_saves_the_trained_model(tmp_path, runs):
    """The SFT script launched exactly as users launch it, without the runner (each rank leaves through Python's own
    exit), under FSDP2: it ends, and the model ``save_model`` wrote (rank 0's full state dict, gathered from the
    shards) is the single-process reference's trained model within the parity tolerance. (The runner's ranks once
    left with ``os._exit`` before their last queued NCCL all-gathers ran, hanging rank 0 in that gather on 2 GPUs:
    ``ranks.exit_rank``.)"""
    from safetensors.torch import load_file

    reference = runs(reference_run())
    accelerate_launch("fsdp2", SCRIPT, *ARGS, "--per_device_train_batch_size", str(BATCH), "--output_dir",
                      str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")
    logs = [e for e in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    # a tied lm_head is saved once, as the embedding
    missing = {n for n in reference["params"] if n not in saved}
    assert missing <= {"lm_head.weight"}, missing
    got = {"world": RANKS, "losses": [e["loss"] for e in logs], "initial": reference["initial"],
           "params": {n: saved.get(n, saved.get("model.embed_tokens.weight")).float() for n in reference["params"]}}
    assert_matches_reference(got, reference, ranks=RANKS)


def _with(args: list, flag: str, value) -> list:
    """``args`` with ``flag``'s value replaced by ``value``."""
    i = args.index(flag)
    return [*args[:i], flag, str(value), *args[i + 2:]]


def _with_bf16(args: list) -> list:
    """``args`` with TRL's default mixed precision (``--bf16 True``: autocast, on CPU too) instead of fp32."""
    return _with(args, "--bf16", "True")


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp2", "fsdp1", "ddp"])
def test_trl_sft_script_under_bf16_matches_unpatched_bf16(engine, runs):
    """TRL's SFT script as users run it, with TRL's default ``bf16=True``, under the engine (2 ranks), against the
    same script unpatched (TRL's own head) under the same bf16 setting (one plain process for DDP, the DeepSpeed or FSDP
    config on the same ranks: ``parity.BF16_STOCK``), and both against the fp32
    reference: ``parity.assert_bf16_twin`` (losses within 2^-8 of stock's, the parameters no further from fp32's
    than stock's within 1.25×, every tensor within 0.25 of stock's update; why those bounds: there)."""
    _needs_deepspeed(engine)
    stock, fused, reference = (runs(run) for run in sft_bf16_runs(engine))
    processes = BF16_STOCK[engine][1]
    assert_hf_fused_ran(fused, stock, engine=None)  # partitioned lm_head under ZeRO-3: the fp32 case checks it
    assert_bf16_twin(fused, stock, reference, ranks=RANKS, stock_ranks=processes)


#: TRL's preference scripts with the policy through ``apply_fused_loss`` (examples/distributed/).
PREFERENCE_SCRIPTS = {"dpo": CONFIGS / "trl_dpo.py", "kto": CONFIGS / "trl_kto.py"}


def single_process_run(script: str, *args: str) -> Run:
    """``script`` with ``ARGS`` and ``args`` in one process on both ranks' batch."""
    return script_run(PREFERENCE_SCRIPTS[script], *ARGS, *args, "--per_device_train_batch_size", str(BATCH * RANKS))


@pytest.mark.parametrize("engine", ["zero3", "zero2", "fsdp2", "fsdp1", "ddp"])
@pytest.mark.parametrize("script", list(PREFERENCE_SCRIPTS))
def test_trl_preference_script_matches_unpatched(script, engine, runs):
    """TRL's DPO and KTO scripts with the policy through ``apply_fused_loss`` under each engine, gradient
    accumulation 2, against the unpatched script: every logged metric (the rewards, margins, accuracies or KL
    estimate, the chosen and rejected log-probabilities and mean logits, entropy) and every parameter. DPO against
    one process on the same global batch; KTO against the unpatched script under the same engine and ranks, since
    its KL term pairs each completion with another row's prompt within a rank's batch, so another split of the
    batch pairs other rows (stock KTO on 2 ranks is 1e-3 of the update away from stock KTO in one process). The
    reference model the trainer builds (under ZeRO-3 a DeepSpeed inference engine of its own) is patched alongside
    the policy in the fused run; hf_fused computed the heads on every rank, under ZeRO-3 from partitioned
    lm_heads."""
    _needs_deepspeed(engine)
    reference, got = (runs(run) for run in preference_runs(script, engine))
    assert_hf_fused_ran(got, reference, engine)
    assert_matches_reference(got, reference, ranks=RANKS)
    keys = logged_metrics(reference)
    assert {"rewards/chosen", "logps/rejected", "logits/chosen"} <= keys, keys
    assert_same_metrics(got, reference, keys)


#: Tokens of each ``--tiny`` line: 15 words and the EOS SFTTrainer appends (examples/distributed/trl_sft.py).
TINY_LINE_TOKENS = 16


def test_trl_sft_script_under_ulysses_sequence_parallelism_matches_stock_under_it(runs):
    """TRL's SFT script under DeepSpeed's Ulysses sequence parallelism (examples/distributed/zero3_sp2.yaml): TRL
    turns on the collator's ``position_ids`` and calls the model with ``fused_lm_head=True``, transformers' Trainer
    weights the ranks' losses by their label tokens. Patched against TRL's own head under the same config: every
    logged metric and every parameter (fp32 bounds), and each rank's fused head saw half of every line."""
    _needs_deepspeed("zero3_sp2")
    stock, fused = (runs(run) for run in ulysses_runs())
    assert_hf_fused_ran(fused, stock, "zero3_sp2")
    assert all(c["head_positions"] == TINY_LINE_TOKENS // 2 for c in fused["counts"]), fused["counts"]
    assert_matches_reference(fused, stock, ranks=RANKS)
    assert_same_metrics(fused, stock)


#: TRL's own accelerate configs (tests/distributed/configs/ says what differs from ours).
TRL_FSDP2 = HERE / "configs" / "trl_fsdp2.yaml"
TRL_ZERO3 = HERE / "configs" / "trl_zero3.yaml"


#: Seeds of the runs under TRL's configs: their bf16 twins pool the parameter distance over these
#: (``parity.assert_bf16_twins`` says why).
TWIN_SEEDS = (0, 1, 2)


def twin_runs(config: Path, ga: int) -> list[Run]:
    """For each of ``TWIN_SEEDS``: TRL's SFT script under ``config`` with TRL's default ``bf16=True``, patched and
    unpatched on 2 ranks, and the unpatched fp32 run in one process on the same samples; gradient accumulation
    ``ga``: ``[fused, stock, fp32]`` per seed, one seed after the other."""
    runs = []
    for seed in TWIN_SEEDS:
        args = _with(_with(ARGS, "--gradient_accumulation_steps", ga), "--seed", seed)
        fp32 = script_run(SCRIPT, *args, "--no_fused_loss", "--per_device_train_batch_size", str(BATCH * RANKS))
        args = _with_bf16(args)
        stock = script_run(SCRIPT, *args, "--no_fused_loss", "--per_device_train_batch_size", str(BATCH),
                           engine=config)
        fused = script_run(SCRIPT, *args, "--per_device_train_batch_size", str(BATCH), engine=config)
        runs += [fused, stock, fp32]
    return runs


def _twins_under(runs: SharedLaunches, config: Path, ga: int) -> list[tuple[dict, dict, dict]]:
    """:func:`twin_runs`' results as ``(fused, stock, fp32)`` per seed. Checks that hf_fused ran on every rank of the
    patched runs and in none of the others."""
    results = [runs(run) for run in twin_runs(config, ga)]
    twins = [tuple(results[i:i + 3]) for i in range(0, len(results), 3)]
    for fused, stock, fp32 in twins:
        assert all(c["head_calls"] == 0 for c in stock["counts"] + fp32["counts"]), (stock["counts"], fp32["counts"])
        assert all(c["head_calls"] >= 3 * ga for c in fused["counts"]), fused["counts"]
        # save_model wrote what it writes for the unpatched script (under a SHARDED_STATE_DICT config, as TRL's
        # FSDP2 config has, transformers' save_model writes no model at all: checkpoints are sharded)
        assert _saved(fused["dir"]) == _saved(stock["dir"]), (_saved(fused["dir"]), _saved(stock["dir"]))
    return twins


def _saved(out_dir: Path) -> set[str]:
    """What the script saved in ``out_dir`` besides the runner's records and the tiny model it built to start."""
    return {p.name for p in out_dir.iterdir()} - {"run.0.json", "run.1.json", "run.params.pt", "tiny-model",
                                                  "batch.json"}


def test_trl_sft_script_under_trls_own_fsdp2_config_matches_stock_under_it(runs):
    """TRL's SFT script launched with TRL's own FSDP2 config (bf16, CPU-RAM-efficient loading: rank 1 starts from
    the meta device and gets rank 0's weights, after ``apply_fused_loss`` has patched and probed its model),
    against the unpatched script under the same config and ranks, and both against the fp32
    run (``parity.assert_bf16_twins``)."""
    assert_bf16_twins(_twins_under(runs, TRL_FSDP2, ga=2), ranks=RANKS, stock_ranks=RANKS)


def test_trl_sft_script_under_trls_own_zero3_config_matches_stock_under_it(runs):
    """TRL's SFT script launched with TRL's own ZeRO-3 config (zero.Init, the 16-bit model gathered and saved at
    the end, DeepSpeed's gradient accumulation fixed at 1, which the script's arguments must then match), against
    the unpatched script under the same config and ranks, and both against the fp32 run
    (``parity.assert_bf16_twins``); hf_fused found lm_head partitioned in every call."""
    _needs_deepspeed("zero3")
    twins = _twins_under(runs, TRL_ZERO3, ga=1)
    assert "model.safetensors" in _saved(twins[0][0]["dir"])  # the 16-bit model gathered and saved
    for fused, _, _ in twins:
        assert all(c["partitioned_head_calls"] == c["head_calls"] for c in fused["counts"]), fused["counts"]
    assert_bf16_twins(twins, ranks=RANKS, stock_ranks=RANKS)


LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
        "--lora_target_modules", "q_proj", "v_proj", "lm_head"]


@pytest.mark.parametrize("engine", ["zero3", "fsdp2", "fsdp1"])
def test_trl_sft_script_with_lora_on_lm_head_matches_single_process(engine, runs):
    _needs_deepspeed(engine)
    lora_reference, got = (runs(run) for run in sft_lora_runs(engine))
    assert lora_reference["counts"][0]["head_calls"] >= 3 * 2 and all(c["head_calls"] >= 3 * 2 for c in got["counts"])
    assert_matches_reference(got, lora_reference, ranks=RANKS)
    adapter = [n for n in got["params"] if "lm_head" in n and "lora_B" in n]
    assert adapter and all(got["params"][n].abs().max() > 0 for n in adapter), adapter  # B starts at 0


@pytest.mark.parametrize("engine", ["zero3", "fsdp1"])
def test_trl_dpo_script_with_lora_on_lm_head_matches_single_process(engine, runs):
    """DPO with a LoRA adapter on lm_head (TRL's own head refuses it): the reference model is the policy with its
    adapter disabled, so hf_fused computes both the policy's and the reference's log-probabilities; under ZeRO-3
    and FSDP1 (where each LoRA matrix is an FSDP unit of its own) against the same script in one process, every
    metric and parameter; the adapter of lm_head trains."""
    _needs_deepspeed(engine)
    reference, got = (runs(run) for run in dpo_lora_runs(engine))
    assert all(c["head_calls"] >= 3 * 2 for c in reference["counts"] + got["counts"]), got["counts"]
    assert_matches_reference(got, reference, ranks=RANKS)
    assert_same_metrics(got, reference, logged_metrics(reference))
    adapter = [n for n in got["params"] if "lm_head" in n and "lora_B" in n]
    assert adapter and all(got["params"][n].abs().max() > 0 for n in adapter), adapter  # B starts at 0


#: 2 steps of on-policy GRPO / RLOO (TRL's default β and loss): one prompt of 4 generations of 8 tokens per rank.
GRPO_ARGS = ["--tiny", "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
             "--max_completion_length", "8", "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type",
             "constant", "--weight_decay", "0", "--max_grad_norm", "0", "--bf16", "False", "--logging_steps", "1",
             "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--disable_tqdm", "True",
             *([] if CUDA else ["--use_cpu"])]


#: TRL's online scripts: GRPO with ``FusedGRPOTrainer``, RLOO with the policy through ``apply_fused_loss``.
ONLINE_SCRIPTS = {"grpo": GRPO_SCRIPT, "rloo": CONFIGS / "trl_rloo.py"}


@pytest.mark.parametrize("engine,script", [("zero3", "grpo"), ("fsdp2", "grpo"), ("zero3", "rloo"), ("fsdp1", "rloo"),
                                           ("ddp", "rloo")])
def test_trl_online_script_matches_stock_under_the_same_engine(engine, script, runs):
    """TRL's GRPO and RLOO scripts on hf_fused against the same script stock under the same engine (generation
    samples per rank, so one process would draw other completions): every logged metric and every parameter."""
    _needs_deepspeed(engine)
    stock, fused = (runs(run) for run in online_runs(engine, script))

    assert_hf_fused_ran(fused, stock, engine, calls=2)  # a forward+backward per step
    assert len(fused["logs"]) == len(stock["logs"]) == 2
    for step, (f, s) in enumerate(zip(fused["logs"], stock["logs"])):
        assert f.keys() == s.keys()
        assert s["grad_norm"] > 0 and s["reward_std"] > 0, "no policy gradient: the parity below would be empty"
        for key, ref in s.items():
            if key != "step_time" and isinstance(ref, (int, float)):
                assert math.isclose(f[key], ref, rel_tol=1e-5, abs_tol=1e-7), f"step {step} {key}: {f[key]} vs {ref}"
    errors = update_errors(fused, stock)
    assert all(err <= PARAM_RTOL for err in errors.values()), errors
    moved = [n for n in errors if not torch.equal(stock["params"][n], stock["initial"][n])]
    assert "lm_head.weight" in moved and len(moved) >= len(errors) // 2, moved

# -- the runs each test compares, shared launches ------------------------------------------------------------------


def sft_runs(engine: str) -> list[Run]:
    """``[reference, run]``: the SFT script unpatched in one process, patched under ``engine``."""
    return [reference_run(), script_run(SCRIPT, *ARGS, "--per_device_train_batch_size", str(BATCH), engine=engine)]


def sft_bf16_runs(engine: str) -> list[Run]:
    """``[stock, fused, fp32]``: the SFT script in bf16 unpatched under ``BF16_STOCK[engine]`` and patched under
    ``engine``, and the fp32 reference."""
    args = _with_bf16(ARGS)
    stock_engine, processes = BF16_STOCK[engine]
    stock = script_run(SCRIPT, *args, "--no_fused_loss", "--per_device_train_batch_size",
                       str(BATCH * RANKS // processes), engine=stock_engine, processes=processes)
    fused = script_run(SCRIPT, *args, "--per_device_train_batch_size", str(BATCH), engine=engine)
    return [stock, fused, reference_run()]


def preference_runs(script: str, engine: str) -> list[Run]:
    """``[reference, run]``: DPO's reference is the unpatched script in one process, KTO's the unpatched script
    under ``engine``."""
    args = [*ARGS, "--per_device_train_batch_size", str(BATCH)]
    if script == "kto":
        reference = script_run(PREFERENCE_SCRIPTS[script], *args, "--no_fused_loss", engine=engine)
    else:
        reference = single_process_run(script, "--no_fused_loss")
    return [reference, script_run(PREFERENCE_SCRIPTS[script], *args, engine=engine)]


def ulysses_runs() -> list[Run]:
    """``[stock, fused]``: the SFT script under zero3_sp2.yaml."""
    args = [*ARGS, "--per_device_train_batch_size", str(BATCH)]
    return [script_run(SCRIPT, *args, "--no_fused_loss", engine="zero3_sp2"),
            script_run(SCRIPT, *args, engine="zero3_sp2")]


def sft_lora_runs(engine: str) -> list[Run]:
    """``[reference, run]``: the SFT script with LoRA on lm_head in one process, and under ``engine``."""
    reference = script_run(SCRIPT, *ARGS, *LORA, "--per_device_train_batch_size", str(BATCH * RANKS))
    return [reference, script_run(SCRIPT, *ARGS, *LORA, "--per_device_train_batch_size", str(BATCH), engine=engine)]


def dpo_lora_runs(engine: str) -> list[Run]:
    """``[reference, run]``: the DPO script with LoRA on lm_head in one process, and under ``engine``."""
    return [single_process_run("dpo", *LORA),
            script_run(PREFERENCE_SCRIPTS["dpo"], *ARGS, *LORA, "--per_device_train_batch_size", str(BATCH),
                       engine=engine)]


def online_runs(engine: str, script: str) -> list[Run]:
    """``[stock, fused]``: GRPO's or RLOO's script under ``engine``."""
    return [script_run(ONLINE_SCRIPTS[script], *GRPO_ARGS, "--no_fused_loss", engine=engine),
            script_run(ONLINE_SCRIPTS[script], *GRPO_ARGS, engine=engine)]


PLANS = {
    "test_trl_sft_script_matches_unpatched_single_process": sft_runs,
    "test_trl_sft_script_as_users_launch_it_under_fsdp2_saves_the_trained_model": lambda: [reference_run()],
    "test_trl_sft_script_under_bf16_matches_unpatched_bf16": sft_bf16_runs,
    "test_trl_preference_script_matches_unpatched": preference_runs,
    "test_trl_sft_script_under_ulysses_sequence_parallelism_matches_stock_under_it": ulysses_runs,
    "test_trl_sft_script_under_trls_own_fsdp2_config_matches_stock_under_it": lambda: twin_runs(TRL_FSDP2, ga=2),
    "test_trl_sft_script_under_trls_own_zero3_config_matches_stock_under_it": lambda: twin_runs(TRL_ZERO3, ga=1),
    "test_trl_sft_script_with_lora_on_lm_head_matches_single_process": sft_lora_runs,
    "test_trl_dpo_script_with_lora_on_lm_head_matches_single_process": dpo_lora_runs,
    "test_trl_online_script_matches_stock_under_the_same_engine": online_runs,
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> SharedLaunches:
    """Every script run of this module's selected tests, one launch per rank count (every engine's runs in it)."""
    return SharedLaunches(tmp_path_factory.mktemp("script_runs"), planned_runs(request, PLANS), launch_scripts,
                          load_script_run, key=lambda run: run.rank_count)


def _needs_deepspeed(engine: str) -> None:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
