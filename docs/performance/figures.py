"""Draw the plots of docs/performance.md and the README's memory figure from the measured data beside them.

``python docs/performance/figures.py`` (needs matplotlib) rewrites ``h200/memory.png``, ``h200/ce.png`` and
``h200/grpo.png`` from ``h200/*.json``: nothing in a plot is typed in by hand, every value is read from the
benchmark's own output of the run the performance page cites.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
GIB = 2**30
#: The peers of the kernel benchmark in the order the tables use, with the names the page gives them.
PEERS = {
    "trl": "TRL 1.16",
    "liger": "Liger FLCE",
    "cce": "CCE",
    "quack": "QuACK",
    "hf_fused": "hf_fused",
    "hf_fused_hint": "hf_fused, FusedGRPOTrainer",
    "hf_fused_lean": "hf_fused lean (256 MiB)",
}
COLORS = {"trl": "#8c8c8c", "liger": "#d62728", "cce": "#9467bd", "quack": "#ff7f0e", "hf_fused": "#1f77b4",
          "hf_fused_hint": "#17becf", "hf_fused_lean": "#aec7e8"}


def _load(name: str) -> dict:
    return json.loads((HERE / "h200" / name).read_text())


def _sft_runs(doc: dict) -> dict[tuple[str, int], dict]:
    return {(r["variant"], r["seq_len"]): r for r in doc["sft"]["runs"]}


def memory_figure(path: Path) -> None:
    """Left: peak memory of a training step against tokens per step, unpatched against ``apply_fused_loss``.
    Right: memory and time of the loss alone (forward + backward) at 32768 tokens, every peer."""
    runs = {**_sft_runs(_load("e2e_sft_qwen3.json")), **_sft_runs(_load("e2e_long_context.json"))}
    lengths = sorted({n for _, n in runs})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.7), gridspec_kw={"width_ratios": [1.1, 1]})
    capacity = 139.8  # the H200's memory as torch reports it (the OOM message in e2e_long_context.txt)
    for variant, label, color, dy in (("plain", "transformers (unpatched)", COLORS["trl"], 6),
                                      ("hf_fused", "apply_fused_loss", COLORS["hf_fused"], -13)):
        points = [(n, runs[(variant, n)]) for n in lengths if (variant, n) in runs]
        ok = [(n, r["peak_gib"]) for n, r in points if r["status"] == "ok"]
        left.plot([n for n, _ in ok], [g for _, g in ok], marker="o", color=color, label=label)
        for n, g in ok:
            left.annotate(f"{g:.1f}", (n, g), textcoords="offset points", xytext=(0, dy), ha="center", fontsize=8,
                          color=color)
        for n, r in points:
            if r["status"] == "OOM":
                left.scatter([n], [capacity], marker="x", color=color, s=60, zorder=3)
                left.plot([ok[-1][0], n], [ok[-1][1], capacity], ls="--", color=color)
                left.annotate("out of memory", (n, capacity), textcoords="offset points", xytext=(0, -14),
                              ha="center", fontsize=8, color=color)
    left.axhline(capacity, color="black", lw=0.6, ls=":")
    left.set_xscale("log", base=2)
    left.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    left.set_ylim(0, capacity * 1.08)
    left.set_xlabel("tokens per step (one sequence)")
    left.set_ylabel("peak GiB of a training step")
    left.set_title("Qwen3-1.7B shape, Trainer, bf16", fontsize=10)
    left.legend(fontsize=8, loc="center left")

    doc = _load("ce.json")
    rows = [r for r in doc["results"] if r["problem"] == "ce-32k-h2048-v152k" and r["peer"] in PEERS]
    rows.sort(key=lambda r: list(PEERS).index(r["peer"]))
    ys = range(len(rows))
    right.barh(list(ys), [r["peak_mem_bytes"] / GIB for r in rows], color=[COLORS[r["peer"]] for r in rows])
    for y, r in zip(ys, rows):
        right.annotate(f"{r['peak_mem_bytes'] / GIB:.2f} GiB, {r['time_ms']:.0f} ms", (r["peak_mem_bytes"] / GIB, y),
                       textcoords="offset points", xytext=(3, -3), fontsize=8)
    right.set_yticks(list(ys), [PEERS[r["peer"]] for r in rows], fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, 2.8)
    right.set_xlabel("GiB above inputs and gradients")
    right.set_title("the loss alone, 32768×2048×151936, fwd+bwd", fontsize=10)
    fig.suptitle(f"{doc['runs'][0]['device']}, {doc['runs'][0]['started'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def kernel_figure(name: str, path: Path) -> None:
    """Time and memory per peer for each problem of one kernel-benchmark run (grouped bars)."""
    doc = _load(name)
    problems = list(doc["problems"])
    peers = [p for p in PEERS if any(r["peer"] == p for r in doc["results"])]
    cell = {(r["problem"], r["peer"]): r for r in doc["results"] if r["status"] == "ok"}
    grpo = doc["problems"][problems[0]]["kind"] == "grpo"
    names = {**PEERS, "hf_fused": "hf_fused log-probs, no hint"} if grpo else PEERS
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(peers)
    for j, peer in enumerate(peers):
        xs = [i + (j - (len(peers) - 1) / 2) * width for i in range(len(problems))]
        got = [cell.get((p, peer)) for p in problems]
        for ax, value in ((axes[0], lambda r: r["time_ms"]), (axes[1], lambda r: r["peak_mem_bytes"] / GIB)):
            ax.bar([x for x, r in zip(xs, got) if r], [value(r) for r in got if r], width,
                   color=COLORS[peer], label=names[peer])
    labels = [doc["problems"][p]["description"].split(" = ")[-1].replace("×151936", "×152k").replace("×128256", "×128k")
              for p in problems]
    labels = [lab.replace("×", "×\n", 1) + ("\noff-policy + KL" if "offpolicy" in p else "") for lab, p in zip(labels, problems)]
    for ax, ylabel in ((axes[0], "median ms, forward + backward"), (axes[1], "GiB above inputs and gradients")):
        ax.set_xticks(range(len(problems)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, ncol=len(peers), loc="lower center")
    kind = "GRPO (DAPO loss)" if grpo else "cross-entropy"
    fig.suptitle(f"{kind}, bf16, {doc['runs'][0]['device']}, {doc['runs'][0]['started'][:10]}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def median_tokens_per_s(run: dict) -> float:
    """The e2e tables' metric: tokens of one step over the median step time."""
    return run["seq_len"] / statistics.median(run["step_s"])


def main() -> None:
    memory_figure(HERE / "h200" / "memory.png")
    kernel_figure("ce.json", HERE / "h200" / "ce.png")
    kernel_figure("grpo.json", HERE / "h200" / "grpo.png")


if __name__ == "__main__":
    main()
