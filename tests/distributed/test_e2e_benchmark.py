"""``python -m benchmarks.e2e.distributed``: the end-to-end SFT benchmark launched under the shipped accelerate
configs (2 CPU ranks over gloo here; 2 GPUs over NCCL on a machine that has them, docs/performance.md).

Checked: every rank of every engine wrote its runs, the table combines them, and under one engine the patched
model's step-1 loss equals the unpatched model's (same seed, same rows, same engine; fp32 on CPU, so the two
differ by float32 summation order only)."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.e2e.distributed import ENGINES, combine, main, row_sharing

pytestmark = [pytest.mark.distributed]

WRAPPERS = {"zero3": "DeepSpeedEngine", "zero3_sp2": "DeepSpeedEngine sp2"}


def test_e2e_distributed_tiny_cpu(tmp_path, capsys):
    """ZeRO-3 (one launch for both variants) and its Ulysses config (a launch per variant: DeepSpeed's sequence-parallel
    groups are built once per process; hf_fused's only here, the patched-against-stock comparison under Ulysses is
    test_engines' and test_trl_scripts'): every rank wrote its runs, the table combines them, the patched and unpatched
    models' step-1 losses agree, and tokens/s sums the ranks' rows (a row shared by the two Ulysses ranks once)."""
    pytest.importorskip("deepspeed", reason="`make test` installs DeepSpeed (Makefile)")
    variants = {"zero3": ("plain", "hf_fused"), "zero3_sp2": ("hf_fused",)}
    for engine, names in variants.items():
        out = tmp_path / engine
        rc = main(["--tiny", "--device", "cpu", "--engines", engine, "--sft-variants", ",".join(names),
                   "--seq-lens", "64", "--steps", "2", "--out", str(out)])
        printed = capsys.readouterr().out
        doc = json.loads((out / "e2e_distributed.json").read_text())
        assert rc == 0, [e.get("output_tail") for e in doc["engines"]]
        rows = {r["variant"]: r for r in doc["rows"] if r["engine"] == engine}
        assert set(rows) == set(names) and all(r["status"] == "ok" for r in rows.values()), rows
        assert rows["hf_fused"]["forward"].startswith("hf_fused"), rows["hf_fused"]["forward"]
        assert {r["wrapper"] for r in rows.values()} == {WRAPPERS[engine]}
        if "plain" in rows:
            assert not rows["plain"]["forward"].startswith("hf_fused")
            assert rows["hf_fused"]["loss_step1"] == pytest.approx(rows["plain"]["loss_step1"], rel=1e-5)
        for variant, row in rows.items():
            folder = out / engine / (variant if engine == "zero3_sp2" else "")
            ranks = [json.loads((folder / f"e2e.rank{r}.json").read_text()) for r in (0, 1)]
            assert [d["env"]["rank"] for d in ranks] == [0, 1] and {d["env"]["world_size"] for d in ranks} == {2}
            per_rank = [next(r for r in d["sft"]["runs"] if r["variant"] == variant) for d in ranks]
            shared = 2 if engine == "zero3_sp2" else 1
            assert row["tokens_per_s"] == pytest.approx(sum(64 / r["step_s_median"] for r in per_rank) / shared)
        table = (out / "e2e_distributed.txt").read_text()
        assert table in printed and re.search(rf"^\s*{engine} +hf_fused", table, re.M), table


def test_combine_reports_a_rank_that_wrote_nothing():
    run = {"variant": "plain", "seq_len": 64, "status": "ok", "tokens_per_s": 1.0, "peak_gib": None, "losses": [1.0]}
    engine_run = {"engine": "ddp", "ranks": [{"sft": {"runs": [run]}}, None]}
    (row,) = combine(engine_run, ["plain"])
    assert row["status"] == "missing" and "tokens_per_s" not in row


def test_several_ranks_run_only_the_sft_part(monkeypatch, tmp_path):
    from benchmarks.e2e.__main__ import main as e2e_main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        e2e_main(["--tiny", "--device", "cpu", "--out", str(tmp_path)])


def _run(wrapper, tokens_per_s):
    return {"variant": "plain", "seq_len": 64, "status": "ok", "tokens_per_s": tokens_per_s, "peak_gib": 1.0,
            "losses": [1.0], "wrapper": wrapper}


def test_context_parallel_ranks_share_their_rows():
    """Under fsdp2_cp2.yaml both ranks report the whole row over their step; together they trained one row."""
    assert row_sharing("fsdp2_cp2") == ("cp", 2) and row_sharing("zero3_sp2") == ("sp", 2)
    assert {row_sharing(e) for e in ENGINES if e not in ("fsdp2_cp2", "zero3_sp2")} == {("", 1)}
    engine_run = {"engine": "fsdp2_cp2", "ranks": [{"sft": {"runs": [_run("FSDPQwen3ForCausalLM cp2", 10.0)]}},
                                                   {"sft": {"runs": [_run("FSDPQwen3ForCausalLM cp2", 12.0)]}}]}
    (row,) = combine(engine_run, ["plain"])
    assert row["status"] == "ok" and row["tokens_per_s"] == pytest.approx(11.0)
    engine_run["engine"] = "fsdp2"
    assert combine(engine_run, ["plain"])[0]["tokens_per_s"] == pytest.approx(22.0)


def test_a_context_parallel_config_that_did_not_split_rows_is_no_result():
    engine_run = {"engine": "fsdp2_cp2", "ranks": [{"sft": {"runs": [_run("FSDPQwen3ForCausalLM", 10.0)]}}] * 2}
    (row,) = combine(engine_run, ["plain"])
    assert row["status"] == "not cp 2" and "tokens_per_s" not in row, row
