"""Tensor parallelism through the public entry points, on CPU ranks over gloo (tensor_parallel_worker.py), or with
``HF_FUSED_TEST_DEVICE=cuda`` one GPU per rank over NCCL (ranks.py; the single-process references on the first GPU;
the runs of 3 and 4 ranks skipped with fewer GPUs than ranks):
``apply_fused_loss`` (or ``FusedTrainer``) on a model loaded with
``from_pretrained(path, distributed_config=DistributedConfig(tp_size=n))`` (lm_head a ``Shard(0)`` DTensor whose
transformers forward all-gathers the logits) trained by ``transformers.Trainer``, on 2 ranks launched with
examples/distributed/tp2.yaml and 3 under torchrun (a vocabulary of 131: shards 66/65 and 44/44/43), tied and untied,
fp32 and bf16, and FSDP2 × TP on 4 ranks launched with examples/distributed/fsdp2_tp2.yaml; and a custom loop on a
model whose lm_head torch's ``ColwiseParallel`` shards; TRL's ``SFTTrainer`` and ``DPOTrainer`` on the patched
tensor-parallel model (2 and 3 ranks, and FSDP2 × TP on 4; every logged metric too); ``FusedGRPOTrainer`` and TRL's
``RLOOTrainer`` on 2 ranks and ``FusedGRPOTrainer`` under FSDP2 × TP on 4, each tensor-parallel group one
data-parallel replica, completions sampled on the sharded model. Each against the single-process unpatched run on
the same global batch (the bf16 twin against the unpatched bf16 run under the same tensor parallelism): every
logged loss and every updated parameter (``parity.py``), with no collective moving
anything of the vocabulary's width (the unpatched tensor-parallel run all-gathers its logits shards) and no tensor of
the whole vocabulary's width made (not checked for the rollout trainers, whose generation runs transformers' own
forward, which gathers the logits). Also the per-rank benchmark (``benchmarks.tensor_parallel_model``) on the 2
ranks. Runs of one rank count share one launch (``launch.SharedLaunches``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from launch import (HERE, Run, SharedLaunches, accelerate_launch, gpus_short, launch_timeout, planned_runs, run,
                    skip_if_gpus_short)
from parity import PARAM_RTOL, assert_bf16_twin, assert_matches_reference, update_errors
from references import logp_difference_tol

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
    ),
]

WORKER = HERE / "tensor_parallel_worker.py"
#: A prime vocabulary above the dataset's ids (< 128); V·H differs from the 48 tokens' logits' numel (the
#: vocabulary-width tracker skips tensors of the weight's size).
VOCAB, HIDDEN = 131, 60


def make_model(tied: bool):
    """A tiny Llama every tensor-parallel size here divides (6 heads, 6 key-value heads, MLP width 96), its
    vocabulary divided by neither 2 nor 3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    return LlamaForCausalLM(config)


def trainer_case(model: str, fused: bool, bf16: bool = False, trainer: str = "Trainer") -> dict:
    return dict(kind="trainer", model=model, fused=fused, bf16=bf16, trainer=trainer)


def reference(case: dict) -> Run:
    """The single-process unpatched run of ``case`` (no tensor parallelism)."""
    return Run.of(None, 1, {**case, "fused": False, "trainer": "Trainer"} if case["kind"] == "trainer"
                  else {**case, "fused": False})


def tensor_parallel(case: dict, ranks: int) -> Run:
    """``case`` on ``ranks`` tensor-parallel ranks: 2 launched with examples/distributed/tp2.yaml, else torchrun."""
    return Run.of("tp2" if ranks == 2 else "torchrun", ranks, case)


#: name → (ranks, model, trainer)
PARITY = {"tp2-untied": (2, "untied", "Trainer"), "tp2-tied-FusedTrainer": (2, "tied", "FusedTrainer"),
          "tp3-untied": (3, "untied", "Trainer"), "tp3-tied": (3, "tied", "Trainer")}


def parity_runs(name: str) -> list[Run]:
    ranks, model, trainer = PARITY[name]
    if gpus_short(ranks):
        return []  # the test skips
    case = trainer_case(model, fused=True, trainer=trainer)
    return [tensor_parallel(case, ranks), reference(case)]


