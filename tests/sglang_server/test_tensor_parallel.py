"""Tensor parallelism 2 through launch_server on this CPU: two scheduler ranks over gloo, for the plugin's own
draft loop (specexec 6/3/2, wider than topk) with SGLang's accept and with ``--speculative-tree-accept fused``.

The model is the tiny DeepSeek-V3 (4 query heads, MLA's single latent KV head replicated, 4 routed experts
sharded by their intermediate size); SmolLM2 serves on two ranks padded with zero heads (``smollm2-split``) in
``test_planner_matrix.py``. SGLang's CPU engine reduces over gloo here (its shared-memory all-reduce
needs sgl-kernel's AMX build, which the bed does not claim), and the bed names one core per rank for SGLang's
per-rank NUMA check (``cpu.rank_cores``).

Per server: greedy output equal to a one-rank plain server's; seeded temperature-0.7 requests complete on both
ranks (full length, drafts accepted) and the server answers afterwards, so the ranks did not diverge (a sampled
accept is rank 0's on every rank: SGLang's ``eagle_sample`` broadcasts it, the fused accept too); the two accepts
give the same sampled tokens (same seed, rank 0's coins); the plugin's acceptance counters count each verify
step once (rank 0 only), not once per rank. A draft that faults on one rank alone falls back on both (the
ranks agree on the filler tree each step), and the output stays plain decoding's.
"""

from __future__ import annotations

import re

import pytest

from cpu_server_helpers import accept_lengths, counted_draft_faults, running_server, tree_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

MAX_NEW_TOKENS = 24
SHAPE = ("specexec", 6, 3, 2)
SEED = ["--random-seed", "7"]
SAMPLED = {"temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS}
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}
ACCEPTS = ("sglang", "fused")
TIMEOUT = 300.0  # a request that waits on a diverged rank fails here rather than hanging the suite


@pytest.fixture(scope="module")
def prompts(tiny_prompts) -> list[list[int]]:
    return tiny_prompts


@pytest.fixture(scope="module")
def plain_one_rank(tiny_plain) -> list[list[int]]:
    """One rank's plain greedy output, cut to this module's length (greedy: a prefix of the longer output)."""
    return [output[:MAX_NEW_TOKENS] for output in tiny_plain]


def counters(metrics: str) -> dict[str, float]:
    """The plugin's verify-step and per-position acceptance counters from a /metrics text."""
    found = re.findall(r'^(sglang_spec_tree_(?:verify_steps|accepted_drafts)_total(?:\{position="\d+"\})?) '
                       r'([0-9.e+]+)$', metrics, re.M)
    return {name: float(value) for name, value in found}


_RUNS: dict[str, dict] = {}


@pytest.fixture(scope="module", params=ACCEPTS)
def tp_run(request, tiny_cpu, server_logs, prompts) -> dict:
    accept = request.param
    extra = tree_args(*SHAPE) + SEED + ["--tp-size", "2", "--enable-metrics", "--speculative-tree-accept", accept]
    with running_server(tiny_cpu, server_logs, f"tiny-tp2-{accept}", extra) as server:
        before = counters(server.request("/metrics"))
        greedy = server.generate(prompts, GREEDY, timeout=TIMEOUT)
        after = counters(server.request("/metrics"))
        sampled = server.generate(prompts, SAMPLED, timeout=TIMEOUT)
        again = server.generate(prompts[:1], GREEDY, timeout=TIMEOUT)
        metrics = server.request("/metrics")
        info = server.request("/server_info")
    run = {"accept": accept, "greedy": greedy, "sampled": sampled, "again": again, "before": before,
           "after": after, "metrics": metrics, "info": info, "log": server.log_path.read_text(errors="replace")}
    _RUNS[accept] = run
    return run


def test_greedy_output_with_two_ranks_equals_one_rank_plain_decoding(tp_run, plain_one_rank):
    assert tp_run["info"]["tp_size"] == 2
    assert "TP1" in tp_run["log"], "the second rank's scheduler did not log"
    assert [answer["output_ids"] for answer in tp_run["greedy"]] == plain_one_rank, tp_run["accept"]
    assert max(accept_lengths(tp_run["greedy"])) >= 2


