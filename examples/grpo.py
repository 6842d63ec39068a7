"""GRPO demo: reinforcement learning end to end on CPU with ``hf_fused.FusedGRPOTrainer``, next to
``trl.GRPOTrainer`` on the same configuration.

``python -m examples grpo [--steps N] [--num-generations G] [--prompts-per-step P] [--num-prompts K]
[--max-completion-length C] [--lr LR] [--beta B] [--num-iterations I] [--seed S] [--plot PATH] [--model PATH]
[--trainers fused,trl]``

1. Model: a small random Qwen3 (2 layers, hidden 128, real Qwen vocabulary of 151,936 rows) with the
   real Qwen tokenizer (``examples.tokenizer``), or a local HF checkpoint given by ``--model``.
2. Prompts: ``--num-prompts`` windows of ``--prompt-tokens`` tokens cut from CPython's pydoc help topics
   (``examples.text``), cycled over the steps.
3. Completions are sampled with transformers' ``generate`` (TRL's own generation path, no vLLM). Every
   log-probability and entropy of the policy, the old policy and the reference model is computed by
   hf_fused inside the model's forward: no ``[tokens, 151,936]`` logits tensor exists in a training step.
4. Reward (verifiable, no model): :func:`word_piece_reward`, the fraction of completion tokens that are
   *distinct* plain English word pieces, i.e. decode to ``' ?[A-Za-z]+'`` (``" the"``, ``"ing"``,
   ``" Python"``) and were not used earlier in the same completion (repeating one word does not pay).

Why a tiny random model can learn this reward:

* Signal from the first step. 45% of Qwen's vocabulary is word pieces, so random completions already
  score about 0.45, with a binomial spread inside each group of ``G`` completions: GRPO's group-relative
  advantages are non-zero at once. (A reward a random policy almost never earns, "answer 42", would give
  equal rewards within every group and no gradient at all.)
* Contexts that come back. A policy improves the contexts it visits. The model is random but shaped
  like a trained LM: lm_head std 0.6 gives a next-token entropy of about 2 nats (a handful of likely
  tokens per context) instead of the uniform 11.9 nats of a default init, and only ``--num-prompts`` 4
  prompts are cycled, so the same prompts and prefixes recur every few steps and GRPO re-ranks their few
  candidates toward word pieces. With a near-uniform model (default init) each context offers ~10^5
  candidates and sampled tokens practically never recur; nothing learned transfers and the reward stays
  flat (measured: 40 steps, no trend), because random lm_head rows share no direction that "word pieces"
  could be learned along.
* Stable steps. Input embeddings of std 1.0 (not 0.02) keep Adam's ``lr·sign(g)`` steps small relative to
  the weights they move; with 0.02 one step at lr 3e-3 moves the policy by several nats (KL) and it
  collapses onto one repeated token.

The defaults are TRL's own (``beta=0``, ``num_iterations=1``: on-policy, no reference model), so each
step is one generation and one forward+backward; ``FusedGRPOTrainer`` then takes its one-pass path (the
log-probs' gradient is known before the forward). On-policy with ``beta=0`` the loss *value* is ≈0 at every
step by construction (the probability ratio is 1 and the advantages are centred within each group); its
gradient is not, so each step's line shows the gradient norm instead, next to the reward and the entropy (the
loss, the KL and the clipped fraction are shown when ``--beta`` or ``--num-iterations`` make them move). The
reward rises from ≈0.45 to ≈0.7 within 12 steps while the entropy falls as the policy commits to one
continuation per prompt. ``--beta 0.04 --num-iterations 2`` adds a KL term to the initial model and an
off-policy step that clips.

Time, measured on a 2-core x86 CPU (2026-11-29) for the default run (12 steps, both trainers): 96 s of CPU
time with ``OMP_NUM_THREADS=1``; ``make demo-grpo`` took 1.3 minutes of wall time with about one core's worth
of other work running, 5.6 minutes while other jobs loaded the machine several times over. Most of it is TRL's
trainer (2-3x hf_fused's step time here: on CPU its head scores every prompt and completion position and
recomputes them in backward); ``--trainers fused`` runs hf_fused alone.

Each trainer in ``--trainers`` (default both, hf_fused first) trains a fresh copy of the same model with
the same seed, so step 1 samples the same completions and gets the same reward; later steps drift apart
only through rounding. Logs reward, gradient norm and entropy at every step under a progress bar, prints the
two runs side by side (reward, seconds per step, peak tensor memory of the last step, counted op by op
by :func:`benchmarks.measure.track_peak_memory`) and saves a PNG of the reward curves (``--plot``,
default ``grpo_reward.png``).

Exit status: 0 when hf_fused's mean reward of the last quarter of the steps is above that of the first
quarter.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import tempfile
import time
import warnings

import torch

#: ``--trainers`` keys, in the order they run and are shown.
TRAINERS = {"fused": "hf_fused FusedGRPOTrainer", "trl": "trl GRPOTrainer"}

__all__ = ["WORD_PIECE", "word_piece_reward", "build_prompts", "parse_args", "on_policy_note", "step_line", "main"]

#: A plain English word piece: optional leading space, then ASCII letters only.
WORD_PIECE = re.compile(r" ?[A-Za-z]+")


def word_piece_reward(completions, completion_ids, *, tokenizer, **kwargs) -> list[float]:
    """Fraction of each completion's tokens that decode to :data:`WORD_PIECE` and are not a repeat of an
    earlier token of the same completion (so repeating one word scores ``1 / length``, not 1). An eos
    token is not counted. Empty completions score 0."""
    eos = tokenizer.eos_token_id
    rewards = []
    for ids in completion_ids:
        ids = [i for i in ids if i != eos]
        if not ids:
            rewards.append(0.0)
            continue
        pieces = tokenizer.batch_decode([[i] for i in ids])
        good = {i for i, p in zip(ids, pieces) if WORD_PIECE.fullmatch(p)}
        rewards.append(len(good) / len(ids))
    return rewards


def build_prompts(tokenizer, prompt_tokens: int, num_prompts: int) -> list[str]:
    """``num_prompts`` prompts of ``prompt_tokens`` tokens: consecutive windows of the pydoc help topics
    (topic by topic, several windows per topic), decoded back to text."""
    from .text import pydoc_documents

    prompts = []
    for doc in pydoc_documents():
        ids = tokenizer(doc, add_special_tokens=False).input_ids
        for start in range(0, len(ids) - prompt_tokens + 1, prompt_tokens * 4):
            prompts.append(tokenizer.decode(ids[start : start + prompt_tokens]))
            if len(prompts) == num_prompts:
                return prompts
    if not prompts:
        raise ValueError(f"no pydoc topic has {prompt_tokens} tokens")
    return prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples grpo",
        description="GRPO on CPU with hf_fused.FusedGRPOTrainer: a tiny Qwen3 learns to write English word pieces.",
    )
    p.add_argument("--model", metavar="PATH", help="local HF checkpoint dir (default: a small random Qwen3)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    p.add_argument("--trainers", default="fused,trl",
                   help="comma-separated, from: fused (hf_fused.FusedGRPOTrainer), trl (trl.GRPOTrainer); default both")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt, G (default 8)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompts per step (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=24, help="tokens per prompt (default 24)")
    p.add_argument("--num-prompts", type=int, default=4, help="distinct prompts, cycled over the steps (default 4)")
    p.add_argument("--max-completion-length", type=int, default=16, help="tokens per completion (default 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the initial model (default 0, TRL's)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the top-k tokens only (default 0 = off)")
    p.add_argument("--head-std", type=float, default=0.6,
                   help="init std of the random model's lm_head (default 0.6: next-token entropy ~2 nats)")
    p.add_argument("--embed-std", type=float, default=1.0,
                   help="init std of the random model's input embeddings (default 1.0)")
    p.add_argument("--num-iterations", type=int, default=1,
                   help="optimizer steps per generated batch (default 1, TRL's; with 2 the second one is off-policy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="grpo_reward.png", help="where to save the reward curve (PNG)")
    args = p.parse_args(argv)
    for name in ("steps", "prompts_per_step", "prompt_tokens", "max_completion_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_generations < 2:
        p.error("--num-generations must be >= 2 (GRPO compares completions within a group)")
    args.trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    unknown = [t for t in args.trainers if t not in TRAINERS]
    if unknown or not args.trainers or "fused" not in args.trainers:
        p.error(f"--trainers takes a comma-separated subset of {', '.join(TRAINERS)} that includes fused; "
                f"got {unknown or args.trainers}")
    return args


def on_policy_note(args: argparse.Namespace) -> str:
    """What the per-step line leaves out and why: on-policy with beta 0 the loss value is ≈0 by construction and
    no KL is computed; empty when ``--beta`` or ``--num-iterations`` make those move."""
    if args.beta or args.num_iterations > 1:
        return ""
    return ("on-policy with beta 0 (TRL's defaults): the loss value is ≈0 at every step by construction (probability "
            "ratio 1, advantages centred within each group) and no KL term is computed; the gradient is not 0, so each "
            "step shows its norm (before clipping to 1)")


def step_line(step: int, m: dict, args: argparse.Namespace) -> str:
    """One step's metrics on one line: reward, gradient norm and entropy always; the loss, KL and clipped fraction
    only when they can differ from 0 (``--beta`` for the KL, ``--num-iterations`` > 1 for clipping)."""
    line = f"step {step:>4}  reward {m['reward']:.3f} ± {m['reward_std']:.3f}  grad norm {m['grad_norm']:.3f}"
    if args.beta or args.num_iterations > 1:
        line += f"  loss {m['loss']:+.4f}"
    if args.beta:
        line += f"  kl {m['kl']:.4f}"
    if args.num_iterations > 1:
        line += f"  clip {m['clip']:.3f}"
    return line + f"  entropy {m['entropy']:.3f}"


def _progress_callback(run_args: argparse.Namespace):
    """Trainer's tqdm bar with the GRPO metrics in the bar and one line per step above it."""
    from transformers.trainer_callback import ProgressCallback

    class GRPOProgress(ProgressCallback):
        last_reward: dict = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs or "loss" not in logs:
                return
            if "reward" in logs:  # logged on generation steps only; carried over to the reuse steps
                self.last_reward = {"reward": logs["reward"], "reward_std": logs.get("reward_std", math.nan)}
            m = _step_metrics({**self.last_reward, **logs})
            self.training_bar.set_postfix(reward=f"{m['reward']:.3f}", grad_norm=f"{m['grad_norm']:.3f}")
            self.training_bar.write(step_line(state.global_step, m, run_args))

    return GRPOProgress


