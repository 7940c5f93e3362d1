"""``sglang-spec generate`` with context-lookup and hybrid trees, ``--auto`` over them, and ``--trace``."""

import json

import pytest

from sglang_spec.cli import main
from sglang_spec.costs import CostCurve

PROMPT = "abcabcabcab"  # tiny-deepseek's byte tokens: something to copy


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("policy", ["lookup", "hybrid"])
def test_hybrid_policies_are_checked_against_plain_decoding(tiny, capsys, policy):
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--policy", policy, "--prompt", PROMPT,
                           "--prompt", "hello", "--max-new-tokens", "24", "--check", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["policy"] == policy and report["identical_to_baseline"] is True
    assert report["budget"] == 16 and report["depth"] == 10  # the lookup / hybrid defaults
    sources = report["tokens_by_source"]
    assert sources["target"] >= 2 and sum(sources.values()) == 48
    assert ("mtp" in sources) == (policy == "hybrid")


def write_costs(path, verify_step):
    costs = CostCurve({n: 0.01 + verify_step * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)}, draft_level=0.001,
                      step_overhead=0.0005, prefix=200, device="synthetic", plain_token=0.0105)
    path.write_text(json.dumps(costs.to_json()))
    return path


@pytest.mark.parametrize("verify_step, speculates", [(1e-4, True), (0.05, False)])
def test_auto_chooses_each_steps_tree_from_the_cost_curve(tiny, capsys, tmp_path, verify_step, speculates):
    costs = write_costs(tmp_path / "costs.json", verify_step)
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--auto", "--costs", str(costs),
                           "--prompt", PROMPT, "--max-new-tokens", "24", "--check", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["auto"]["policy"] == "hybrid" and report["auto"]["costs"] == str(costs)
    assert report["identical_to_baseline"] is True
    if speculates:
        assert report["accept_length_mean"] > 1.5 and report["plain_steps"] < report["steps"]
    else:  # a verified token costs 5 plain steps: every step is a plain step (a tree of the root alone)
        assert report["plain_steps"] == report["steps"] and report["accept_length_mean"] == 1


def test_trace_html_and_terminal_views(tiny, capsys, tmp_path):
    trace = tmp_path / "trace.html"
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--policy", "hybrid", "--prompt", PROMPT,
                           "--max-new-tokens", "16", "--trace", str(trace))
    assert code == 0 and "tokens by source" in out
    page = trace.read_text()
    assert page.startswith("<!doctype html>") and "drafted by the context lookup" in page
    assert page.count("class='t'") == 16 and "step 1, " in page
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--policy", "lookup", "--prompt", PROMPT,
                           "--max-new-tokens", "8", "--trace", "-")
    assert code == 0 and "\x1b[48;5;" in out and "--- request 0" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "hybrid", "--budget", "0"], "budget must be >= 1"),
        (["--policy", "lookup", "--mtp-levels", "-1"], "argument --mtp-levels: -1 is out of range"),
        (["--policy", "hybrid", "--acceptance", "/nonexistent/profile.json"], "/nonexistent/profile.json"),
        (["--policy", "sequoia", "--mtp-levels", "1"], "the sequoia policy has none"),
        (["--policy", "hybrid", "--trace", "{file}/trace.html"], "is not a folder"),
        (["--policy", "hybrid", "--topk", "65"], "exceeds the maximum 64"),
    ],
)
def test_bad_input_is_one_error_line(tiny, capsys, tmp_path, extra, message):
    (tmp_path / "file").write_text("")
    extra = [item.replace("{file}", str(tmp_path / "file")) for item in extra]
    code, out, err = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--prompt", "x", *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