def stock_runs() -> list[Run]:
    case = trainer_case("untied", fused=False)
    return [tensor_parallel(case, 2), reference(case)]


def bf16_runs() -> list[Run]:
    fp32 = trainer_case("untied", fused=False)
    return [tensor_parallel(trainer_case("untied", fused=True, bf16=True), 2),
            tensor_parallel(trainer_case("untied", fused=False, bf16=True), 2), reference(fp32)]


def colwise_runs() -> list[Run]:
    case = dict(kind="colwise", model="untied", fused=True)
    return [tensor_parallel(case, 2), reference(case)]


def fsdp_runs() -> list[Run]:
    if gpus_short(4):
        return []  # the test skips
    case = trainer_case("untied", fused=True)
    return [Run.of("fsdp2_tp2", 4, {**case, "fsdp": 2}), reference(case)]


def lora_runs() -> list[Run]:
    return [tensor_parallel(dict(kind="lora_refused", model="untied"), 2)]


def layout_runs() -> list[Run]:
    return [tensor_parallel(dict(kind="layouts", model="untied"), 2)]


def fsdp_shard_runs() -> list[Run]:
    return [tensor_parallel(dict(kind="fsdp_shard_refused", model="untied"), 2)]


#: name → (ranks, TRL trainer, model, FSDP2's data-parallel size: tensor parallelism over ranks // fsdp)
TRL_PARITY = {"tp2-sft": (2, "sft", "untied", 1), "tp2-dpo": (2, "dpo", "untied", 1),
              "tp3-sft-tied": (3, "sft", "tied", 1), "tp3-dpo": (3, "dpo", "untied", 1),
              "fsdp2-tp2-sft": (4, "sft", "untied", 2), "fsdp2-tp2-dpo": (4, "dpo", "untied", 2)}


def benchmark_runs() -> list[Run]:
    return [tensor_parallel(dict(kind="benchmark", fused=True), 2)]  # it patches its model: after the stock runs


#: name → the TRL rollout trainer's case (``fused``: ``FusedGRPOTrainer`` for GRPO, ``apply_fused_loss`` + TRL's
#: ``RLOOTrainer``), on 2 tensor-parallel ranks, or (``fsdp``) FSDP2 × TP on 4 in the launch of :func:`fsdp_runs`;
#: β > 0 against the perturbed reference model. The tp2 GRPO run generates for 2 steps at once
#: (``steps_per_generation=2``: TRL's generation batch from the process count would be twice the replica's, and the
#: second step's ratios move off 1, so its clip ratios are not all 0). The FSDP2 × TP run generates once, for its 2
#: steps (``num_iterations=2``: the second step's ratios move off 1): its reference can sample as the 2 replicas do
#: for a first generation only (tensor_parallel_worker.replica_seeded), and with one step per generation each
#: replica's shuffle of its own rows only reorders the rows of a step. Untied, as every FSDP2 × TP run here: with tied
#: embeddings transformers' own unpatched FSDP2 × TP run leaves the single process from its second step
#: (docs/tensor_parallel.md, Limits).
ROLLOUTS = {"tp2-FusedGRPOTrainer": dict(trl="grpo", model="tied", beta=0.04, steps=3, steps_per_generation=2),
            "tp2-RLOOTrainer": dict(trl="rloo", model="untied", beta=0.05, steps=2),
            "fsdp2-tp2-FusedGRPOTrainer": dict(trl="grpo", model="untied", beta=0.04, steps=2, num_iterations=2,
                                               num_generations=2, fsdp=2)}


def rollout_runs(name: str) -> list[Run]:
    """The rollout run ``name`` and its single-process reference; under FSDP2 × TP the reference samples as the 2
    replicas do (tensor_parallel_worker.replica_seeded)."""
    case = dict(kind="rollouts", fused=True, **ROLLOUTS[name])
    if gpus_short(2 * case.get("fsdp", 1)):
        return []  # the test skips
    run = Run.of("fsdp2_tp2", 4, case) if case.get("fsdp", 1) > 1 else tensor_parallel(case, 2)
    return [run, reference(case)]


