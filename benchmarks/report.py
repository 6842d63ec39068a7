"""The ops benchmark's results document as a text table (printed and ``bench.txt``) and a plot (``bench.png``).

``python -m benchmarks.report DIR`` re-renders both from ``DIR/bench.json`` (e.g. after several ``--resume`` runs
filled it in); ``--merge A.json B.json ...`` first combines runs made in separate processes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .measure import GIB, load_json, plot_panels, save_json, text_table
from .peers import peer_order

TITLES = {"ce": "cross-entropy fwd+bwd", "grpo": "GRPO (log-probs + TRL's loss) fwd+bwd",
          "distill": "distillation (student fwd+bwd, teacher fwd)",
          "sparse": "sparse teacher (top-K log-probs; student fwd+bwd)"}


def _records(doc: dict) -> dict[str, list[dict]]:
    """Latest record per (problem, peer), grouped by problem in first-seen order, peers in table order."""
    latest: dict[tuple[str, str], dict] = {}
    for r in doc["results"]:
        latest[(r["problem"], r["peer"])] = r
    by_problem: dict[str, list[dict]] = {}
    for name in doc["problems"]:
        rows = [r for (p, _), r in latest.items() if p == name]
        if rows:
            by_problem[name] = sorted(rows, key=lambda r: peer_order(r["peer"]))
    return by_problem


def _e(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.1e}"


def fmt_number(x: Optional[float], fmt: str) -> str:
    """``x`` formatted with ``fmt`` (``format``'s spec), an em dash for ``None``."""
    return "—" if x is None else format(x, fmt)


def _bytes(b: Optional[int]) -> str:
    """GiB with two decimals from 0.1 GiB up, MiB below (CPU smoke shapes are kilobytes to megabytes)."""
    if b is None:
        return "—"
    return f"{b / GIB:.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:.2f} MiB"


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    mem = r.get("peak_mem_bytes")
    return f"{r['time_ms']:.1f} ms" + ("" if mem is None else f" / {_bytes(mem)}")


def _header(doc: dict, with_ceiling: bool) -> list[str]:
    lines = []
    used = sorted({r.get("run", 0) for r in doc["results"]}) or list(range(len(doc["runs"])))
    for i in used:
        run = doc["runs"][i]
        c = run.get("matmul_ceiling")
        tag = f"run {i}: " if len(used) > 1 else ""
        lines += [
            f"{tag}device: {run['device']}   dtype: {run['dtype']}"
            + (f"   autocast: {run['autocast']}" if run.get("autocast") else "")
            + f"   timer: {run['timer']}   repeats: {run['repeats']}",
            f"{tag}matmul ceiling: " + (f"{c['tflops']:.4g} TFLOP/s ({c['dtype']} {c['n']}³ median {c['ms']:.3f} ms"
                                        + (f", held {c['hold_s']:g} s)" if c.get("hold_s") else ", a burst)")
                                        if c else "none (measured on CUDA only; CPU times are not compared to one)"),
            f"{tag}versions: " + ", ".join(f"{k} {v}" for k, v in run["versions"].items() if v),
        ]
    if doc["runs"]:
        lines += [
            "FLOPs: " + doc["runs"][-1]["flop_convention"],
            "memory: peak above inputs + gradients (see bench.json runs[].memory_baseline)",
            *(["% ceil: achieved TFLOP/s / the matmul ceiling measured in the same run"] if with_ceiling else []),
            "errors: ‖x − x_ref‖/‖x_ref‖ against the float64 reference (loss: |Δ|/|ref|; logp/entropy over kept "
            "tokens; distillation: the student's gradients)",
            "",
        ]
    return lines


def render_table(doc: dict) -> str:
    """The side-by-side summary (peers × problems: median time / peak memory) and one detail table per problem,
    plus notes for the peers that did not run."""
    groups = _records(doc)
    with_ceiling = any(r.get("frac_of_ceiling") is not None for r in doc["results"])
    lines = _header(doc, with_ceiling)
    problems = list(groups)
    peers = sorted({r["peer"] for rows in groups.values() for r in rows}, key=peer_order)
    labels = {r["peer"]: r["label"] for rows in groups.values() for r in rows}
    cells = {(r["problem"], r["peer"]): r for rows in groups.values() for r in rows}
    if problems:
        lines.append("median fwd+bwd time / peak memory above inputs+grads")
        lines += text_table(["peer", *problems], [[labels[k], *(_cell(cells.get((p, k))) for p in problems)]
                                                 for k in peers])
        lines.append("")
    notes: dict[str, set[str]] = {}
    for name, rows in groups.items():
        info = doc["problems"][name]
        ref = info.get("reference_loss")
        ref_text = (f"float64 loss {ref:.6f} ({info['reference_seconds']:.1f} s)" if ref is not None
                    else info.get("reference", "—"))
        lines.append(f"{name}: {info['description']}, {info['n_valid']} kept tokens, reference {ref_text}")
        grpo = info["kind"] == "grpo"
        header = ["peer", "time ms", "TFLOP/s", *(["% ceil"] if with_ceiling else []), "peak mem", "loss err",
                  "dX err", "dW err", *(["logp err", "entropy err"] if grpo else []), "status"]
        rows_out = []
        for r in rows:
            ok = r["status"] == "ok"
            row = [r["label"], fmt_number(r.get("time_ms"), ".2f"), fmt_number(r.get("tflops"), ".3g"),
                   *([fmt_number(None if r.get("frac_of_ceiling") is None else 100 * r["frac_of_ceiling"], ".0f")]
                     if with_ceiling else []),
                   _bytes(r.get("peak_mem_bytes")), _e(r.get("loss_rel_err")), _e(r.get("grad_hidden_rel_err")),
                   _e(r.get("grad_weight_rel_err"))]
            if grpo:
                logp = _e(r.get("logp_rel_err")) if ok and r.get("logp_rel_err") is not None else ("n/a" if ok else "—")
                ent = _e(r.get("entropy_rel_err")) if r.get("has_entropy") else ("n/a" if ok else "—")
                row += [logp, ent]
            row.append(r["status"] + (f" [{r['backend']}]" if r.get("backend") else ""))
            rows_out.append(row)
            if not ok and r.get("note"):
                note = r["note"] if r["status"] != "n/a" else f"{r['note']} ({name})"
                notes.setdefault(f"{r['label']}: {r['status']}", set()).add(note)
        lines += text_table(header, rows_out)
        lines.append("")
    if notes:
        lines.append("notes:")
        for key, texts in notes.items():
            lines += [f"  {key} — {t}" for t in sorted(texts)]
    return "\n".join(lines).rstrip() + "\n"


def _panels(doc: dict) -> list[dict]:
    """Two panels (median time, peak memory) per problem kind; x = the kind's problems by token count."""
    groups = _records(doc)
    problems = doc["problems"]
    panels = []
    for kind in ("ce", "grpo", "distill", "sparse"):
        names = sorted((p for p in groups if problems[p]["kind"] == kind),
                       key=lambda p: (problems[p]["N"], problems[p]["H"] * problems[p]["V"], problems[p].get("beta"),
                                      problems[p].get("K") or 0))
        if not names:
            continue
        xs = {p: i for i, p in enumerate(names)}
        ticks = [f"{problems[p]['N']} tok\nH{problems[p]['H']} V{problems[p]['V']}"
                 + (f"\nteacher H{problems[p]['H_t']}, β {problems[p]['beta']:g}" if kind == "distill" else "")
                 + (f"\nK {problems[p].get('K')}" if kind == "sparse" else "")
                 for p in names]
        time_series, mem_series, marks = {}, {}, []
        for r in sorted((r for p in names for r in groups[p]), key=lambda r: peer_order(r["peer"])):
            x = xs[r["problem"]]
            if r["status"] == "ok":
                time_series.setdefault(r["label"], []).append((x, r["time_ms"]))
                if r.get("peak_mem_bytes") is not None:
                    mem_series.setdefault(r["label"], []).append((x, max(r["peak_mem_bytes"], 1) / GIB))
            elif r["status"] == "OOM":
                marks.append((x, f"OOM: {r['label']}"))
        common = dict(xticks=ticks, xlabel="tokens (problem)", title=TITLES[kind], marks=marks)
        panels += [dict(common, ylabel="median time [ms]", series=time_series),
                   dict(common, ylabel="peak memory above inputs+grads [GiB]", series=mem_series,
                        empty="memory not measured on this device")]
    return panels


def render_plot(doc: dict, path: Path) -> Optional[Path]:
    """Median time and peak memory per peer, one row of panels per problem kind (``None`` without matplotlib)."""
    run = doc["runs"][-1] if doc["runs"] else {}
    title = ""
    if run:
        c = run.get("matmul_ceiling")
        title = (f"{run['device']}, {run['dtype']}" + (f" under {run['autocast']} autocast" if run.get("autocast")
                                                        else "")
                 + (f"; matmul ceiling {c['tflops']:.4g} TFLOP/s" if c else ""))
    return plot_panels(path, _panels(doc), title)


def write_reports(doc: dict, out_dir: Path) -> dict[str, Path]:
    """Write ``bench.txt`` and ``bench.png`` next to ``bench.json``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.txt").write_text(render_table(doc))
    paths = {"json": out_dir / "bench.json", "table": out_dir / "bench.txt"}
    png = render_plot(doc, out_dir / "bench.png")
    if png is not None:
        paths["plot"] = png
    return paths


def merge_docs(docs: list[dict]) -> dict:
    """One document from several runs (e.g. ``--shapes ce`` and ``--shapes grpo`` done in separate processes): runs
    concatenated, later results for the same (problem, peer) win."""
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
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Re-render DIR/bench.txt and bench.png from DIR/bench.json, or with --merge first combine "
        "several bench.json files into DIR/bench.json.")
    parser.add_argument("out", type=Path, help="directory holding (or receiving) bench.json")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="bench.json files to combine, in order")
    args = parser.parse_args(argv)
    if args.merge:
        doc = merge_docs([load_json(p) for p in args.merge])
        save_json(doc, args.out / "bench.json")
    else:
        doc = load_json(args.out / "bench.json")
    publish(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