def _history(log_history: list[dict]) -> list[dict]:
    """One metrics dict per optimizer step. Reward is logged only on steps that generate (with
    ``num_iterations`` > 1 the next steps reuse the batch): carry it forward to those steps."""
    history, last = [], {}
    for entry in log_history:
        if "loss" not in entry:
            continue
        if "reward" in entry:
            last = {"reward": entry["reward"], "reward_std": entry.get("reward_std", math.nan)}
        history.append(_step_metrics({**last, **entry}))
    return history


def _step_metrics(logs: dict) -> dict:
    return {
        "reward": logs.get("reward", math.nan),
        "reward_std": logs.get("reward_std", math.nan),
        "loss": logs.get("loss", math.nan),
        "grad_norm": logs.get("grad_norm", math.nan),
        "kl": logs.get("kl", math.nan),
        "clip": logs.get("clip_ratio/region_mean", math.nan),
        "entropy": logs.get("entropy", math.nan),
    }


def save_reward_plot(histories: dict[str, list[dict]], path: str, title: str) -> None:
    """Reward (mean ± std over the step's completions) and entropy per step, one line per trainer, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    for key, history in histories.items():
        steps = list(range(1, len(history) + 1))
        reward = [h["reward"] for h in history]
        std = [h["reward_std"] for h in history]
        style = dict(linestyle="-" if key == "fused" else "--", marker="o" if key == "fused" else "x", ms=3)
        line, = ax1.plot(steps, reward, label=TRAINERS[key], **style)
        ax1.fill_between(steps, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)],
                         alpha=0.12, color=line.get_color())
        ax2.plot(steps, [h["entropy"] for h in history], color=line.get_color(), label=TRAINERS[key], **style)
    ax1.set_ylabel("reward (word-piece fraction)")
    ax1.set_title(title)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    ax2.set_ylabel("entropy (nats)")
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _last_step_memory_callback(last_step: int):
    """A TrainerCallback counting the peak tensor bytes of optimizer step ``last_step`` (generation,
    log-probs, loss, backward and optimizer step) with :func:`benchmarks.measure.track_peak_memory`: on CPU
    every aten op's new storages are tallied, which slows that one step down, so only one is measured."""
    from transformers import TrainerCallback

    from benchmarks.measure import track_peak_memory

    class LastStepMemory(TrainerCallback):
        peak_bytes = None

        def __init__(self):
            self._stack = contextlib.ExitStack()
            self._report = None
            self.step_seconds: list[float] = []  # of the steps not counted

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()
            if state.global_step + 1 == last_step:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                # Python's cyclic collector would free some tensors at moments that differ from run to run: keep
                # it out of the measured step, so the figure is the same on every run.
                gc.collect()
                gc.disable()
                self._stack.callback(gc.enable)
                self._report = self._stack.enter_context(track_peak_memory(device))

        def on_step_end(self, args, state, control, **kwargs):
            if self._report is not None:
                self._stack.close()
                self.peak_bytes, self._report = self._report.peak_bytes, None
            else:
                self.step_seconds.append(time.perf_counter() - self._t0)

    return LastStepMemory()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status (0 = hf_fused's reward went up)."""
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    with tempfile.TemporaryDirectory(prefix="hf_fused_grpo_") as workdir:  # reference weights, trainer output
        return _run(args, workdir)


def _build_model(args: argparse.Namespace, tokenizer, workdir: str):
    """The policy, the same for every call with the same seed; ``(model, name)``."""
    import transformers

    from .model import tiny_qwen3_config

    transformers.set_seed(args.seed)
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), args.model
    model = transformers.Qwen3ForCausalLM(tiny_qwen3_config(tokenizer, tie_word_embeddings=False, max_position_embeddings=1024))
    with torch.no_grad():  # see the module docstring: a peaked random model
        model.lm_head.weight.normal_(0.0, args.head_std)
        model.get_input_embeddings().weight.normal_(0.0, args.embed_std)
    if args.beta:
        # TRL builds the reference model from config._name_or_path: give it the initial weights.
        init = os.path.join(workdir, "init")
        if not os.path.isdir(init):
            model.save_pretrained(init)
        model.config._name_or_path = init
    return model, "random Qwen3 (2 layers, hidden 128)"


