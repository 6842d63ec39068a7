"""TRL's distillation script with hf_fused's one change (``examples/distributed/trl_distillation.py``: the student
through ``apply_fused_loss``; TRL loads and prepares the teacher, a wider model, itself) launched as users launch it,
``accelerate launch --config_file examples/distributed/<engine>.yaml`` on 2 CPU processes (gloo), under DeepSpeed
ZeRO-3 (the teacher a DeepSpeed inference engine of its own, ``trl.models.prepare_deepspeed``), FSDP2 and DDP (the
teacher through ``accelerator.prepare_model(evaluation_mode=True)``), against the same script stock
(``--no_fused_loss``: TRL's ``DistillationTrainer`` and kernel) under the same engine: generation samples per rank,
so one process would draw other completions; under the same engine, seed and (to fp32 rounding) weights both draw
the same ones.

Under FSDP, ``accelerator.prepare_model`` leaves the teacher unprepared (on GPU ranks on the CPU, where its forward
fails: huggingface/trl#2580); in the patched runs hf_fused prepares it with TRL's ``prepare_fsdp`` (trl#6573's fix),
which each of their ranks records (``script_runner.teacher_record``): under FSDP2 the teacher's lm_head then reaches
the divergence as a ``Shard(0)`` DTensor. On CPU ranks the stock runs keep TRL's whole, unprepared teacher, so the
comparison checks the sharded teacher's path against it; on GPUs they take the same fix (``--prepare_teacher_fsdp``).
Under FSDP1 (``use_orig_params``) the prepared teacher's lm_head is a flat shard outside its forward, which hf_fused
gathers for the divergence and TRL's kernel cannot read: the patched ``DistillationTrainer`` under FSDP1 is compared
with stock under DDP, and ``GKDTrainer`` on the dataset's completions (TRL's on-policy generation fails under FSDP1)
with stock under FSDP1.

One launch holds every run the selected tests ask of every engine (``launch.SharedLaunches``, stock runs first;
each run under its own engine's accelerate environment, ``ranks.launched_under``):
TRL's defaults (``beta=1``, temperature 1) and the generalized JSD with a temperature (``--beta 0.5
--temperature 0.7``), each stock and patched; the patched script with a LoRA adapter on the student's lm_head
(TRL's kernel refuses it: no stock run to compare with; the single-process tests check its gradients against the
full logits); and ``GKDTrainer`` (tests/distributed/gkd_script.py, its teacher loaded and prepared by TRL), stock
and patched.

Compared: every logged metric of every step (loss, grad_norm, entropy, completion lengths; relative 1e-5) and every
parameter when training ends, relative to the update (``parity.update_errors`` within ``parity.PARAM_RTOL``; SGD at a
constant rate without clipping, so any gradient error shows in proportion); hf_fused computed the divergence inside
the student's lm_head call on every micro-batch of every rank (under ZeRO-3 from a partitioned lm_head), and never in
the stock runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from launch import CONFIGS, HERE, Run, SharedLaunches, planned_runs, run_cases
from parity import PARAM_RTOL, update_errors
from ranks import CUDA
from script_runs import assert_hf_fused_ran, load_script_run

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo"),
]

SCRIPT = CONFIGS / "trl_distillation.py"
GKD_SCRIPT = HERE / "gkd_script.py"
RUNNER = HERE / "script_runner.py"
RANKS = 2
STEPS, ACCUMULATION = 2, 2
#: On-policy distillation for 2 steps: 2 prompts per rank and micro-batch, completions of up to 4 tokens, SGD at a
#: constant rate without clipping, fp32 (the bf16 default is checked in one process: tests/integrations).
ARGS = ["--tiny", "--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
        str(ACCUMULATION), "--max_completion_length", "4", "--optim", "sgd", "--learning_rate", "0.5",
        "--lr_scheduler_type", "constant", "--weight_decay", "0", "--max_grad_norm", "0", "--bf16", "False",
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--disable_tqdm", "True",
        *([] if CUDA else ["--use_cpu"])]
#: The objectives each engine is checked with: TRL's defaults, and the generalized JSD with a temperature.
OBJECTIVES = {"reverse_kl": [], "jsd": ["--beta", "0.5", "--temperature", "0.7"]}
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
        "--lora_target_modules", "q_proj", "v_proj", "lm_head"]
ENGINES = ["zero3", "fsdp2", "ddp"]
#: The stock runs' teacher under FSDP on GPUs: TRL 1.16 leaves it unprepared, on the CPU, where its forward fails
#: (huggingface/trl#2580); ``--prepare_teacher_fsdp`` gives it trl#6573's fix, which hf_fused applies in the patched
#: runs. On CPU ranks TRL's unprepared teacher runs (whole, on the CPU): the stock runs keep it, so the comparison
#: also checks the patched runs' sharded teacher against a whole one.
STOCK_TEACHER = ["--prepare_teacher_fsdp"] if CUDA else []
#: GKD (tests/distributed/gkd_script.py): ``ARGS`` with GKD's names, every micro-batch on the student's generations
#: (``lmbda`` 1), its default β = 0.5, for one optimizer step. Over a second step the parameter check would measure
#: fp32 rounding, not the loss: this student's near-uniform attention leaves a few tensors (layer 0's ``k_proj``) with
#: an update 100× smaller than the rest, so the first step's rounding in the others (5e-7 of the gradient from float64
#: for TRL and hf_fused alike, measured in one process) moves them by 2e-5 of their update at the second; in that
#: setting stock TRL under ZeRO-3 and stock TRL under DDP already differ by 1.2e-5 (layer 1's ``q_proj``).
GKD_STEPS = 1
GKD_ARGS = [*ARGS[:ARGS.index("--max_steps")], "--max_steps", str(GKD_STEPS),
            *ARGS[ARGS.index("--max_steps") + 2:ARGS.index("--max_completion_length")], "--max_new_tokens", "4",
            "--lmbda", "1.0", *ARGS[ARGS.index("--max_completion_length") + 2:]]
#: GKD on the dataset's completions (``lmbda`` 0): under FSDP1 TRL 1.16 cannot generate with the student (its forward
#: outside FSDP's call reads flat shards: "'weight' must be 2-D"), stock or patched.
GKD_OFF_POLICY_ARGS = [*GKD_ARGS[:GKD_ARGS.index("--lmbda") + 1], "0.0", *GKD_ARGS[GKD_ARGS.index("--lmbda") + 2:]]


def script_run(engine: str, *args: str, script=SCRIPT, base=ARGS) -> Run:
    return Run.of(engine, RANKS, dict(script=str(script), args=[*base, *args], fused="--no_fused_loss" not in args))


def stock_teacher(engine: str) -> list[str]:
    return STOCK_TEACHER if engine.startswith("fsdp") else []


def objective_runs(engine: str, objective: str) -> list[Run]:
    """``[stock, fused]``: the script with ``OBJECTIVES[objective]`` under ``engine``."""
    return [script_run(engine, *OBJECTIVES[objective], "--no_fused_loss", *stock_teacher(engine)),
            script_run(engine, *OBJECTIVES[objective])]


def gkd_runs(engine: str) -> list[Run]:
    """``[stock, fused]``: the GKD script under ``engine``."""
    return [script_run(engine, "--no_fused_loss", *stock_teacher(engine), script=GKD_SCRIPT, base=GKD_ARGS),
            script_run(engine, script=GKD_SCRIPT, base=GKD_ARGS)]


def fsdp1_runs(objective: str) -> list[Run]:
    """``[stock under DDP, fused under FSDP1]``: the script with ``OBJECTIVES[objective]``."""
    return [objective_runs("ddp", objective)[0], script_run("fsdp1", *OBJECTIVES[objective])]


def gkd_off_policy_fsdp1_runs() -> list[Run]:
    """``[stock, fused]``: the GKD script on the dataset's completions under FSDP1."""
    return [script_run("fsdp1", "--no_fused_loss", *stock_teacher("fsdp1"), script=GKD_SCRIPT,
                       base=GKD_OFF_POLICY_ARGS),
            script_run("fsdp1", script=GKD_SCRIPT, base=GKD_OFF_POLICY_ARGS)]