def rollout_head_calls(case: dict) -> tuple[int, int]:
    """hf_fused's head calls in a rollout run, per rank: (the policy's on each rank's rows of lm_head, all). The
    policy's old log-probs once per generation in chunks of the per-device batch (``steps_per_generation`` chunks:
    GRPO and RLOO compute them in these cases), then each step; the reference model's (whole on every rank) once per
    chunk."""
    spg = case.get("steps_per_generation", 1)
    generations = -(-case["steps"] // (spg * case.get("num_iterations", 1)))
    return generations * spg + case["steps"], 2 * generations * spg + case["steps"]


def rollout_refused_runs() -> list[Run]:
    return [tensor_parallel(dict(kind="rollouts_refused", model="untied"), 2)]


def trl_runs(name: str) -> list[Run]:
    """The TRL run ``name`` and its single-process reference; under FSDP2 × TP, in the launch of
    :func:`fsdp_runs`' 4 ranks, against the same reference as the tensor-parallel run of that trainer."""
    ranks, trainer, model, fsdp = TRL_PARITY[name]
    if gpus_short(ranks):
        return []  # the test skips
    case = dict(kind="trl", trl=trainer, model=model, fused=True)
    run = Run.of("fsdp2_tp2", ranks, {**case, "fsdp": fsdp}) if fsdp > 1 else tensor_parallel(case, ranks)
    return [run, reference(case)]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> SharedLaunches:
    root = tmp_path_factory.mktemp("tensor_parallel")
    models = {}
    for name, tied in (("untied", False), ("tied", True)):
        models[name] = root / f"model-{name}"
        make_model(tied).save_pretrained(models[name])
    models["reference"] = root / "model-reference"  # DPO's reference model: the untied model perturbed
    perturbed(make_model(False)).save_pretrained(models["reference"])

    def launch(batch_runs: list[Run], dirs: list[Path]) -> None:
        entries = []
        for r, d in zip(batch_runs, dirs):
            case = json.loads(r.case)
            if "model" in case:
                case["model_dir"] = str(models[case["model"]])
            if case.get("trl") == "dpo" or case["kind"] == "rollouts":
                case["ref_dir"] = str(models["reference"])
            entries.append({"case": case, "dir": str(d)})
        batch = dirs[0] / "batch.json"
        batch.write_text(json.dumps(entries))
        config, ranks, timeout_s = batch_runs[0].config, batch_runs[0].processes, launch_timeout(len(batch_runs))
        if config is None:  # on GPUs the first one only (several: Trainer would wrap it in nn.DataParallel)
            run([sys.executable, str(WORKER), str(batch)], gpus=1, timeout_s=timeout_s)
        elif config == "torchrun":
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                 str(WORKER), str(batch)], timeout_s=timeout_s)
        else:
            accelerate_launch(config, WORKER, str(batch), processes=ranks, timeout_s=timeout_s)

    plans = {"test_trainer_under_tensor_parallelism_matches_single_process": parity_runs,
             "test_unpatched_tensor_parallel_run_gathers_the_logits": stock_runs,
             "test_bf16_twin": bf16_runs, "test_colwise_parallel_head_in_a_custom_loop": colwise_runs,
             "test_lora_on_a_tensor_parallel_head_is_refused": lora_runs,
             "test_fsdp2_times_tensor_parallel": fsdp_runs,
             "test_layouts_on_a_two_dimensional_mesh": layout_runs,
             "test_trl_trainers_under_tensor_parallelism_match_single_process": trl_runs,
             "test_rollout_trainers_under_tensor_parallelism_match_single_process": rollout_runs,
             "test_rollouts_refused_where_unverified_under_tensor_parallelism": rollout_refused_runs,
             "test_model_benchmark_on_tensor_parallel_ranks": benchmark_runs,
             "test_fsdp2_shard_outside_the_call_is_not_read_as_a_vocabulary_split": fsdp_shard_runs}
    return SharedLaunches(root, planned_runs(request, plans), launch,
                          lambda r, d: torch.load(d / "result.pt", weights_only=False))


