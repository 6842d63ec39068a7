"""Turn the results document into a text table (printed and ``bench.txt``) and a plot (``bench.png``).

``python -m benchmarks.report DIR`` re-renders both from ``DIR/bench.json`` (e.g. after several
``--resume`` runs filled it in).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from .peers import ALL_PEERS

_ORDER = {cls.key: i for i, cls in enumerate(ALL_PEERS)}
GIB = 2**30


def _records(doc: dict) -> dict[str, list[dict]]:
    """Latest record per (problem, peer), grouped by problem in first-seen order, peers in table order."""
    latest: dict[tuple[str, str], dict] = {}
    for r in doc["results"]:
        latest[(r["problem"], r["peer"])] = r
    by_problem: dict[str, list[dict]] = {}
    for name in doc["problems"]:
        rows = [r for (p, _), r in latest.items() if p == name]
        if rows:
            by_problem[name] = sorted(rows, key=lambda r: _ORDER.get(r["peer"], 99))
    return by_problem


def _e(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.1e}"


def _f(x: Optional[float], fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _bytes(b: Optional[int]) -> str:
    """GiB with two decimals from 0.1 GiB up, MiB below (CPU smoke shapes are kilobytes to megabytes)."""
    if b is None:
        return "—"
    return f"{b / GIB:.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:.2f} MiB"


def _mem(r: dict) -> str:
    return _bytes(r.get("peak_mem_bytes"))


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    mem = r.get("peak_mem_bytes")
    return f"{r['time_ms']:.1f} ms" + ("" if mem is None else f" / {_bytes(mem)}")


def text_table(header: list[str], rows: list[list[str]], align_left: int = 1) -> list[str]:
    """Lines of a plain-text table: a header, a rule, the rows; the first ``align_left`` columns left-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < align_left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return [fmt_row(header), "  ".join("-" * w for w in widths), *map(fmt_row, rows)]


def render_table(doc: dict) -> str:
    """The side-by-side summary (peers × problems: median time / peak memory) and one detail table per
    problem, plus notes for the peers that did not run."""
    groups = _records(doc)
    lines: list[str] = []
    used = sorted({r.get("run", 0) for r in doc["results"]}) or list(range(len(doc["runs"])))
    for i in used:
        run = doc["runs"][i]
        c = run.get("matmul_ceiling")
        tag = f"run {i}: " if len(used) > 1 else ""
        lines += [
            f"{tag}device: {run['device']}   dtype: {run['dtype']}"
            + (f"   autocast: {run['autocast']}" if run.get("autocast") else "")
            + f"   timer: {run['timer']}   repeats: {run['repeats']}",
            f"{tag}matmul ceiling: " + (f"{c['tflops']:.4g} TFLOP/s ({c['dtype']} {c['n']}³ median {c['ms']:.3f} ms)"
                                        if c else "none (measured on CUDA only; CPU times are not compared to one)"),
            f"{tag}versions: " + ", ".join(f"{k} {v}" for k, v in run["versions"].items() if v),
        ]
    with_ceiling = any(r.get("frac_of_ceiling") is not None for r in doc["results"])
    if doc["runs"]:
        lines += [
            "FLOPs: " + doc["runs"][-1]["flop_convention"],
            "memory: peak above inputs + gradients (see bench.json runs[].memory_baseline)",
            *(["% ceil: achieved TFLOP/s / the matmul ceiling measured in the same run"] if with_ceiling else []),
            "errors: ‖x − x_ref‖/‖x_ref‖ against the float64 reference (loss: |Δ|/|ref|; logp/entropy over "
            "unmasked tokens)",
            "",
        ]
    # Summary: peers × problems.
    problems = list(groups)
    peers = sorted({r["peer"] for rows in groups.values() for r in rows}, key=lambda k: _ORDER.get(k, 99))
    labels = {r["peer"]: r["label"] for rows in groups.values() for r in rows}
    cells = {(r["problem"], r["peer"]): r for rows in groups.values() for r in rows}
    if problems:
        lines.append("median fwd+bwd time / peak memory above inputs+grads")
        body = [[labels[k], *(_cell(cells.get((p, k))) for p in problems)] for k in peers]
        lines += text_table(["peer", *problems], body)
        lines.append("")
    notes: dict[str, set[str]] = {}
    for name, rows in groups.items():
        info = doc["problems"][name]
        ref = info.get("reference_loss")
        ref_text = (f"float64 loss {ref:.6f} ({info['reference_seconds']:.1f} s)" if ref is not None
                    else info.get("reference", "—"))
        lines.append(f"{name}: {info['description']}, {info['n_valid']} non-ignored tokens, reference {ref_text}")
        grpo = info["kind"] == "grpo"
        header = ["peer", "time ms", "TFLOP/s", *(["% ceil"] if with_ceiling else []), "peak mem", "loss err",
                  "dX err", "dW err"]
        if grpo:
            header += ["logp err", "entropy err"]
        header.append("status")
        rows_out = []
        for r in rows:
            ok = r["status"] == "ok"
            row = [
                r["label"], _f(r.get("time_ms"), ".2f"), _f(r.get("tflops"), ".3g"),
                *([_f(None if r.get("frac_of_ceiling") is None else 100 * r["frac_of_ceiling"], ".0f")]
                  if with_ceiling else []),
                _mem(r), _e(r.get("loss_rel_err")), _e(r.get("grad_hidden_rel_err")), _e(r.get("grad_weight_rel_err")),
            ]
            if grpo:
                ent = _e(r.get("entropy_rel_err")) if r.get("has_entropy") else ("n/a" if ok else "—")
                logp = _e(r.get("logp_rel_err")) if ok and r.get("logp_rel_err") is not None else ("n/a" if ok else "—")
                row += [logp, ent]
            status = r["status"] + (f" [{r['backend']}]" if r.get("backend") else "")
            row.append(status)
            rows_out.append(row)
            if not ok and r.get("note"):
                note = r["note"] if r["status"] != "n/a" else f"{r['note']} ({name})"
                notes.setdefault(f"{r['label']}: {r['status']}", set()).add(note)
        lines += text_table(header, rows_out)
        lines.append("")
    if notes:
        lines.append("notes:")
        for key, texts in notes.items():
            for t in sorted(texts):
                lines.append(f"  {key} — {t}")
    return "\n".join(lines).rstrip() + "\n"


