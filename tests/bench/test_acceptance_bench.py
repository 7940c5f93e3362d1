import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "acceptance.py"


@pytest.mark.slow
def test_quick_sweep_writes_table_json_and_plots(tiny, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    out = tmp_path / "acceptance.json"
    assert module.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    methods = {row["method"] for row in report["rows"]}
    assert {"plain", "prompt_lookup", "chain", "eagle", "sequoia", "specexec", "auto"} <= methods
    greedy = [row for row in report["rows"] if row["temperature"] == 0 and row["identical"] is not None]
    assert greedy and all(row["identical"] for row in greedy if row["method"] != "prompt_lookup")
    assert report["head_quality"]["default"]["depth1_top1"] > 0.5
    for name in ("accept-length", "speedup", "costs"):
        assert (tmp_path / f"acceptance-{name}.png").stat().st_size > 1000
    assert (tmp_path / "acceptance.md").read_text().startswith("# Acceptance sweep")
    timing = report["draft_vocabulary"]["default"]
    assert timing["draft_level_seconds"] > 0 and timing["full_vocab_draft_level_seconds"] > 0
