import json

from sglang_spec.cli import main
from sglang_spec.decode.autotune import interleaved_medians, interleaved_times, measure_costs
from sglang_spec.tree import AcceptanceProfile
from sglang_spec.costs import CostCurve
from sglang_spec.tree.sizing import choose_speculation

GOOD = AcceptanceProfile.uniform([0.8, 0.1, 0.05])
POOR = AcceptanceProfile.uniform([0.05, 0.02])


def test_choice_follows_the_cost_curve():
    # GPU-like: verifying up to 32 tokens costs about as much as one
    flat = CostCurve({1: 10.0, 2: 10.1, 4: 10.2, 8: 10.5, 16: 11.0, 32: 12.0}, draft_level=0.5, step_overhead=0.5,
                     prefix=200, device="synthetic")
    choice = choose_speculation(GOOD, flat, max_depth=8)
    assert choice.budget >= 7 and choice.speedup > 2
    # CPU-like: verify time grows linearly with the tokens: only small trees, or none, can pay
    steep = CostCurve({1: 10.0, 2: 19.0, 4: 37.0, 8: 72.0}, draft_level=1.0, step_overhead=1.0, prefix=200,
                      device="synthetic")
    assert choose_speculation(GOOD, steep).budget == 0
    assert choose_speculation(POOR, flat).budget == 0  # a poor head never pays


def test_the_timer_takes_the_functions_in_turn_after_the_warmup_rounds():
    calls = []
    functions = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    times = interleaved_times(functions, repeats=3, warmup=2, device="cpu")
    assert calls == ["a", "b"] * 5
    assert {key: len(seconds) for key, seconds in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for seconds in times.values() for t in seconds)
    medians = interleaved_medians(functions, repeats=3)
    assert medians.keys() == {"a", "b"} and len(calls) == 10 + 2 + 6  # one warm-up round by default


def test_measured_costs_on_the_tiny_model(tiny):
    loaded, head = tiny
    costs = measure_costs(loaded.model, head, sizes=(1, 2, 4, 8), repeats=3)
    assert set(costs.verify) == {1, 2, 4, 8} and all(value > 0 for value in costs.verify.values())
    assert costs.draft_level > 0 and costs.step_overhead >= 0 and costs.plain_token > 0
    assert CostCurve.from_json(json.loads(json.dumps(costs.to_json()))) == costs


def _write_curve(path, curve: CostCurve):
    path.write_text(json.dumps(curve.to_json()))
    return str(path)


def test_auto_declines_where_nothing_pays_and_then_is_plain_decoding(tiny, capsys, tmp_path):
    """With a CPU-like curve (verify time linear in the tokens, host work as large as a forward) --auto over
    sequoia trees runs no speculation, and the output is plain decoding's (``--auto`` over hybrid trees decides per
    step: tests/cli/test_generate_hybrid.py). Curves are given, not timed, so the decision is exact."""
    steep = CostCurve({1: 1e-3, 2: 2e-3, 4: 4e-3, 8: 8e-3, 16: 16e-3}, draft_level=5e-4, step_overhead=1e-3,
                      prefix=200, device="synthetic")
    costs = _write_curve(tmp_path / "steep.json", steep)
    assert main(["generate", "--model", "tiny-deepseek", "--policy", "sequoia", "--auto", "--costs", costs,
                 "--prompt", "abc",
                 "--max-new-tokens", "16", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["auto"]["budget"] == 0 and report["policy"] == "none"
    assert report["identical_to_baseline"] is True


def test_auto_speculates_where_verify_is_flat(tiny, capsys, tmp_path):
    flat = CostCurve({1: 1e-2, 2: 1e-2, 4: 1.01e-2, 8: 1.02e-2, 16: 1.05e-2, 32: 1.1e-2}, draft_level=1e-4,
                     step_overhead=1e-4, prefix=200, device="synthetic")
    costs = _write_curve(tmp_path / "flat.json", flat)
    assert main(["generate", "--model", "tiny-deepseek", "--policy", "sequoia", "--auto", "--depth", "6", "--costs",
                 costs, "--prompt",
                 "abc", "--max-new-tokens", "16", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy"] == "sequoia" and report["budget"] == report["auto"]["budget"] >= 4
    assert 1 <= report["depth"] <= 6 and report["auto"]["predicted_speedup"] > 1.5
    assert report["identical_to_baseline"] is True


def test_auto_measures_and_caches_the_curve_when_none_is_given(tiny, capsys, tmp_path):
    costs = tmp_path / "measured.json"
    assert main(["generate", "--model", "tiny-deepseek", "--auto", "--costs", str(costs), "--prompt", "abc",
                 "--max-new-tokens", "8", "--json"]) == 0
    measured = CostCurve.from_json(json.loads(costs.read_text()))
    assert measured.verify[1] > 0 and measured.draft_level > 0
    written = costs.read_text()
    assert main(["generate", "--model", "tiny-deepseek", "--auto", "--costs", str(costs), "--prompt", "abc",
                 "--max-new-tokens", "8", "--json"]) == 0
    assert costs.read_text() == written  # the second run read the cache instead of measuring again