def render_plot(doc: dict, path: Path) -> Optional[Path]:
    """Median time and peak memory per peer, one row of panels per problem kind; x = problems ordered
    by token count (labelled with tokens, H and V). Returns ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = _records(doc)
    kinds = [k for k in ("ce", "grpo") if any(doc["problems"][p]["kind"] == k for p in groups)]
    if not kinds:
        return None
    fig, axes = plt.subplots(len(kinds), 2, figsize=(13, 4.6 * len(kinds)), squeeze=False)
    titles = {"ce": "cross-entropy fwd+bwd", "grpo": "GRPO (log-probs + DAPO) fwd+bwd"}
    for row, kind in enumerate(kinds):
        names = sorted((p for p in groups if doc["problems"][p]["kind"] == kind),
                       key=lambda p: (doc["problems"][p]["N"], doc["problems"][p]["H"] * doc["problems"][p]["V"]))
        xs = {p: i for i, p in enumerate(names)}
        peers = sorted({r["peer"] for p in names for r in groups[p]}, key=lambda k: _ORDER.get(k, 99))
        ax_t, ax_m = axes[row]
        any_mem = False
        for j, peer in enumerate(peers):
            recs = [r for p in names for r in groups[p] if r["peer"] == peer]
            ok = [r for r in recs if r["status"] == "ok"]
            label = recs[0]["label"]
            style = dict(marker="os^vD<>ph*"[j % 10], linestyle="-" if "hf_fused" in peer else "--", label=label)
            if ok:
                ax_t.plot([xs[r["problem"]] for r in ok], [r["time_ms"] for r in ok], **style)
                mem = [r for r in ok if r.get("peak_mem_bytes") is not None]
                if mem:
                    any_mem = True
                    ax_m.plot([xs[r["problem"]] for r in mem], [max(r["peak_mem_bytes"], 1) / GIB for r in mem], **style)
            for r in recs:
                if r["status"] == "OOM":
                    for ax in (ax_t, ax_m):
                        ax.annotate(f"OOM: {label}", (xs[r["problem"]], 0.98 - 0.05 * j),
                                    xycoords=("data", "axes fraction"), ha="center", va="top", fontsize=7, color="red")
        for ax, ylabel in ((ax_t, "median time [ms]"), (ax_m, "peak memory above inputs+grads [GiB]")):
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels([f"{doc['problems'][p]['N']} tok\nH{doc['problems'][p]['H']} V{doc['problems'][p]['V']}"
                                for p in names], fontsize=8)
            ax.set_xlabel("tokens (problem)")
            ax.set_ylabel(ylabel)
            ax.set_title(titles[kind])
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.set_yscale("log")
        if not any_mem:
            ax_m.text(0.5, 0.5, "memory not measured on this device", ha="center", va="center",
                      transform=ax_m.transAxes)
        if ax_t.lines:
            ax_t.legend(fontsize=8)
    run = doc["runs"][-1] if doc["runs"] else {}
    if run:
        c = run.get("matmul_ceiling")
        autocast = f" under {run['autocast']} autocast" if run.get("autocast") else ""
        ceiling = f"; matmul ceiling {c['tflops']:.4g} TFLOP/s" if c else ""
        fig.suptitle(f"{run['device']}, {run['dtype']}{autocast}{ceiling}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(doc: dict, out_dir: Path) -> dict[str, Path]:
    """Write ``bench.txt`` and ``bench.png`` next to ``bench.json``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = render_table(doc)
    (out_dir / "bench.txt").write_text(text)
    paths = {"json": out_dir / "bench.json", "table": out_dir / "bench.txt"}
    png = render_plot(doc, out_dir / "bench.png")
    if png is not None:
        paths["plot"] = png
    return paths


def merge_docs(docs: list[dict]) -> dict:
    """One document from several runs (e.g. ``--shapes ce`` and ``--shapes grpo`` done in separate
    processes): runs concatenated, later results for the same (problem, peer) win."""
    out: dict = {"runs": [], "problems": {}, "results": []}
    for doc in docs:
        offset = len(out["runs"])
        out["runs"] += doc["runs"]
        out["problems"].update(doc["problems"])
        out["results"] += [{**r, "run": r.get("run", 0) + offset} for r in doc["results"]]
    return out


def publish(doc: dict, out_dir: Path) -> None:
    """Write the table, JSON and plot into ``out_dir`` and print the table and the paths."""
    paths = write_reports(doc, out_dir)
    print(render_table(doc), end="")
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    from .runner import load_doc, save_doc

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Re-render DIR/bench.txt and bench.png from DIR/bench.json, or with --merge first combine "
        "several bench.json files into DIR/bench.json.",
    )
    parser.add_argument("out", type=Path, help="directory holding (or receiving) bench.json")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="bench.json files to combine, in order")
    args = parser.parse_args(argv)
    if args.merge:
        doc = merge_docs([load_doc(p) for p in args.merge])
        save_doc(doc, args.out / "bench.json")
    else:
        doc = load_doc(args.out / "bench.json")
    publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