def test_sampled_requests_complete_on_both_ranks(tp_run, plain_one_rank):
    tokens = [answer["output_ids"] for answer in tp_run["sampled"]]
    assert all(len(row) == MAX_NEW_TOKENS for row in tokens)
    assert tokens != plain_one_rank
    assert sum(accept_lengths(tp_run["sampled"])) > len(accept_lengths(tp_run["sampled"]))  # drafts accepted
    assert tp_run["again"][0]["output_ids"] == plain_one_rank[0]  # the ranks still agree after sampling


def test_the_fused_accept_serves_and_samples_as_sglangs_accept(tp_run):
    if tp_run["accept"] != "fused":
        pytest.skip("compares the fused server with SGLang's accept (run first)")
    theirs = _RUNS.get("sglang")
    if theirs is None:
        pytest.skip("SGLang's accept did not run in this session")
    fused = re.search(r'^sglang_spec_fused_accept_batches_total\{outcome="fused"\} ([0-9.]+)$', tp_run["metrics"],
                      re.M)
    assert fused and float(fused.group(1)) > 0
    for kind in ("greedy", "sampled"):
        assert [a["output_ids"] for a in tp_run[kind]] == [a["output_ids"] for a in theirs[kind]], kind
        assert accept_lengths(tp_run[kind]) == accept_lengths(theirs[kind]), kind


def test_acceptance_counters_count_each_step_once(tp_run):
    """Over the greedy batch the counters grow by exactly its verify steps and, per position d, by the steps that
    accepted at least d drafts (SGLang's per-request histograms): counted on rank 0 only, not twice."""
    lengths = accept_lengths(tp_run["greedy"])
    before, after = tp_run["before"], tp_run["after"]

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("sglang_spec_tree_verify_steps_total") == len(lengths)
    for depth in range(1, SHAPE[2] + 1):
        name = f'sglang_spec_tree_accepted_drafts_total{{position="{depth}"}}'
        assert grew(name) == sum(1 for length in lengths if length - 1 >= depth), depth


def test_faults_on_one_rank_fall_back_on_every_rank(tiny_cpu, server_logs, prompts, plain_one_rank, monkeypatch):
    """Rank 1 alone raises in every third draft and in every second verify step's fused accept (its stages in
    turn). Draft: rank 0, which drafted, hears of it and verifies the filler tree too; without that agreement the
    verify forward adds rank 1's part of the filler tokens to rank 0's part of the real tree (on the code before it
    the server aborted at the first fault). Accept: on a sampled batch every rank takes SGLang's accept with rank 1
    (the two accepts broadcast rank 0's in different layouts: before the agreement a sampled batch's fault on rank
    1 crashed its scheduler with an IndexError); greedy batches broadcast nothing and may mix the two."""
    from sglang_spec.sglang_plugin.faults import ACCEPT_FAULT_ENV, FAULT_ENV, FAULT_RANK_ENV

    monkeypatch.setenv(FAULT_ENV, "3")
    monkeypatch.setenv(ACCEPT_FAULT_ENV, "2")
    monkeypatch.setenv(FAULT_RANK_ENV, "1")
    extra = tree_args(*SHAPE) + SEED + ["--tp-size", "2", "--enable-metrics", "--speculative-tree-accept", "fused"]
    with running_server(tiny_cpu, server_logs, "tiny-tp2-rank1-faults", extra) as server:
        greedy = server.generate(prompts, GREEDY, timeout=TIMEOUT)
        metrics = server.request("/metrics")
        sampled = server.generate(prompts, SAMPLED, timeout=TIMEOUT)
        again = server.generate(prompts[:1], GREEDY, timeout=TIMEOUT)
    log = server.log_path.read_text(errors="replace")
    assert [answer["output_ids"] for answer in greedy] == plain_one_rank
    assert all(len(answer["output_ids"]) == MAX_NEW_TOKENS for answer in sampled)
    assert again[0]["output_ids"] == plain_one_rank[0]
    heard = counted_draft_faults(metrics, "FaultOnAnotherRank")  # counted on rank 0, which injected nothing
    assert heard is not None and heard > 0, metrics[-2000:]
    assert counted_draft_faults(metrics, "InjectedFault") is None
    lines = [line for line in log.splitlines() if "draft fault" in line]
    assert any("(InjectedFault" in line for line in lines) and any("(FaultOnAnotherRank" in line for line in lines)
    accepts = [line for line in log.splitlines() if "accept fault in accept" in line]
    assert any("(InjectedFault" in line for line in accepts)  # rank 1
    assert any("on every rank (FaultOnAnotherRank" in line for line in accepts)  # rank 0, on a sampled batch
