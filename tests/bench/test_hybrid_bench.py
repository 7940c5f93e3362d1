"""bench/hybrid.py --quick (tiny-deepseek, toy prompts): the report's structure and greedy identity, not timings;
and its checks that fail before a model loads."""

import json
import math

import pytest


@pytest.mark.slow
def test_quick_bench_writes_json_markdown_and_plot(tiny, tmp_path, hybrid_bench, capsys):
    out = tmp_path / "hybrid.json"
    assert hybrid_bench.main(["--quick", "--out", str(out)]) == 0
    progress = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["rows"]
    methods = set(hybrid_bench.METHODS)
    # every method at both temperatures, one progress line each
    assert {(row["method"], row["temperature"]) for row in rows} == {(m, t) for m in methods for t in (0.0, 0.7)}
    assert all(progress.count(f" {method}: ") == 2 for method in methods), progress
    for row in rows:
        assert row["tokens"] > 0 and row["tokens_per_second"] > 0 and row["speedup"] > 0
        assert row["latency_p50_ms"] >= 0 and row["latency_p99_ms"] >= row["latency_p50_ms"]
        assert len(row["load"]) == 2
        if not row["method"].startswith("hf_"):
            assert row["accept_length"] >= 1 and row["steps"] > 0
    greedy = [row for row in rows if row["temperature"] == 0]
    # lossless: every tree (and plain HF decoding) reproduces plain greedy decoding token for token
    assert all(row["identical"] for row in greedy if row["method"] in ("hf_plain", "mtp", "lookup", "hybrid", "auto"))
    assert all(row["identical"] is None for row in rows if row["temperature"] > 0)
    # the toy prompts repeat themselves: the lookup drafts, and the hybrid tree holds both sources
    by = {(row["method"], row["temperature"]): row for row in rows}
    assert by[("lookup", 0.0)]["tokens_by_source"].get("lookup", 0) > 0
    assert set(by[("hybrid", 0.0)]["tokens_by_source"]) <= {"target", "mtp", "lookup", "both"}
    limits = report["limits"]
    assert set(limits["verify_seconds"]) == {"1", "4", "16"} and limits["plain_step_seconds"] > 0
    assert limits["memory_bandwidth_gbs"] > 0 and limits["matmul_peak_gflops"] > 0
    assert math.isfinite(limits["verify16_over_plain"])
    assert any("identical to plain decoding everywhere: yes" in line for line in report["done_when"])
    assert report["costs"].keys() == {"0.0", "0.7"}
    assert (tmp_path / "hybrid.md").read_text().startswith("# Hybrid trees vs prompt lookup")
    assert (tmp_path / "hybrid.png").stat().st_size > 1000
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]  # atomic writes left nothing


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "{file}/hybrid.json"], "is not a folder"),
        (["--methods", "plain,speculate"], "unknown ['speculate']"),
        (["--temperatures", "warm"], "--temperatures"),
        (["--temperatures", "-1"], "each in [0, 100]"),
        (["--hybrid", "16:10"], "give BUDGET:DEPTH:MTP_LEVELS"),
        (["--auto", "0:10:2"], "budget must be >= 1"),
        (["--mtp-tree", "specexec:8"], "give POLICY:BUDGET:DEPTH"),
        (["--prompts", "{file}"], "holds no prompts"),
    ],
)
def test_bad_options_fail_before_a_model_loads(tmp_path, hybrid_bench, capsys, monkeypatch, extra, message):
    (tmp_path / "file").write_text("\n")
    monkeypatch.setattr(hybrid_bench, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    extra = [item.replace("{file}", str(tmp_path / "file")) for item in extra]
    argv = ["--out", str(tmp_path / "out.json"), *extra]
    assert hybrid_bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out.json").exists()
