"""The product path on this CPU: ``python -m sglang.launch_server --speculative-algorithm NEXTN`` with the plugin's
tree options, SmolLM2-135M-Instruct as the target and the shipped MTP head exported as SGLang's draft model.

Greedy output must equal plain decoding's (no speculation) for SGLang's loop (chain, eagle) and the README's
sequoia 15/4/4; the mean accept length through SGLang must match the reference decoder's for the same head, prompts
and tree; the acceptance counters must reach /metrics; an sglang.lang program must run against the server.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from cpu_server_helpers import SMOLLM2_NEW_TOKENS, accept_lengths, mean, running_server, tree_args
from sglang_spec.cli import main as cli_main

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[2]
# (policy, budget, depth, topk): the README's sequoia 15/4/4, SGLang's loop as chain and as eagle at topk 4;
# sequoia and specexec get budgets 64 / 16 in test_own_draft_loop.py (the plugin's own draft loop runs both), and
# the parity suite (test_parity_under_load.py) serves chain 7/7, the context trees and sequoia's other paths
SHAPES = [("chain", 3, 3, 1), ("eagle", 15, 4, 4), ("sequoia", 15, 4, 4)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: "{}-{}-{}-{}".format(*shape))
def tree_run(request, smollm2_cpu, server_logs, smollm2_prompts):
    """One server per shape (metrics on), the prompts decoded greedily through it, and /metrics before and after."""
    policy, budget, depth, topk = request.param
    extra = tree_args(policy, budget, depth, topk, smollm2_cpu.profile) + ["--enable-metrics"]
    with running_server(smollm2_cpu, server_logs, "smollm2-{}-{}-{}-{}".format(*request.param), extra) as server:
        before = server.request("/metrics")
        answers = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
        after = server.request("/metrics")
        extras = None
        if (policy, budget) == ("sequoia", 15):  # the README's tree: also a text request and an sglang.lang program
            # and a profile calibrated from the live server's per-rank counters (before more requests are sent)
            calibrated = server_logs / "smollm2-sequoia-from-server.json"
            code = cli_main(["calibrate", "--from-server", server.url, "--out", str(calibrated), "--force"])
            text = server.request("/generate", {"text": "def add(a, b):",
                                                "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
            # one prompt alone, its draft extends' LM head over the rows SGLang reads (hooks.draft.extend_logit_rows)
            # and over every row (a batch that returns logprobs), after its first pass filled the prefix cache
            alone = {"input_ids": smollm2_prompts[0],
                     "sampling_params": {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS}}
            rows = (server.request("/generate", alone), server.request("/generate", dict(alone, return_logprob=True)))
            extras = {"text": text, "frontend": run_frontend(server.url), "calibrated": (code, calibrated),
                      "extend_rows": rows}
    return request.param, answers, before, after, extras


def test_greedy_output_equals_plain_decoding(tree_run, smollm2_plain):
    shape, answers, *_ = tree_run
    for index, (answer, expected) in enumerate(zip(answers, smollm2_plain)):
        assert answer["output_ids"] == expected, f"{shape}: prompt {index} differs from plain decoding"
    lengths = accept_lengths(answers)
    assert lengths and max(lengths) >= 2, f"{shape}: no draft was ever accepted ({lengths})"


def _counter(metrics_text: str, name: str, position: int | None = None) -> float:
    label = "" if position is None else rf'\{{position="{position}"\}}'
    match = re.search(rf"^{name}{label} ([0-9.e+]+)$", metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_per_position_acceptance_reaches_metrics(tree_run):
    """/metrics counts exactly the verify steps and per-position acceptances SGLang reports per request."""
    shape, answers, before, after, _ = tree_run
    lengths = accept_lengths(answers)
    steps = (_counter(after, "sglang_spec_tree_verify_steps_total")
             - _counter(before, "sglang_spec_tree_verify_steps_total"))
    assert steps == len(lengths)
    for position in range(1, shape[2] + 1):
        counted = (_counter(after, "sglang_spec_tree_accepted_drafts_total", position)
                   - _counter(before, "sglang_spec_tree_accepted_drafts_total", position))
        assert counted == sum(1 for length in lengths if length - 1 >= position), f"position {position}"


def test_per_rank_counts_and_calibrate_from_server(tree_run, tmp_path):
    """Sequoia 15/4/4: the per-(depth, rank) counters count exactly the steps SGLang reports (1 + the accepted
    nodes per step is the mean accept length), and `calibrate --from-server` writes a profile whose depth-1 rank-0
    acceptance is the counters' and that generate and the plugin's options accept."""
    from sglang_spec.cli.calibrate import parse_rank_counts
    from sglang_spec.sglang_plugin.options import from_values

    shape, answers, before, after, extras = tree_run
    if extras is None:
        pytest.skip("run once, against sequoia 15/4/4")
    lengths = accept_lengths(answers)
    steps_before, offered_before, accepted_before = parse_rank_counts(before) if "rank_steps" in before else (0, {}, {})
    steps_after, offered_after, accepted_after = parse_rank_counts(after)
    steps = steps_after - steps_before
    delta = {key: accepted_after[key] - accepted_before.get(key, 0.0) for key in accepted_after}
    offered = {key: offered_after[key] - offered_before.get(key, 0.0) for key in offered_after}
    assert steps == len(lengths)
    assert 1 + sum(delta.values()) / steps == pytest.approx(mean(lengths), abs=1e-12)
    for depth in range(1, shape[2] + 1):  # per depth: the steps that accepted at least `depth` drafts
        assert sum(v for (d, _), v in delta.items() if d == depth) == sum(1 for n in lengths if n - 1 >= depth)
    assert offered[(1, 0)] == steps  # every step offers the root's rank-0 child
    code, calibrated = extras["calibrated"]
    assert code == 0
    profile = json.loads(calibrated.read_text())
    print(f"\nfrom-server profile: {profile['rank_acceptance']} over {profile['steps']} steps")
    assert profile["steps"] == steps_after
    # the profile also counts the server's warm-up steps; within 0.05 of the requests' own depth-1 rank-0 rate
    assert profile["rank_acceptance"][0][0] == pytest.approx(delta[(1, 0)] / offered[(1, 0)], abs=0.05)
    options = from_values({"speculative_tree_policy": "sequoia", "speculative_tree_budget": 15,
                           "speculative_tree_depth": 4, "speculative_tree_topk": 4,
                           "speculative_acceptance_profile": str(calibrated)})
    assert options.draft_plan() is not None
    assert cli_main(["generate", "--model", "smollm2", "--policy", "sequoia", "--budget", "15", "--depth", "4",
                     "--acceptance", str(calibrated), "--prompt", "def add(a, b):", "--max-new-tokens", "8"]) == 0


def run_frontend(url: str) -> dict:
    spec = importlib.util.spec_from_file_location("frontend_multiturn", REPO / "examples" / "frontend_multiturn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(url)


def test_text_request_and_frontend_program(tree_run):
    """The README's curl (a text /generate) answers through the tree, and examples/frontend_multiturn.py
    (sglang.lang: multi-turn, run and run_batch) runs against the server and sees its accept length."""
    shape, _, _, _, extras = tree_run
    if extras is None:
        pytest.skip("run once, against sequoia 15/4/4")
    text = extras["text"]
    assert isinstance(text["text"], str) and text["meta_info"]["completion_tokens"] == 24
    assert text["meta_info"]["spec_verify_ct"] < 24
    frontend = extras["frontend"]
    assert len(frontend["answers"]) == 4 and all(answer.strip() for answer in frontend["answers"])
    assert frontend["avg_spec_accept_length"] > 1.0


def test_the_draft_extend_computes_the_logits_it_reads_only(tree_run):
    """A decode step's draft extend runs the head over the step's whole window but SGLang reads one row of its
    logits a request; the plugin computes those rows' alone. The head's candidates, hence the trees, must be the
    ones every row's logits give: the same prompt alone, with the rows selected and with every row computed (a
    request that returns logprobs), verifies the same trees step for step. (Rows off by one drop its accept
    length far below the reference decoder's, ``test_accept_length_matches_the_reference_decoder``.)"""
    shape, _, _, _, extras = tree_run
    if extras is None:
        pytest.skip("run once, against sequoia 15/4/4")
    selected, every = (answer["meta_info"] for answer in extras["extend_rows"])
    assert "output_token_logprobs" in every and "output_token_logprobs" not in selected
    assert extras["extend_rows"][0]["output_ids"] == extras["extend_rows"][1]["output_ids"]
    assert selected["spec_verify_ct"] < selected["completion_tokens"], "no draft was accepted: nothing compared"
    assert (selected["spec_verify_ct"], selected["spec_correct_drafts_histogram"]) == \
        (every["spec_verify_ct"], every["spec_correct_drafts_histogram"])


def test_accept_length_matches_the_reference_decoder(tree_run, smollm2_prompts, smollm2):
    """Sequoia 15/4/4: the mean accept length through SGLang is within 10% of the reference decoder's on the same
    prompts, head and tree (the head is served exactly, norms and reduced vocabulary included)."""
    shape, answers, *_ = tree_run
    if shape != ("sequoia", 15, 4, 4):
        pytest.skip("compared for the README's tree")
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
    from sglang_spec.models.loading import shipped_profile_path
    from sglang_spec.tree import AcceptanceProfile, TreePolicy

    loaded, head = smollm2
    policy = TreePolicy("sequoia", budget=15, depth=4, topk=4,
                        profile=AcceptanceProfile.from_json(shipped_profile_path("smollm2")))
    reference = SpeculativeDecoder(loaded.model, head, policy).generate(
        smollm2_prompts, GenerationConfig(max_new_tokens=SMOLLM2_NEW_TOKENS, eos_token_ids=loaded.eos_token_ids))
    through_sglang = mean(accept_lengths(answers))
    print(f"\nsequoia 15/4/4 mean accept length: SGLang {through_sglang:.3f}, reference decoder "
          f"{reference.accept_length_mean:.3f}")
    assert through_sglang == pytest.approx(reference.accept_length_mean, rel=0.10)
    assert [request.tokens for request in reference.requests] == [a["output_ids"] for a in answers]


def test_the_bed_packs_its_gemms_and_decodes_as_f_linear_does(smollm2_plain, smollm2_cpu, server_logs,
                                                              smollm2_prompts, monkeypatch):
    """The CPU bed runs SGLang's linear layers and LM head on packed float32 weights (``sglang_spec_testbed/linear.py``,
    the target's and the draft's): the plain server's log says so, and a server on SGLang's own ``F.linear`` path
    (``SGLANG_SPEC_CPU_GEMM=linear``) decodes the held-out prompts to the same greedy tokens."""
    from sglang_spec.gemm.packed_linear import available_backends
    from sglang_spec_testbed.linear import GEMM_ENV

    packed_log = (server_logs / "smollm2-plain.log").read_text(errors="replace")
    backend = available_backends()[0]
    assert re.search(rf"\[sglang_spec\] CPU bed: \d+ float32 weights of the target model packed for the {backend} "
                     "GEMM", packed_log), packed_log[-3000:]
    tree_log = (server_logs / "smollm2-sequoia-15-4-4.log")
    if tree_log.exists():  # the tree servers above ran in this session: their draft model is packed too, every
        # linear layer of the head (q/k/v, o, gate/up, down, eh_proj) and its LM head
        assert f"6 float32 weights of the draft model packed for the {backend} GEMM" in \
            tree_log.read_text(errors="replace")
    monkeypatch.setenv(GEMM_ENV, "linear")
    with running_server(smollm2_cpu, server_logs, "smollm2-plain-f-linear", speculative=False) as server:
        answers = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
    log = server.log_path.read_text(errors="replace")
    assert "the target model's linear layers run F.linear (SGLANG_SPEC_CPU_GEMM=linear)" in log
    assert [answer["output_ids"] for answer in answers] == smollm2_plain
