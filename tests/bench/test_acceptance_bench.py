import json

import pytest

from sglang_spec.cli import main as cli_main
from sglang_spec.tree import AcceptanceProfile
from sglang_spec.costs import CostCurve


@pytest.mark.slow
def test_quick_sweep_writes_table_json_and_plots(tiny, tmp_path, acceptance):
    out = tmp_path / "acceptance.json"
    assert acceptance.main(["--quick", "--out", str(out)]) == 0
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


def test_auto_and_the_bench_predict_the_same_speedup(tiny, acceptance, capsys, tmp_path):
    """`--auto` and the bench's prediction for the same tree share one step cost (costs.step_seconds)."""
    costs = CostCurve({1: 1e-2, 2: 1e-2, 4: 1.01e-2, 8: 1.02e-2, 16: 1.05e-2, 32: 1.1e-2}, draft_level=4e-4,
                      step_overhead=6e-4, prefix=200, device="synthetic", plain_token=1.05e-2)
    costs_path = tmp_path / "costs.json"
    costs_path.write_text(json.dumps(costs.to_json()))
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps({"rank_acceptance": [[0.7, 0.15, 0.05], [0.6, 0.2, 0.05]]}))
    assert cli_main(["generate", "--model", "tiny-deepseek", "--policy", "sequoia", "--auto", "--depth", "6",
                     "--costs", str(costs_path),
                     "--acceptance", str(profile_path), "--prompt", "abc", "--max-new-tokens", "4", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["budget"] > 0
    accept_length, speedup = acceptance.profile_prediction(AcceptanceProfile.from_json(profile_path), costs,
                                                           auto["budget"], auto["depth"])
    assert accept_length == auto["expected_accept_length"]
    assert speedup == pytest.approx(auto["predicted_speedup"], rel=1e-12)
