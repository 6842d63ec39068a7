"""The end-to-end benchmark's text table (printed and written to ``DIR/e2e.txt``) and plot (``DIR/e2e.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..measure import plot_panels

def fmt_gib(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def describe_sft(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"] + (f" ({r.get('note') or r.get('error')})" if r.get("note") or r.get("error") else "")
    loss = f"{r['losses'][0]:.4f}" if r.get("losses") else "-"
    return f"{r['tokens_per_s']:.0f} tok/s, peak {fmt_gib(r['peak_gib'])} GiB, loss@1 {loss}"


def describe_grpo(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"] + (f" ({r.get('note') or r.get('error')})" if r.get("note") or r.get("error") else "")
    return (f"{r['step_s_median'] * 1e3:.0f} ms/step, {r['tokens_per_s']:.0f} tok/s, peak {fmt_gib(r['peak_gib'])} GiB "
            f"(+{fmt_gib(r['peak_above_weights_gib'])} over weights), loss {r['losses'][0]:.5f}")


def longest_fit(runs: list[dict], variant: str) -> Optional[int]:
    ok = [r["seq_len"] for r in runs if r["variant"] == variant and r["status"] == "ok"]
    return max(ok) if ok else None


def sft_table(doc: dict) -> list[str]:
    sft = doc["sft"]
    runs = sft["runs"]
    lens = sorted({r["seq_len"] for r in runs})
    variants = [v for v in sft["variants"] if any(r["variant"] == v for r in runs)]
    if not lens:
        return []
    lines = [f"SFT  {sft['model']}, {sft['setup']}",
             "  cell: tokens/s | peak GiB (max_memory_allocated over train(): weights+grads+optimizer+activations)"]
    head = f"  {'variant':18s}" + "".join(f"{f'seq {n}':>22s}" for n in lens) + f"{'longest fit':>14s}"
    lines.append(head)
    for v in variants:
        cells = []
        for n in lens:
            r = next((r for r in runs if r["variant"] == v and r["seq_len"] == n), None)
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                cells.append(f"{r['tokens_per_s']:.0f} | {fmt_gib(r['peak_gib'])}")
            elif r["status"] == "skipped":
                cells.append("skipped")
            else:
                cells.append(r["status"])
        fit = longest_fit(runs, v)
        lines.append(f"  {v:18s}" + "".join(f"{c:>22s}" for c in cells) + f"{(str(fit) if fit else 'none'):>14s}")
    notes = sorted({f"{r['variant']}: {r['note']}" for r in runs if r.get("note") and r["note"] != "time budget"
                    and not r["note"].startswith(("OOM at", "error at"))})
    notes += sorted({f"{r['variant']} @ {r['seq_len']}: {r['error']}" for r in runs if r["status"] == "error"})
    if "liger" in variants:
        notes.insert(0, "liger = use_liger_kernel=True: fused linear CE plus Liger's RoPE/RMSNorm/SwiGLU kernels")
    lines += [f"  note: {n}" for n in notes]
    firsts = {f"{r['variant']}@{r['seq_len']}": r["losses"][0] for r in runs if r["status"] == "ok" and r.get("losses")}
    if firsts:
        lines.append("  step-1 loss: " + ", ".join(f"{k} {v:.4f}" for k, v in firsts.items()))
    return lines


def grpo_table(doc: dict) -> list[str]:
    grpo = doc["grpo"]
    if not grpo["runs"]:
        return []
    lines = [f"GRPO {grpo['model']}, {grpo['setup']}",
             f"  {'variant':10s}{'ms/step':>10s}{'tok/s':>10s}{'peak GiB':>10s}{'+weights':>10s}{'loss':>12s}"
             f"{'|grad|':>10s}"]
    for r in grpo["runs"]:
        if r["status"] == "ok":
            lines.append(f"  {r['variant']:10s}{r['step_s_median'] * 1e3:>10.0f}{r['tokens_per_s']:>10.0f}"
                         f"{fmt_gib(r['peak_gib']):>10s}{fmt_gib(r['peak_above_weights_gib']):>10s}"
                         f"{r['losses'][0]:>12.5f}{r['grad_norm_last']:>10.4f}")
        else:
            lines.append(f"  {r['variant']:10s}  {describe_grpo(r)}")
    return lines


def table(doc: dict) -> str:
    lines = [f"hf_fused e2e on {doc['env']['device_name']} ({doc['env']['device']}), torch {doc['env']['torch']}, "
             f"transformers {doc['env']['transformers']}, trl {doc['env'].get('trl')}, "
             f"liger {doc['env'].get('liger_kernel')}; total {doc.get('total_s', 0):.0f} s"]
    for part in (sft_table(doc), grpo_table(doc)):
        if part:
            lines += [""] + part
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Optional[Path]:
    """SFT tokens/s and peak memory by sequence length, one line per variant (``None``: no SFT run, or no
    matplotlib)."""
    runs = doc["sft"]["runs"]
    lens = sorted({r["seq_len"] for r in runs})
    if not lens:
        return None
    x = {n: i for i, n in enumerate(lens)}
    speed, memory, marks = {}, {}, []
    for r in runs:
        if r["status"] == "ok":
            speed.setdefault(r["variant"], []).append((x[r["seq_len"]], r["tokens_per_s"]))
            if r.get("peak_gib") is not None:
                memory.setdefault(r["variant"], []).append((x[r["seq_len"]], r["peak_gib"]))
        elif r["status"] == "OOM":
            marks.append((x[r["seq_len"]], f"OOM: {r['variant']}"))
    common = dict(xticks=[str(n) for n in lens], xlabel="tokens per row", marks=marks)
    panels = [dict(common, title="SFT training speed", ylabel="tokens/s (median step)", series=speed, log=False),
              dict(common, title="SFT peak memory", ylabel="max_memory_allocated over train() [GiB]", series=memory,
                   log=False, empty="memory not measured on this device")]
    return plot_panels(path, panels, f"{doc['sft']['model']} on {doc['env']['device_name']}")