def perturbed(model, seed: int = 99, scale: float = 0.05):
    """``model`` with every parameter moved by Gaussian noise (DPO's reference, apart from the policy)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def chunk_shards(ranks: int) -> list[tuple[int, int]]:
    """DTensor's ``Shard(0)`` rows of the vocabulary (``torch.chunk``: ceil-sized, the last rank short)."""
    width = -(-VOCAB // ranks)
    return [(r * width, min((r + 1) * width, VOCAB)) for r in range(ranks)]


def vocabulary_collectives(got: dict, ranks: int) -> list:
    """The collectives whose tensors have the vocabulary's width or a shard's (logits, the weight)."""
    widths = {VOCAB} | {stop - start for start, stop in chunk_shards(ranks)}
    return [c for c in got["collectives"] if any(dim in widths for shape in c[1] for dim in shape)]


@pytest.mark.parametrize("name", list(PARITY))
def test_trainer_under_tensor_parallelism_matches_single_process(name, runs):
    """``apply_fused_loss`` on transformers' tensor-parallel model, ``Trainer`` for 3 SGD steps: every logged loss
    and every updated parameter as the single-process unpatched run; hf_fused's head ran at every step on each
    rank's rows of lm_head (the DTensor's own layout: ceil-sized shards), with no collective of the vocabulary's
    width and no tensor of the whole vocabulary's width (transformers' own forward all-gathers the logits)."""
    ranks, model, _ = PARITY[name]
    skip_if_gpus_short(ranks)
    tp, ref = (runs(r) for r in parity_runs(name))
    assert_matches_reference(tp, ref, ranks)
    assert tp["shards"] == chunk_shards(ranks)
    assert tp["head_calls"] == 3 and tp["max_vocab_rows"] == 0
    assert tp["tied"] == (model == "tied")
    assert tp["head_layouts"] == [(("S(0)",), (ranks,), tp["shards"][0])]
    assert not vocabulary_collectives(tp, ranks), vocabulary_collectives(tp, ranks)


def test_unpatched_tensor_parallel_run_gathers_the_logits(runs):
    """What the fused head removes: transformers' tensor-parallel model, unpatched, all-gathers its ``[N, V/tp]``
    logits shards (and matches the single-process run, so the references above compare like with like)."""
    tp, ref = (runs(r) for r in stock_runs())
    assert_matches_reference(tp, ref, 2)
    gathers = vocabulary_collectives(tp, 2)
    assert any("all_gather" in op for op, _ in gathers), tp["collectives"]
    assert tp["head_calls"] == 0


def test_bf16_twin(runs):
    """``TrainingArguments(bf16=True)`` (autocast of the fp32 model) under tensor parallelism: the fused run against
    the unpatched bf16 run under the same tensor parallelism and the single-process fp32 one
    (``parity.assert_bf16_twin``). The unpatched twin runs tensor-parallel too because the engine rounds on its
    own: the row-parallel layers' partial sums are reduced over the ranks in bf16. On 2 H200s (NCCL) that put the
    fused run 0.10 of the fp32 update from it against the single-process bf16 run's 0.072, with hf_fused's head
    computed in fp32 throughout."""
    fused, stock, fp32 = (runs(r) for r in bf16_runs())
    assert_bf16_twin(fused, stock, fp32, ranks=2, stock_ranks=2)
    assert fused["head_calls"] == 3 and not vocabulary_collectives(fused, 2)


def test_colwise_parallel_head_in_a_custom_loop(runs):
    """A custom loop on a model whose lm_head torch's ``parallelize_module`` shards with
    ``ColwiseParallel(output_layouts=Replicate())`` (its pre-hook hands lm_head a replicated DTensor): a step through
    the patched model's loss, then one through ``LinearCrossEntropyLoss.from_model`` on the backbone's hidden states;
    the losses and every updated parameter as the single-process unpatched loop."""
    tp, ref = (runs(r) for r in colwise_runs())
    assert tp["shards"] == chunk_shards(2)
    assert tp["head_reads"] == 2 and tp["head_layouts"] == [(("S(0)",), (2,), tp["shards"][0])]
    assert_matches_reference(tp, ref, 2)


def test_lora_on_a_tensor_parallel_head_is_refused(runs):
    """A LoRA adapter on a tensor-parallel lm_head: ``apply_fused_loss`` refuses it, saying why and what to do."""
    (got,) = (runs(r) for r in lora_runs())
    assert got["error"] and "tensor-parallel lm_head" in got["error"] and "target_modules" in got["error"], got


def test_fsdp2_times_tensor_parallel(runs):
    """A 2-D mesh: ``DistributedConfig(tp_size=2, fsdp_size=2)`` on 4 ranks, FSDP2 over data-parallel pairs that each
    see half the global batch, tensor parallelism within each pair. Outside its call lm_head's weight is
    ``(_StridedShard(0), Shard(0))`` on the (fsdp, tp) mesh; inside, FSDP2 has gathered its own dimension and hf_fused
    reads a ``Shard(0)`` DTensor of the tensor-parallel dimension. The losses and every updated parameter as the
    single-process run on the same global batch."""
    skip_if_gpus_short(4)
    tp, ref = (runs(r) for r in fsdp_runs())
    assert tp["wrapper"].startswith("FSDP"), tp["wrapper"]
    assert_matches_reference(tp, ref, 4)
    assert tp["head_calls"] == 3 and tp["max_vocab_rows"] == 0
    assert {(placements, mesh) for placements, mesh, _ in tp["head_layouts"]} == {(("S(0)",), (2,))}
    assert tp["shards"] == chunk_shards(2) * 2  # ranks (fsdp, tp) in row-major order


def test_layouts_on_a_two_dimensional_mesh(runs):
    """``vocab_parallel_head`` on a ``(Replicate(), Shard(0))`` weight and bias of a 2-D ("dp", "tp") mesh: the tp
    dimension is the vocabulary split; loss and gradients (the weight's and bias's DTensors of the same layout) as
    the op on the whole tensors. Refused, each with a message naming the layout: a weight sharded over the hidden
    dimension, a plain bias beside a sharded weight, hidden states sharded over the sequence."""
    (got,) = (runs(r) for r in layout_runs())
    assert got["shard"] == chunk_shards(2)[0] and got["grad_placements"] == "(Replicate(), Shard(dim=0))"
    for name, err in got["errors"].items():
        assert err <= 1e-6, (name, err)
    assert set(got["refused"]) == {"hidden_dim", "plain_bias", "sequence_sharded_input"}, got["refused"]
    assert "Shard(dim=1)" in got["refused"]["hidden_dim"] and "a plain tensor" in got["refused"]["plain_bias"]


def test_fsdp2_shard_outside_the_call_is_not_read_as_a_vocabulary_split(runs):
    """``LinearCrossEntropyLoss`` called outside the forward of a model FSDP2 shards over 2 ranks: lm_head's weight is
    FSDP2's ``Shard(0)`` shard there (each rank with its own batch), so reading it as a vocabulary split would merge
    unrelated tokens; it is refused, saying where to compute the loss instead."""
    (got,) = (runs(r) for r in fsdp_shard_runs())
    assert got["error"] and "FSDP2's shard" in got["error"] and "apply_fused_loss" in got["error"], got


@pytest.mark.parametrize("name", list(TRL_PARITY))
def test_trl_trainers_under_tensor_parallelism_match_single_process(name, runs):
    """TRL's ``SFTTrainer`` and ``DPOTrainer`` (its reference model tensor-parallel and patched too) on transformers'
    tensor-parallel model patched by ``apply_fused_loss``, under accelerate's ``ParallelismConfig(tp_size=n)`` (2
    ranks: examples/distributed/tp2.yaml; 3: torchrun) and ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` (4 ranks,
    examples/distributed/fsdp2_tp2.yaml: FSDP2 over data-parallel pairs that each see half the global batch, as in
    :func:`test_fsdp2_times_tensor_parallel`), 3 SGD steps: every logged loss and metric and every updated parameter
    as TRL's single-process unpatched run on the same global batch. TRL's fused-head calls ran through hf_fused on
    each rank's rows of lm_head (every step, the policy's and DPO's reference's), with no collective of the
    vocabulary's width and no tensor of the whole vocabulary's width."""
    ranks, trainer, _, fsdp = TRL_PARITY[name]
    skip_if_gpus_short(ranks)
    tp, ref = (runs(r) for r in trl_runs(name))
    tp_size = ranks // fsdp
    assert_matches_reference(tp, ref, ranks)
    if fsdp > 1:
        assert tp["wrapper"].startswith("FSDP"), tp["wrapper"]
    assert len(tp["logs"]) == len(ref["logs"]) == 4  # 3 steps and the summary
    for step, (got, want) in enumerate(zip(tp["logs"], ref["logs"])):
        assert got.keys() == want.keys(), (step, got.keys() ^ want.keys())
        for key, value in want.items():
            if key == "total_flos":
                continue
            assert math.isclose(got[key], value, rel_tol=1e-5,
                                abs_tol=2e-6 if "loss" in key else logp_difference_tol(key, want)), \
                (step, key, got[key], value)
    # Trainer adds every rank's estimate for its own rows (6 · parameters · the padded batch's tokens): tp_size times
    # the batch's; under FSDP2 each data-parallel pair pads its half of the batch to that half's longest row only
    flos, want_flos = tp["logs"][-1]["total_flos"], ref["logs"][-1]["total_flos"]
    assert flos == tp_size * want_flos if fsdp == 1 else 0 < flos <= tp_size * want_flos, (flos, want_flos)
    calls = 3 if trainer == "sft" else 6  # DPO: the policy's and the reference model's head at every step
    assert tp["head_calls"] == calls and tp["head_reads"] == calls and tp["max_vocab_rows"] == 0
    assert tp["shards"] == chunk_shards(tp_size) * fsdp  # ranks (fsdp, tp) in row-major order
    assert tp["head_layouts"] == [(("S(0)",), (tp_size,), tp["shards"][0])]
    assert not vocabulary_collectives(tp, tp_size), vocabulary_collectives(tp, tp_size)


@pytest.mark.parametrize("name", list(ROLLOUTS))
def test_rollout_trainers_under_tensor_parallelism_match_single_process(name, runs):
    """``FusedGRPOTrainer`` and TRL's ``RLOOTrainer`` on the patched tensor-parallel model under
    ``ParallelismConfig(tp_size=2)`` (tp2.yaml), and ``FusedGRPOTrainer`` under ``ParallelismConfig(dp_shard_size=2,
    tp_size=2)`` (4 ranks, fsdp2_tp2.yaml: FSDP2 over the 2 replicas), each tensor-parallel group one data-parallel
    replica (hf_fused/integrations/trl/tensor_parallel.py), completions sampled by transformers' ``generate`` on the
    sharded model, β > 0: the ranks of a replica sampled the same completions, the replicas' together the same as
    TRL's single-process unpatched run on the same global batch, TRL's generation batch counting replicas, and every
    logged loss and metric (reward, reward_std, kl, entropy, clip ratios, token counts) and every updated parameter
    as that run's. Loss values get TRL's absolute floor (2e-6), and on-policy RLOO's, zero in exact arithmetic, the
    bound of the rounding residue of its sum (twice num_tokens·2⁻²⁴·reward: 2.6e-5 at 36 tokens of reward 6).
    hf_fused's head ran on each rank's rows for the policy (old log-probs and training steps); TRL loads the
    reference model whole on every rank.

    Under FSDP2 × TP replica ``r`` samples from the seed plus ``r``; the reference is TRL's ``GRPOTrainer`` in one
    process generating the global batch's two halves (replica 0's prompts, then replica 1's: accelerate's data
    loader hands the replicas consecutive per-replica batches) each with TRL's own ``generate`` call from the
    generator seeded as that replica's ranks are (tensor_parallel_worker.replica_seeded): the same prompts, batch
    shapes and random numbers as each replica's, on the unsharded model. Everything after generation (rewards,
    advantages, old and reference log-probs, the loss, the logged metrics) is TRL's on the whole global batch, the
    one run a data-parallel trainer must equal; the completions themselves are compared, so a reference that sampled
    otherwise fails here rather than passing on different data."""
    case = ROLLOUTS[name]
    replicas = case.get("fsdp", 1)
    skip_if_gpus_short(2 * replicas)
    tp, ref = (runs(r) for r in rollout_runs(name))
    assert tp["world"] == 2 * replicas and ref["world"] == 1 and tp["replicas"] == replicas
    assert tp["completions_agree"], "the ranks of a tensor-parallel group sampled different completions"
    assert tp["completions"] == ref["completions"]
    if replicas > 1:
        assert tp["wrapper"].startswith("FSDP"), tp["wrapper"]
    assert tp["generation_batch_size"] == ref["generation_batch_size"] == 4 * case.get("steps_per_generation", 1)
    assert len(tp["logs"]) == len(ref["logs"]) == case["steps"] + 1  # every step and the summary
    residue = 0.0
    for step, (got, want) in enumerate(zip(tp["logs"], ref["logs"])):
        assert got.keys() == want.keys(), (step, got.keys() ^ want.keys())
        if case["trl"] == "rloo" and "num_tokens" in want:
            # on-policy RLOO's loss is 0 in exact arithmetic (leave-one-out advantages sum to 0, ratio 1): what is
            # logged is the rounding residue of a sum over the tokens of advantages no larger than the rewards
            # (lengths, ≥ 0), in either run at most num_tokens·u·reward (u = 2⁻²⁴)
            residue = max(residue, want["num_tokens"] * 2.0**-24 * want["reward"])
        for key, value in want.items():
            floor = max(2e-6, 2 * residue) if "loss" in key else 1e-7
            assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=floor), (step, key, got[key], value)
    assert {"reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean"} <= ref["logs"][0].keys()
    if case["trl"] == "grpo":
        assert any(row.get("clip_ratio/region_mean", 0) > 0 for row in ref["logs"])
    errors = update_errors(tp, ref)
    assert max(errors.values()) <= PARAM_RTOL, errors
    moved = [n for n in errors if not torch.equal(ref["params"][n], ref["initial"][n])]
    assert any("embed_tokens" in n for n in moved) and len(moved) >= 4, moved
    policy, calls = rollout_head_calls(case)
    assert tp["head_reads"] == policy and tp["head_calls"] == calls
    assert tp["head_layouts"] == [(("S(0)",), (2,), chunk_shards(2)[0])]


