"""Tensor-parallel runs for tests/distributed/test_tensor_parallel.py, under ``torch.distributed.run`` (every rank one
tensor-parallel rank over gloo, or with ``HF_FUSED_TEST_DEVICE=cuda`` on a GPU of its own over NCCL: ranks.py),
``accelerate launch`` with examples/distributed/tp2.yaml or fsdp2_tp2.yaml, or as one plain process (the unpatched
single-process reference; under ``HF_FUSED_TEST_DEVICE=cuda`` on the first GPU). One argument: a
JSON file listing the runs of this launch, ``[{"case": {...}, "dir": ...}, ...]`` (as launch.py writes it); a run
that raises leaves its traceback in ``<dir>/error.txt``. Rank 0 writes ``<dir>/result.pt``. A case:

    kind        "trainer": ``transformers.Trainer`` for 3 SGD steps on train_worker.TinyDataset, the model loaded with
                ``from_pretrained(model_dir, distributed_config=DistributedConfig(tp_size=world))`` (lm_head a
                ``Shard(0)`` DTensor with transformers' ``colwise_gather_output`` forward); one process: no TP.
                "colwise": a custom loop on a plain model whose lm_head torch's ``parallelize_module`` shards with
                ``ColwiseParallel(output_layouts=Replicate())``: a step through the patched model's loss, then a
                step through ``LinearCrossEntropyLoss.from_model`` on the backbone's hidden states.
                "lora_refused": a LoRA adapter on the tensor-parallel lm_head: ``apply_fused_loss`` refuses it.
                "layouts": DTensor layouts of a 2-D mesh read by the model layer, and those it refuses
                (:func:`layouts`).
                "fsdp_shard_refused": ``LinearCrossEntropyLoss`` outside the forward of a model FSDP2 shards:
                refused (:func:`fsdp_shard_refused`).
                "trl": TRL's ``SFTTrainer`` or ``DPOTrainer`` (``trl``: "sft" or "dpo") for 3 SGD steps on the
                model as "trainer" loads it (:func:`trl_trainer`); DPO's reference model from ``ref_dir``.
                "rollouts": TRL's ``GRPOTrainer`` (``FusedGRPOTrainer`` when ``fused``) or ``RLOOTrainer``
                (``trl``: "grpo" or "rloo") for ``steps`` SGD steps, completions sampled on the model, β > 0 with
                the reference model ``ref_dir`` (:func:`rollouts`; one process with ``fsdp``: sampling as the
                replicas do, :func:`replica_seeded`).
                "rollouts_refused": ``FusedGRPOTrainer`` with continuous batching on the tensor-parallel model:
                refused (:func:`rollouts_refused`).
                "benchmark": ``python -m benchmarks.tensor_parallel_model``'s command line on these ranks, tiny and
                fp32 (:func:`benchmark`).
    model_dir   the tiny model (saved with ``save_pretrained``)
    fsdp        "trainer", "trl", "rollouts": FSDP2 over this many ranks × tensor parallelism over the rest
                (``DistributedConfig(tp_size=world // fsdp, fsdp_size=fsdp)``), the global batch kept at 4 rows
    fused       patch the model with ``hf_fused.apply_fused_loss`` first
    trainer     "Trainer" (default) or "FusedTrainer" (which patches the model itself)
    bf16        ``TrainingArguments(bf16=True)`` (autocast of the fp32 model)

``result.pt``: ``losses``, whole fp32 ``params`` after and ``initial`` before training (DTensors gathered), ``world``,
``head_calls`` (hf_fused's head computations in training), ``max_vocab_rows`` (the most rows of any tensor with the
whole vocabulary as last dimension: gathered logits), ``collectives`` (every collective's op name and the shapes of
its tensors, from training), ``shards`` (each rank's lm_head rows), ``tied`` (lm_head's weight is the input
embeddings'), ``head_layouts`` (the placements and mesh shape of lm_head's weight where hf_fused read it, and the
rows read; "colwise": ``head_reads``, how many times),
``wrapper`` (the Trainer's wrapped model's class), ``error`` (lora_refused, fsdp_shard_refused: the message);
"trl": ``logs`` (every logged row without timings), ``head_reads`` (lm_head weights read as a vocabulary shard) and
``wrapper``; "rollouts": ``logs``, ``head_reads``, ``completions`` (each generation's completion ids, the
replicas' in replica order), ``completions_agree`` (the ranks of each replica generated them alike), ``replicas``,
``generation_batch_size``, ``wrapper``; "benchmark": ``printed`` (what rank 0 printed).

Accelerate allows a ``ParallelismConfig`` (which ``Trainer`` builds for a tensor-parallel model) only on accelerators;
on CPU ranks :func:`allow_parallelism_config_on_cpu_ranks` lets it through, as ``cpu_fsdp/sitecustomize.py`` lets
FSDP through: the ranks then run what they run on GPUs. On GPU ranks nothing is lifted: the trainers run on the
rank's GPU (``use_cpu`` off), the worker's own meshes are CUDA meshes, and what the worker builds itself (models,
batches, hidden states) goes to the rank's GPU (``ranks.rank_device``); results are saved as CPU tensors as on CPU.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ranks import CUDA, exit_rank, init_process_group, rank_device, run_each
from train_worker import TinyDataset, VocabWidthTracker, count_fused_head_calls, full_parameters


def allow_parallelism_config_on_cpu_ranks() -> None:
    """Accelerate refuses a ``ParallelismConfig`` on ``MULTI_CPU`` ranks (its check names accelerators only); skip that
    check there. Nothing else of accelerate changes; on GPU ranks (``HF_FUSED_TEST_DEVICE=cuda``) nothing at all."""
    if CUDA:
        return
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    validate = ParallelismConfig._validate_accelerator
    if getattr(validate, "_cpu_ranks", False):
        return

    def validate_on_cpu_ranks(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            validate(self, accelerator)

    validate_on_cpu_ranks._cpu_ranks = True
    ParallelismConfig._validate_accelerator = validate_on_cpu_ranks


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective (``c10d`` and functional ``_c10d_functional`` ops) as ``(op, shapes)``."""

    def __init__(self):
        super().__init__()
        self.calls: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name:
            shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.calls.add((name, shapes))
        return func(*args, **(kwargs or {}))


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def load(case: dict, tensor_parallel: bool):
    kwargs = {}
    if tensor_parallel and world() > 1:
        from transformers.distributed import DistributedConfig

        fsdp = case.get("fsdp", 1)
        kwargs["distributed_config"] = DistributedConfig(tp_size=world() // fsdp, fsdp_size=fsdp)
    return transformers.AutoModelForCausalLM.from_pretrained(case["model_dir"], attn_implementation="eager",
                                                             dtype=torch.float32, **kwargs)


#: What hf_fused's model layer read of lm_head's weight, per head call: ``(placements, mesh shape, (start, stop))``.
HEAD_LAYOUTS: list = []


def record_head_layouts() -> list:
    """From now on (:data:`HEAD_LAYOUTS`, cleared), record each lm_head weight hf_fused's patched forward,
    ``LinearCrossEntropyLoss`` and, once TRL is imported, hf_fused's answer to TRL's fused head read as a vocabulary
    shard (installed once per process, and in the TRL head once TRL is loaded)."""
    HEAD_LAYOUTS.clear()
    from hf_fused.model import forward, head_loss

    if not getattr(forward.vocab_parallel_head, "_recorded", False):
        original = forward.vocab_parallel_head

        def recorded(weight, bias=None):
            out = original(weight, bias)
            if out[2] is not None:
                HEAD_LAYOUTS.append((tuple(str(p) for p in weight.placements), tuple(weight.device_mesh.shape),
                                     (out[2].start, out[2].stop)))
            return out

        recorded._recorded = True
        forward.vocab_parallel_head = head_loss.vocab_parallel_head = recorded
    if "trl" in sys.modules:  # TRL's fused-head calls read lm_head through hf_fused's TRL integration
        from hf_fused.integrations.trl import head as trl_head

        trl_head.vocab_parallel_head = forward.vocab_parallel_head
    return HEAD_LAYOUTS


def shards(model) -> list:
    """Every rank's ``(start, stop)`` of lm_head's rows as hf_fused read them (collective); without a fused head call,
    as the weight's 1-D layout gives them."""
    if HEAD_LAYOUTS:
        mine = HEAD_LAYOUTS[-1][2]
    else:
        weight = model.get_output_embeddings().weight
        if not hasattr(weight, "placements"):
            return [(0, weight.shape[0])]
        from hf_fused.model.tensor_parallel import vocab_parallel_head

        shard = vocab_parallel_head(weight.detach())[2]
        mine = (shard.start, shard.stop)
    if world() == 1:
        return [mine]
    out = [None] * world()
    dist.all_gather_object(out, mine)
    return out


def train(case: dict, out: str) -> dict:
    allow_parallelism_config_on_cpu_ranks()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(out), "trainer"), per_device_train_batch_size=4 // case.get("fsdp", 1),
        max_steps=3, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, bf16=case.get("bf16", False),
        use_cpu=not CUDA, dataloader_num_workers=0, disable_tqdm=True,
    )
    model = load(case, tensor_parallel=True)
    trainer_cls = transformers.Trainer
    if case.get("trainer") == "FusedTrainer":
        from hf_fused import FusedTrainer as trainer_cls
    elif case.get("fused"):
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    initial = full_parameters(model)
    trainer = trainer_cls(model=model, args=args, train_dataset=TinyDataset(),
                          data_collator=transformers.default_data_collator)
    layouts = record_head_layouts()
    head_calls = count_fused_head_calls()
    tracker, recorder = VocabWidthTracker(model.config.vocab_size, model.config.hidden_size), CollectiveRecorder()
    with tracker.mode, recorder:
        trainer.train()
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e], "initial": initial,
            "params": full_parameters(trainer.model), "head_calls": head_calls["all"],
            "max_vocab_rows": tracker.max_rows, "collectives": sorted(recorder.calls), "shards": shards(model),
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "head_layouts": sorted(set(layouts)), "wrapper": type(trainer.model_wrapped).__name__}


