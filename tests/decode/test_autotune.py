import json

from sglang_spec.cli import main
from sglang_spec.decode.autotune import CostCurve, choose_speculation, measure_costs
from sglang_spec.tree import AcceptanceProfile

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


def test_measured_costs_on_the_tiny_model(tiny):
    loaded, head = tiny
    costs = measure_costs(loaded.model, head, sizes=(1, 2, 4, 8), repeats=3)
    assert set(costs.verify) == {1, 2, 4, 8} and all(value > 0 for value in costs.verify.values())
    assert costs.draft_level > 0 and costs.step_overhead >= 0
    assert CostCurve.from_json(json.loads(json.dumps(costs.to_json()))) == costs


def test_auto_never_slower_than_plain_on_the_tiny_model(tiny, capsys, tmp_path):
    """A model this small decodes a token in about a millisecond; the decoder's per-step host work is larger, so
    the cost model must decline speculation, and the output is then plain decoding's."""
    costs = tmp_path / "costs.json"
    assert main(["generate", "--model", "tiny-deepseek", "--auto", "--costs", str(costs), "--prompt", "abc",
                 "--max-new-tokens", "16", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["auto"]["budget"] == 0 and report["policy"] == "none"
    assert report["identical_to_baseline"] is True
    assert json.loads(costs.read_text())["verify"]["1"] > 0  # the measured curve was written