def _train(key: str, args: argparse.Namespace, tokenizer, prompts: list[str], workdir: str) -> dict:
    """Train one trainer kind from a fresh model; its per-step history, seconds, last-step memory, a sample."""
    import transformers
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from hf_fused import FusedGRPOTrainer

    model, name = _build_model(args, tokenizer, workdir)

    def reward(completions, completion_ids, **kwargs):
        return word_piece_reward(completions, completion_ids, tokenizer=tokenizer)

    reward.__name__ = "word_pieces"
    config = GRPOConfig(
        output_dir=os.path.join(workdir, f"out_{key}"),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=args.beta,
        num_iterations=args.num_iterations,
        loss_type="dapo",
        bf16=False,  # fp32 on CPU (GRPOConfig's default bf16=True would autocast here); use bf16 on a GPU
        use_vllm=False,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    cls = FusedGRPOTrainer if key == "fused" else GRPOTrainer
    memory = _last_step_memory_callback(args.steps)
    trainer = cls(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                  processing_class=tokenizer, callbacks=[memory])
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_progress_callback(args))
    print(f"\n{TRAINERS[key]}: {args.steps} steps x {args.prompts_per_step} prompts x {args.num_generations} "
          f"completions of <= {args.max_completion_length} tokens, {name}")
    transformers.set_seed(args.seed)  # the same sampling for every trainer
    trainer.train()
    sample = trainer._logs["completion"][-1] if trainer._logs["completion"] else ""
    steps = sorted(memory.step_seconds)
    return {"history": _history(trainer.state.log_history), "step_s": steps[len(steps) // 2] if steps else math.nan,
            "peak_bytes": memory.peak_bytes, "sample": sample, "name": name}


def _run(args: argparse.Namespace, workdir: str) -> int:
    import transformers

    from .tokenizer import build_qwen_tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model) if args.model else build_qwen_tokenizer()
    tokenizer.padding_side = "left"
    prompts = build_prompts(tokenizer, args.prompt_tokens, args.num_prompts)
    print(f"data: {len(prompts)} prompts of {args.prompt_tokens} tokens from the pydoc help topics, e.g. "
          f"{prompts[0][:70]!r}...\nreward: fraction of distinct English word pieces in a completion")
    if on_policy_note(args):
        print(on_policy_note(args))

    runs = {key: _train(key, args, tokenizer, prompts, workdir) for key in args.trainers}

    keys = list(runs)
    n = min(len(r["history"]) for r in runs.values())
    print("\n" + f"{'step':>4}" + "".join(f"  {'reward ' + k:>13}" for k in keys)
          + "".join(f"  {'entropy ' + k:>14}" for k in keys))
    for i in range(n):
        print(f"{i + 1:>4}" + "".join(f"  {runs[k]['history'][i]['reward']:>13.3f}" for k in keys)
              + "".join(f"  {runs[k]['history'][i]['entropy']:>14.3f}" for k in keys))
    quarter = max(1, n // 4)
    mean = lambda hist: sum(h["reward"] for h in hist) / len(hist)  # noqa: E731
    print(f"\n{'trainer':<26}{'median s/step':>14}{'peak MiB, last step':>21}{'reward first→last quarter':>28}")
    for k in keys:
        r = runs[k]
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        print(f"{TRAINERS[k]:<26}{r['step_s']:>14.2f}{peak:>21}"
              f"{mean(r['history'][:quarter]):>17.3f} → {mean(r['history'][-quarter:]):.3f}")
    print("(peak MiB: tensors held during the last step, generation + log-probs + loss + backward + optimizer, "
          "counted op by op on CPU, the same on every run; that step is left out of the median time, which "
          "depends on the machine and its load.)")
    if "trl" in runs and runs["trl"]["peak_bytes"] and runs["fused"]["peak_bytes"]:
        print(f"peak memory of the last step, TRL / hf_fused: "
              f"{runs['trl']['peak_bytes'] / runs['fused']['peak_bytes']:.2f}x")

    save_reward_plot({k: r["history"] for k, r in runs.items()}, args.plot,
                     f"GRPO on {runs['fused']['name']}: hf_fused vs TRL")
    print(f"reward curves saved to {os.path.abspath(args.plot)}")
    print(f"last sampled completion (hf_fused): {runs['fused']['sample']!r}")

    fused = runs["fused"]["history"]
    first, last = mean(fused[:quarter]), mean(fused[-quarter:])
    if last > first:
        print(f"\nOK: hf_fused mean reward {first:.3f} (first {quarter} steps) -> {last:.3f} (last {quarter} steps)")
        return 0
    print(f"\nFAIL: hf_fused mean reward did not improve: {first:.3f} (first {quarter} steps) -> {last:.3f} "
          f"(last {quarter})")
    return 1