def test_rollouts_refused_where_unverified_under_tensor_parallelism(runs):
    """``FusedGRPOTrainer`` with transformers' continuous batching on the tensor-parallel model (not verified there;
    vLLM, context and sequence parallelism are refused alike): it raises, saying why and what to do instead."""
    (got,) = (runs(r) for r in rollout_refused_runs())
    error = got["error"]
    assert error and "under tensor parallelism (tp_size=2)" in error and "continuous_batching" in error, error
    assert "generate" in error, error


def test_model_benchmark_on_tensor_parallel_ranks(runs):
    """``torchrun -m benchmarks.tensor_parallel_model`` (the command behind docs/tensor_parallel.md's per-rank
    figures) on the 2 tensor-parallel ranks, fp32, a tiny model: a row for every rank and variant, and hf_fused's loss
    and each rank's rows of lm_head's gradient within 1e-5 of transformers' own step (the gathered logits)."""
    from benchmarks.tensor_parallel_model import VARIANTS

    (got,) = (runs(r) for r in benchmark_runs())
    cells = [line.split() for line in got["printed"].splitlines()]
    rows = {tuple(row[:2]): row for row in cells if len(row) > 2 and row[1] in VARIANTS}
    assert set(rows) == {(str(rank), variant) for rank in range(2) for variant in VARIANTS}, got["printed"]
    for (rank, variant), row in rows.items():
        if variant != "transformers":
            loss_error, grad_error = float(row[-3]), float(row[-1])
            assert loss_error <= 1e-5 and grad_error <= 1e-5, (rank, variant, row)