def lora_runs(engine: str) -> list[Run]:
    return [script_run(engine, *LORA)]


def _needs(engine: str) -> None:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")


@pytest.mark.parametrize("objective", list(OBJECTIVES))
@pytest.mark.parametrize("engine", ENGINES)
def test_distillation_script_matches_stock_under_the_same_engine(engine, objective, runs):
    """``DistillationTrainer`` with TRL's defaults and with the generalized JSD at a temperature."""
    _needs(engine)
    stock, fused = (runs(run) for run in objective_runs(engine, objective))
    assert "entropy" in stock["logs"][0]  # the student's entropy, from hf_fused's pass in the patched run
    assert_same_training(stock, fused, engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_gkd_script_matches_stock_under_the_same_engine(engine, runs):
    """``GKDTrainer`` (the teacher loaded from its name and prepared by TRL) computing its generalized JSD from both
    models' hidden states, against TRL's from their full logits."""
    _needs(engine)
    assert_same_training(*(runs(run) for run in gkd_runs(engine)), engine, steps=GKD_STEPS)


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_distillation_script_under_fsdp1_matches_stock_under_ddp(objective, runs):
    """``DistillationTrainer`` under FSDP1 (``use_orig_params``), its teacher prepared and its lm_head, a flat shard
    outside the teacher's forward, gathered for hf_fused's divergence, against stock TRL under DDP on the same ranks
    and seed. TRL 1.16's kernel reads that shard as the weight ("mat2 must be a matrix"), so no stock run under FSDP1
    exists to compare with; under DDP the updates agree to fp32 rounding (stock TRL under FSDP1 without
    ``use_orig_params``, whose views stay whole, matches stock under DDP exactly)."""
    stock, fused = (runs(run) for run in fsdp1_runs(objective))
    assert_same_training(stock, fused, "fsdp1", stock_engine="ddp")


def test_gkd_script_off_policy_under_fsdp1_matches_stock(runs):
    """``GKDTrainer`` under FSDP1 on the dataset's completions: the teacher prepared by hf_fused, its logit transform
    measured through FSDP1's call, its lm_head gathered for the divergence; against TRL's full logits under FSDP1."""
    assert_same_training(*(runs(run) for run in gkd_off_policy_fsdp1_runs()), "fsdp1", steps=GKD_STEPS)


def assert_same_training(stock: dict, fused: dict, engine: str, steps: int = STEPS, stock_engine: str = "") -> None:
    """hf_fused ran on every micro-batch of every rank of ``fused`` and never in ``stock``; under FSDP the fused
    run's teacher was sharded (:func:`assert_teacher_prepared`), the stock run's (under ``stock_engine``, by default
    ``engine``) as TRL 1.16 leaves it (on GPUs: with trl#6573's fix, ``STOCK_TEACHER``); every logged metric of each
    of the ``steps`` steps and every parameter (relative to the update) agree; lm_head and most of the backbone
    moved."""
    assert_hf_fused_ran(fused, stock, engine, calls=steps * ACCUMULATION)
    assert_teacher_prepared(fused, engine)
    stock_fsdp = {c["teacher"]["fsdp"] for c in stock["counts"]}
    assert stock_fsdp == {bool(stock_teacher(stock_engine or engine))}, stock["counts"]
    assert len(fused["logs"]) == len(stock["logs"]) == steps
    for step, (f, s) in enumerate(zip(fused["logs"], stock["logs"])):
        assert f.keys() == s.keys()
        assert s["grad_norm"] > 0
        for key, ref in s.items():
            if key != "step_time" and isinstance(ref, (int, float)):
                assert math.isclose(f[key], ref, rel_tol=1e-5, abs_tol=1e-7), f"step {step} {key}: {f[key]} vs {ref}"
    errors = update_errors(fused, stock)
    assert all(err <= PARAM_RTOL for err in errors.values()), errors
    moved = [n for n in errors if not torch.equal(stock["params"][n], stock["initial"][n])]
    assert "lm_head.weight" in moved and len(moved) >= len(errors) // 2, moved


def assert_teacher_prepared(fused: dict, engine: str) -> None:
    """Under FSDP the patched run's teacher, which TRL 1.16 leaves unprepared, was prepared by hf_fused with TRL's
    ``prepare_fsdp`` on every rank (FSDP2: ``fully_shard``, its lm_head weight a DTensor; FSDP1: wrapped in
    ``FullyShardedDataParallel``); under another engine it is what TRL made of it (ZeRO-3: a DeepSpeed engine of its
    own; DDP: the bare model)."""
    teachers = [c["teacher"] for c in fused["counts"]]
    if engine.startswith("fsdp"):
        assert all(t["fsdp"] and t["dtensor_head"] == (engine == "fsdp2") for t in teachers), teachers
    else:
        assert not any(t["fsdp"] for t in teachers), teachers


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_distillation_script_with_lora_on_the_students_lm_head_trains_it(engine, runs):
    """TRL's kernel refuses a LoRA adapter on lm_head; the patched script trains it under the engine, computing the
    divergence with it on every rank."""
    _needs(engine)
    (got,) = (runs(run) for run in lora_runs(engine))
    assert all(c["head_calls"] >= STEPS * ACCUMULATION for c in got["counts"]), got["counts"]
    assert_teacher_prepared(got, engine)
    assert all(math.isfinite(e["loss"]) and e["grad_norm"] > 0 for e in got["logs"]), got["logs"]
    adapter = [n for n in got["params"] if "lm_head" in n and "lora_" in n]
    assert len(adapter) == 2, adapter
    for n in adapter:
        assert not torch.equal(got["params"][n], got["initial"][n]), f"{n} did not train"


def _dtensor_rank(rank: int, world: int, init_file: str) -> None:
    """A spawned rank over gloo: hf_fused's answer to TRL's divergence call with both lm_head weights FSDP2-style
    ``Shard(0)`` DTensors (a vocabulary of 31: shards of 16 and 15) against the same call with whole weights: the
    same loss and entropy, the student's hidden-state gradient and its weight gradient (on the DTensor: this rank's
    rows); each weight gathered with one ``full_tensor()`` per call."""
    import types

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hf_fused.integrations.trl.divergence import TeacherHead, divergence_in_head_call
    from hf_fused.ops import LogitTransform

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        vocab, width, teacher_width = 31, 8, 12
        student_weight, teacher_weight = 3 * torch.randn(vocab, width, generator=g), 3 * torch.randn(
            vocab, teacher_width, generator=g)
        g.manual_seed(1 + rank)  # each rank its own tokens
        hidden, teacher_hidden = torch.randn(2, 5, width, generator=g), torch.randn(2, 5, teacher_width, generator=g)
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[1, 3:] = 0
        state = types.SimpleNamespace(transform=LogitTransform(), tile_budget_bytes=None, backend=None)
        gathers = []
        full_tensor = DTensor.full_tensor
        DTensor.full_tensor = lambda self, *a, **k: gathers.append(tuple(self.shape)) or full_tensor(self, *a, **k)
        results = []
        for sharded in (False, True):
            head = torch.nn.Linear(width, vocab, bias=False)
            weight = distribute_tensor(student_weight, mesh, [Shard(0)]) if sharded else student_weight.clone()
            head.weight = torch.nn.Parameter(weight)
            teacher = distribute_tensor(teacher_weight, mesh, [Shard(0)]) if sharded else teacher_weight
            states = hidden.clone().requires_grad_()
            out = divergence_in_head_call(head, states, state, TeacherHead(lambda: (teacher_hidden, teacher, None)),
                                          beta=0.5, temperature=0.7, mask=mask, num_items_in_batch=11.0)
            out.loss.backward()
            if sharded:
                assert gathers == [(vocab, width), (vocab, teacher_width)], gathers  # forward and backward
            results.append((out.loss, out.entropy, states.grad, head.weight.grad))
        # this rank's rows of the whole weight's gradient land on its shard (reducing them over ranks is the
        # engine's job: FSDP2's reduce-scatter)
        rows = slice(0, 16) if rank == 0 else slice(16, vocab)
        results[0] = (*results[0][:3], results[0][3][rows])
        results[1] = (*results[1][:3], results[1][3].to_local())
        for what, a, b in zip(("loss", "entropy", "d_hidden", "d_weight"), *results):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (rank, what, (a - b).abs().max())
    finally:
        DTensor.full_tensor = full_tensor
        dist.destroy_process_group()


def test_fsdp2_dtensor_heads_are_gathered_once_per_call(tmp_path):
    """Where an lm_head weight reaches TRL's divergence call as an FSDP2 DTensor (accelerate's FSDP2 configs hand
    whole weights inside the root unit's forward, where TRL computes it, so here on 2 spawned gloo ranks directly):
    one ``full_tensor()`` per weight and call, as TRL gathers it, and the same loss and gradients as whole weights."""
    import torch.multiprocessing as mp

    mp.spawn(_dtensor_rank, args=(RANKS, str(tmp_path / "init")), nprocs=RANKS, join=True)


PLANS = {
    "test_distillation_script_matches_stock_under_the_same_engine": objective_runs,
    "test_distillation_script_with_lora_on_the_students_lm_head_trains_it": lora_runs,
    "test_gkd_script_matches_stock_under_the_same_engine": gkd_runs,
    "test_distillation_script_under_fsdp1_matches_stock_under_ddp": fsdp1_runs,
    "test_gkd_script_off_policy_under_fsdp1_matches_stock": gkd_off_policy_fsdp1_runs,
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> SharedLaunches:
    """Every script run of this module's selected tests, one launch per rank count (every engine's runs in it)."""
    return SharedLaunches(tmp_path_factory.mktemp("distillation_runs"), planned_runs(request, PLANS),
                          lambda runs, dirs: run_cases(runs, dirs, RUNNER), load_script_run,
                          key=lambda run: run.rank_count)