def colwise(case: dict, out: str) -> dict:
    """Two SGD steps of a custom loop: the patched model's loss, then ``LinearCrossEntropyLoss`` on hidden states."""
    device = rank_device()
    model = load(case, tensor_parallel=False).to(device)  # no Trainer to place it: on the rank's device first
    if world() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (world(),))
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    initial = full_parameters(model)
    dataset = TinyDataset()
    batch = [dataset[i] for i in range(4)]
    inputs = {k: torch.stack([row[k] for row in batch]).to(device) for k in batch[0]}
    losses = []
    if case.get("fused"):
        from hf_fused import LinearCrossEntropyLoss, apply_fused_loss

        apply_fused_loss(model)
        loss_fn = LinearCrossEntropyLoss.from_model(model)
    layouts = record_head_layouts()
    for step in range(2):
        model.zero_grad()
        if step == 0 or not case.get("fused"):
            loss = model(**inputs).loss
        else:
            backbone = model.get_decoder()
            hidden = backbone(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
            loss = loss_fn(hidden, inputs["labels"])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
        losses.append(loss.item())
    return {"losses": losses, "initial": initial, "params": full_parameters(model), "shards": shards(model),
            "head_layouts": sorted(set(layouts)), "head_reads": len(layouts)}


def lora_refused(case: dict, out: str) -> dict:
    import peft

    from hf_fused import apply_fused_loss

    model = peft.get_peft_model(load(case, tensor_parallel=True), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    try:
        apply_fused_loss(model)
    except NotImplementedError as e:
        return {"error": str(e)}
    return {"error": None}


def layouts(case: dict, out: str) -> dict:
    """:func:`hf_fused.model.tensor_parallel.vocab_parallel_head` on DTensors of a 2-D ``(1, world)`` mesh ("dp",
    "tp"), weight and bias ``(Replicate(), Shard(0))``: the loss and the gradients (the weight's and bias's a DTensor
    of their layout, gathered) against the op on the whole tensors; and the layouts it refuses, with their
    messages."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hf_fused.model.tensor_parallel import local_hidden, vocab_parallel_head
    from hf_fused.ops import linear_cross_entropy

    device = rank_device()
    mesh = init_device_mesh(device.type, (1, world()), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)  # drawn on the CPU (the same values on every device), then moved
    hidden, weight, bias = torch.randn(2, 5, 16, generator=g), torch.randn(131, 16, generator=g), torch.randn(131)
    labels = torch.randint(0, 131, (2, 5), generator=g)
    hidden, weight, bias, labels = (t.to(device) for t in (hidden, weight, bias, labels))
    whole = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = linear_cross_entropy(whole[0], whole[1], labels, whole[2])
    ref.backward()
    layout = [Replicate(), Shard(0)]
    h = hidden.clone().requires_grad_()
    w, b = (distribute_tensor(t, mesh, layout).requires_grad_() for t in (weight, bias))
    local_w, local_b, shard = vocab_parallel_head(w, b)
    loss = linear_cross_entropy(h, local_w, labels, local_b, vocab_parallel=shard)
    loss.backward()
    got = [h.grad, w.grad.full_tensor(), b.grad.full_tensor()]
    errors = {name: float((a - r.grad).norm() / r.grad.norm()) for name, a, r in zip(("hidden", "weight", "bias"),
                                                                                   got, whole)}
    errors["loss"] = abs(loss.item() - ref.item()) / ref.item()
    refused = {}
    for name, call in (
        ("hidden_dim", lambda: vocab_parallel_head(distribute_tensor(weight, mesh, [Replicate(), Shard(1)]))),
        ("plain_bias", lambda: vocab_parallel_head(w, bias)),
        ("sequence_sharded_input", lambda: local_hidden(distribute_tensor(hidden, mesh, [Replicate(), Shard(1)]))),
    ):
        try:
            call()
        except NotImplementedError as e:
            refused[name] = str(e)
    return {"errors": errors, "shard": (shard.start, shard.stop), "grad_placements": str(w.grad.placements),
            "refused": refused}


def fsdp_shard_refused(case: dict, out: str) -> dict:
    """``LinearCrossEntropyLoss`` on a model FSDP2 shards over the ranks (``fully_shard``), called on hidden states
    outside the model's forward: lm_head's weight is then FSDP2's ``Shard(0)`` data-parallel shard, which must not be
    read as a vocabulary split. The message it raises, or ``None``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_fused import LinearCrossEntropyLoss

    device = rank_device()
    model = load(case, tensor_parallel=False).to(device)
    fully_shard(model, mesh=init_device_mesh(device.type, (world(),)))
    loss_fn = LinearCrossEntropyLoss(model.lm_head)
    dataset = TinyDataset()
    row = dataset[dist.get_rank()]
    hidden = torch.randn(1, row["labels"].numel(), model.config.hidden_size).to(device)
    try:
        loss_fn(hidden, row["labels"][None].to(device))
    except NotImplementedError as e:
        return {"error": str(e)}
    return {"error": None}


def _sentence(i: int, n: int) -> str:
    from models import WORDS

    g = torch.Generator().manual_seed(i)
    return " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def _is_timing(key: str) -> bool:
    return "runtime" in key or "per_second" in key or key.endswith("time") or "/time" in key


def trl_trainer(case: dict, out: str) -> dict:
    """TRL's ``SFTTrainer`` or ``DPOTrainer`` (``case["trl"]``) for 3 SGD steps on the tensor-parallel model (one
    process: no tensor parallelism; ``case["fsdp"]``: FSDP2 × TP, as :func:`load` builds it), global batch 4, fp32;
    patched by ``apply_fused_loss`` first when ``fused``. DPO's reference model is ``case["ref_dir"]`` (the model
    perturbed, so that no reward is exactly 0 at the first step, where a comparison ``chosen > rejected`` of two
    zeros would flip on the last bit), loaded as the policy is (tensor-parallel, FSDP2 too, patched when
    ``fused``)."""
    from datasets import Dataset

    from models import make_tokenizer

    allow_parallelism_config_on_cpu_ranks()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model = load(case, tensor_parallel=True)
    if case.get("fused"):
        from hf_fused import apply_fused_loss

        apply_fused_loss(model)
    initial = full_parameters(model)
    tokenizer = make_tokenizer()
    common = dict(
        output_dir=os.path.join(os.path.dirname(out), "trainer"), per_device_train_batch_size=4 // case.get("fsdp", 1),
        max_steps=3, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, bf16=False, use_cpu=not CUDA,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    if case["trl"] == "sft":
        from trl import SFTConfig, SFTTrainer

        tokenizer.padding_side = "right"
        data = Dataset.from_dict({"text": [_sentence(i, 4 + i % 5) for i in range(16)]})
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    else:
        from trl import DPOConfig, DPOTrainer

        data = Dataset.from_dict({
            "prompt": [_sentence(i, 2 + i % 3) for i in range(16)],
            "chosen": [" " + _sentence(200 + i, 2 + i % 4) for i in range(16)],
            "rejected": [" " + _sentence(300 + i, 1 + i % 5) for i in range(16)],
        })
        ref_model = load({**case, "model_dir": case["ref_dir"]}, tensor_parallel=True)
        if case.get("fused"):
            from hf_fused import apply_fused_loss

            apply_fused_loss(ref_model)
        trainer = DPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(**common), train_dataset=data,
                             processing_class=tokenizer)
    layouts = record_head_layouts()
    head_calls = count_fused_head_calls()
    tracker, recorder = VocabWidthTracker(model.config.vocab_size, model.config.hidden_size), CollectiveRecorder()
    with tracker.mode, recorder:
        trainer.train()
    logs = [{k: v for k, v in entry.items() if not _is_timing(k)} for entry in trainer.state.log_history]
    return {"losses": [e["loss"] for e in logs if "loss" in e], "logs": logs, "initial": initial,
            "params": full_parameters(trainer.model), "head_calls": head_calls["all"],
            "max_vocab_rows": tracker.max_rows, "collectives": sorted(recorder.calls), "shards": shards(model),
            "head_layouts": sorted(set(layouts)), "head_reads": len(layouts),
            "wrapper": type(trainer.model_wrapped).__name__}


#: The most draws :func:`replica_seeded` looks for between ``__init__`` and the first generation.
MAX_DRAWS_BEFORE_GENERATION = 16


def base_seed_draw(generator: torch.Generator | None = None) -> None:
    """One draw from ``generator`` (default: the global one) as torch's ``DataLoader`` makes it for each iterator's
    base seed from a loader without a generator of its own."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)


def sampling_rng_state() -> tuple:
    """The global generators sampling draws from: the CPU's and, under ``HF_FUSED_TEST_DEVICE=cuda``, the current
    GPU's (``torch.multinomial`` on CUDA probabilities draws from the GPU's generator, not the CPU's)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if CUDA else None


def set_sampling_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def replica_seeded(trainer_cls: type, replicas: int) -> type:
    """``trainer_cls`` (TRL's ``GRPOTrainer``) in one process sampling as ``replicas`` data-parallel replicas do:
    the generation batch's ``replicas`` equal consecutive slices (accelerate's data loader hands replica ``r`` the
    ``r``-th of every ``replicas`` consecutive per-replica batches, so the global batch is the replicas' slices in
    order), each generated by TRL's own ``_generate_single_turn`` (transformers' ``generate``, the slice's batch
    shape) from the global generator as replica ``r``'s ranks hold it: seeded ``seed + r`` at the end of
    ``__init__`` (hf_fused's re-seeding, integrations/trl/tensor_parallel.py), then advanced by the draws every
    process makes before its first generation. Those draws are found, not assumed: the count of data-loader base-seed
    draws (:func:`base_seed_draw`) that takes this process's generator from its state after ``__init__`` to its
    state at the first generation; anything else drawn raises. On a GPU sampling draws from the GPU's generator
    (:func:`sampling_rng_state`), seeded alike and drawn from by nothing before the first generation (checked: it
    raises otherwise). Only the first generation can be reproduced so: after it each replica's ranks shuffle their
    own rows with their own generator (``_prepare_inputs``), which one process does not; a second generation
    raises."""

    class ReplicaSeeded(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._after_init = torch.get_rng_state()  # TRL's set_seed(seed, device_specific=True): seed + 0
            self._gpu_after_init = sampling_rng_state()[1]
            self._generations = 0

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            if self._generations:
                raise RuntimeError("replica_seeded: a second generation cannot be sampled as the replicas sample it")
            self._generations += 1
            draws = self._draws_since_init()
            streams = []
            for r in range(replicas):
                torch.manual_seed(self.args.seed + r)  # the GPUs' generators too
                for _ in range(draws):
                    base_seed_draw()
                streams.append(sampling_rng_state())
            per_replica = len(prompt_ids) // replicas
            completions, logprobs = [], []
            for r in range(replicas):
                set_sampling_rng_state(streams[r])
                ids, lps = super()._generate_single_turn(prompt_ids[r * per_replica:(r + 1) * per_replica], *args,
                                                         **kwargs)
                streams[r] = sampling_rng_state()
                completions += ids
                logprobs = None if lps is None else logprobs + lps
            set_sampling_rng_state(streams[0])  # one process carries on as replica 0's ranks do
            return completions, logprobs

        def _draws_since_init(self) -> int:
            gpu = sampling_rng_state()[1]
            if gpu is not None and not torch.equal(gpu, self._gpu_after_init):
                raise RuntimeError("replica_seeded: the GPU's generator moved between __init__ and the first "
                                   "generation; the replicas' generators cannot be reproduced")
            now, probe = torch.get_rng_state(), torch.Generator()
            probe.set_state(self._after_init)
            for draws in range(MAX_DRAWS_BEFORE_GENERATION + 1):
                if torch.equal(probe.get_state(), now):
                    return draws
                base_seed_draw(probe)
            raise RuntimeError(
                "replica_seeded: the global generator moved between __init__ and the first generation by something "
                f"other than up to {MAX_DRAWS_BEFORE_GENERATION} data-loader base-seed draws; the replicas' "
                "generators cannot be reproduced"
            )

    ReplicaSeeded.__name__ = ReplicaSeeded.__qualname__ = f"ReplicaSeeded{trainer_cls.__name__}"
    return ReplicaSeeded


def rollouts(case: dict, out: str) -> dict:
    """TRL's ``GRPOTrainer`` or ``RLOOTrainer`` (``case["trl"]``: "grpo" or "rloo") for ``steps`` SGD steps on the
    model as "trainer" loads it (``fsdp``: FSDP2 × TP, each tensor-parallel group one data-parallel replica), global
    batch 4 (``num_generations`` completions, default 4, per prompt), completions sampled by transformers'
    ``generate`` on that model (the tensor-parallel one under a launch), rewards from tests/grpo_harness.py's
    ``length_reward``, β > 0 with the reference model ``case["ref_dir"]`` (TRL loads it whole on every rank), fp32.
    ``fused``: ``hf_fused.FusedGRPOTrainer`` for GRPO, ``apply_fused_loss`` + TRL's trainer for RLOO; else TRL's
    trainer on the unpatched model. ``steps_per_generation``, ``num_iterations`` (GRPO): TRL's. One process with
    ``fsdp`` > 1 samples as that many replicas do (:func:`replica_seeded`). Also ``completions`` (each generation's
    completion ids, the replicas' in replica order), ``completions_agree`` (the ranks of each replica sampled the
    same), ``replicas`` and ``generation_batch_size`` (the trainer's)."""
    import grpo_harness
    from datasets import Dataset

    from models import make_tokenizer

    allow_parallelism_config_on_cpu_ranks()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model = load(case, tensor_parallel=True)
    model.config._name_or_path = case["ref_dir"]  # TRL builds its reference model from here
    initial = full_parameters(model)
    replicas = case.get("fsdp", 1)
    common = dict(
        output_dir=os.path.join(os.path.dirname(out), "trainer"),
        per_device_train_batch_size=4 // replicas if world() > 1 else 4,
        num_generations=case.get("num_generations", 4), max_completion_length=6, max_steps=case["steps"],
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=not CUDA,
        dataloader_num_workers=0, disable_tqdm=True, beta=case["beta"],
    )
    data = Dataset.from_dict({"prompt": grpo_harness.PROMPTS})
    kwargs = dict(model=model, reward_funcs=grpo_harness.length_reward, train_dataset=data,
                  processing_class=make_tokenizer())
    if case["trl"] == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from hf_fused import FusedGRPOTrainer

        config = GRPOConfig(steps_per_generation=case.get("steps_per_generation", 1),
                            num_iterations=case.get("num_iterations", 1), **common)
        trainer_cls = FusedGRPOTrainer if case.get("fused") else GRPOTrainer
        if world() == 1 and replicas > 1:
            trainer_cls = replica_seeded(trainer_cls, replicas)
        trainer = trainer_cls(args=config, **kwargs)
    else:
        from trl import RLOOConfig, RLOOTrainer

        if case.get("fused"):
            from hf_fused import apply_fused_loss

            apply_fused_loss(model)
        trainer = RLOOTrainer(args=RLOOConfig(**common), **kwargs)
    generated, generate = [], trainer._generate

    def recorded(prompts):
        output = generate(prompts)
        generated.append([list(ids) for ids in output[1]])
        return output

    trainer._generate = recorded
    layouts = record_head_layouts()
    head_calls = count_fused_head_calls()
    trainer.train()
    replica_count, completions, agree = 1, generated, True
    if world() > 1:
        from hf_fused.integrations.trl.tensor_parallel import DataParallelLayout

        layout = DataParallelLayout.of(trainer.accelerator)
        everyone = [None] * world()
        dist.all_gather_object(everyone, (layout.index, generated))
        leaders = [everyone[rank][1] for rank in layout.leaders]
        agree = all(mine == leaders[index] for index, mine in everyone)
        completions = [sum((replica[k] for replica in leaders), []) for k in range(len(generated))]
        replica_count = layout.size
    logs = [{k: v for k, v in entry.items() if not _is_timing(k)} for entry in trainer.state.log_history]
    return {"losses": [e["loss"] for e in logs if "loss" in e], "logs": logs, "initial": initial,
            "params": full_parameters(trainer.model), "head_calls": head_calls["all"], "head_reads": len(layouts),
            "head_layouts": sorted(set(layouts)), "completions": completions, "completions_agree": agree,
            "replicas": replica_count, "generation_batch_size": trainer.args.generation_batch_size,
            "wrapper": type(trainer.model_wrapped).__name__}


def rollouts_refused(case: dict, out: str) -> dict:
    """``FusedGRPOTrainer`` on the tensor-parallel model with ``use_transformers_continuous_batching=True`` (not
    verified under tensor parallelism), built on the scripted rollouts of tests/grpo_harness.py: the message it
    raised, or ``None``."""
    import grpo_harness
    from pathlib import Path

    from hf_fused import FusedGRPOTrainer

    allow_parallelism_config_on_cpu_ranks()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    overrides = dict(max_steps=1, per_device_train_batch_size=4, num_generations=4, beta=0.0, save_strategy="no",
                     use_transformers_continuous_batching=True)
    try:
        grpo_harness.build_trainer(FusedGRPOTrainer, grpo_harness.Case(config=overrides), Path(os.path.dirname(out)),
                                   model=load(case, tensor_parallel=True))
    except NotImplementedError as e:
        return {"error": str(e)}
    return {"error": None}


def benchmark(case: dict, out: str) -> dict:
    """:mod:`benchmarks.tensor_parallel_model`'s ``main`` on these ranks (the launch's process group): a one-layer
    Qwen3-shaped model (hidden 64, 4 heads of 16, vocabulary 131), fp32, 2 × 16 tokens, one timed step."""
    import contextlib
    import io

    from benchmarks import tensor_parallel_model

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tensor_parallel_model.main(["--layers", "1", "--batch", "2", "--seq-len", "16", "--vocab", "131", "--hidden",
                                    "64", "--heads", "4", "--head-dim", "16", "--intermediate", "128", "--repeats",
                                    "1", "--dtype", "fp32", "--model-dir", os.path.join(os.path.dirname(out), "model")])
    return {"printed": printed.getvalue()}


KINDS = {"trainer": train, "colwise": colwise, "lora_refused": lora_refused, "layouts": layouts,
         "fsdp_shard_refused": fsdp_shard_refused, "trl": trl_trainer, "rollouts": rollouts,
         "rollouts_refused": rollouts_refused, "benchmark": benchmark}


def main(batch_file: str) -> None:
    torch.set_num_threads(1)
    if "RANK" in os.environ and not dist.is_initialized():
        init_process_group()  # gloo, or NCCL on this rank's GPU (ranks.py)
    else:
        rank_device()  # one plain process: under HF_FUSED_TEST_DEVICE=cuda the first GPU made current

    def run(case: dict, directory: str) -> None:
        out = os.path.join(directory, "result.pt")
        result = KINDS[case["kind"]](case, out)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save({**result, "world": world()}, out)

    run_each(batch_file, run, barrier=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
