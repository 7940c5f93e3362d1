"""Parity under load: every kind of request SGLang's /generate serves must get from a tree server what plain decoding
gives it, through the real server on this CPU (SmolLM2 + shipped head).

The oracle is the session's plain server (conftest.py ``smollm2_plain_runs``, no speculation, the same
``--context-length``), each request alone (``sglang_spec_testbed/parity.py``): greedy decoding, a stop string,
max_new_tokens 1 and 2, logprobs with top logprobs, a frequency penalty, a JSON schema, a regex, n = 2, ignore_eos (past
an EOS), and a prompt within a tree's length of the context limit (7 free positions; every tree here verifies 8-16
tokens). Then one server per policy (chain, hybrid, lookup, sequoia with the fused accept, hybrid with SGLang's overlap
scheduler, the GPU's default loop, which SGLang turns off for speculative servers on a CPU: ``OVERLAP_ENV`` keeps
it, and the requests' output ids then lag a step behind each tree; and sequoia with the fused accept, the overlap
scheduler and SGLang's decode graph runner, the graph stood in (``sglang_spec_testbed/graphs.py``): each batch
padded to the captured size above it and its greedy accept computed inside the replayed verify graph, as R1's
servers would run it; with ``SGLANG_SPEC_PARITY_FULL=1`` also eagle, specexec, sequoia with SGLang's accept and
with the overlap scheduler, whose trees take the same paths as sequoia's and chain's with other shapes), in
the GPU's FULL_MASK tree-mask layout (``SGLANG_SPEC_CPU_TREE_MASK=full``; the log must show FULL_MASK masks built
and read and no QLEN_ONLY one, as test_full_mask.py checks NGRAM's; the bed's other servers run the CPU's
QLEN_ONLY), answers:

* 32 concurrent requests cycling through those kinds (a thread pool; 8 run at a time, the rest queue);
* a streaming request closed once 3 chunks arrived, then a client that disconnects a second after sending its
  request: the server must drop each (idle again well before the request could have run to its end) and then answer
  a normal request as plain decoding does;
* bad bodies (malformed JSON, a negative max_new_tokens, top_p above 1, a prompt plus max_new_tokens past the
  context length): the plain server's status and error;
* with ``SGLANG_SPEC_PARITY_FULL=1`` also every request alone first (batch 1), and the plain server's own 32
  concurrent requests.

Greedy everywhere, so every answer must be token-identical: output ids, text, finish reason and, with logprobs, the
chosen and top-logprob token ids; logprob values to ``LOGPROB_TOLERANCE`` (why: sglang_spec_testbed/parity.py). Each
server must not log a traceback (``running_server``), which also covers SGLang's idle memory check: a KV slot or request
row an aborted request leaked raises in the scheduler.

The plain server's own answers to concurrent requests are not the oracle: SGLang's plain decoding gives the
penalised request other greedy outputs when it shares batches with other requests (three different ones among 32,
and one of those alone with ``--disable-overlap-schedule``); its answer alone, with SGLang's default overlap
scheduler, is plain decoding's (the penalty over every earlier output token, checked against transformers), and
is what a tree server must give, alone or batched.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from cpu_server_helpers import accept_lengths, assert_full_masks_only, running_server
from sglang_spec_testbed.parity import (
    ANSWER_REGEX,
    CONCURRENT,
    CONTEXT_LENGTH,
    FREE_POSITIONS,
    NEW_TOKENS,
    PARITY_SERVER_ARGS,
    POLICIES,
    TOP_LOGPROBS,
    Case,
    answer_or_error,
    assert_same,
    bad_bodies,
    comparable,
    concurrent,
    disconnect_before_answer,
    generate,
    long_case,
    policy_args,
    post,
    request_set,
    stream_and_close,
    wait_idle,
)
from sglang_spec_testbed.graphs import GRAPHS_ENV, replays_in
from sglang_spec_testbed.patches import OVERLAP_ENV
from sglang_spec_testbed.tree_mask import TREE_MASK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

FULL = os.environ.get("SGLANG_SPEC_PARITY_FULL") == "1"
GRAPHS = "-graphs"  # a served name's suffix: the server replays decode graphs (captured for GRAPH_BATCH_SIZES)
GRAPH_BATCH_SIZES = ("1", "2", "4", "8")  # 8 requests run at a time: every batch size pads to one of these
# the suite's servers: one per path through the plugin (SGLang's loop, the own loop with the fused accept, context
# trees with and without the head, the overlap loop, the overlap loop with decode graphs); FULL adds the head's
# other tree shapes
SERVED = [*POLICIES, "sequoia-fused-overlap" + GRAPHS] if FULL else [
    "chain", "lookup", "hybrid", "sequoia-fused", "hybrid-overlap", "sequoia-fused-overlap" + GRAPHS]


def served_args(name: str, profile) -> list[str]:
    """A served name's launch options: its policy's (``POLICIES``), and the decode graphs for a ``GRAPHS`` name."""
    graphs = name.endswith(GRAPHS)
    args = policy_args(name.removesuffix(GRAPHS), profile)
    return args + (["--cuda-graph-backend-decode", "full", "--cuda-graph-bs-decode", *GRAPH_BATCH_SIZES]
                   if graphs else [])


@dataclass
class Run:
    """What one server answered, phase by phase; a phase that raised keeps its error (each test reports its own)."""

    name: str
    single: dict[str, Any] = field(default_factory=dict)
    concurrent: list[tuple[str, Any]] = field(default_factory=list)
    aborts: dict[str, Any] = field(default_factory=dict)
    refusals: dict[str, list] = field(default_factory=dict)  # [status, body], as the oracle's come back
    errors: dict[str, BaseException] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    log: str = ""

    def phase(self, name: str) -> None:
        if name in self.errors:
            raise AssertionError(f"{self.name}: the {name} phase failed") from self.errors[name]


def serve(run: Run, port: int, cases: list[Case], bodies: dict[str, bytes], long: Case, single: bool) -> None:
    phases = [
        ("concurrent", lambda: run.concurrent.extend(concurrent(port, cases))),
        ("aborts", lambda: run.aborts.update(aborts(port, cases[0], long))),
        ("refusals", lambda: run.refusals.update({key: list(post(port, "/generate", body))
                                                   for key, body in bodies.items()})),
    ]
    if single:
        phases.insert(0, ("single", lambda: run.single.update({case.name: answer_or_error(port, case)
                                                               for case in cases})))
    for phase, action in phases:
        began = time.monotonic()
        try:
            action()
        except Exception as error:  # noqa: BLE001 - reported by the phase's test
            run.errors[phase] = error
        run.seconds[phase] = time.monotonic() - began


def aborts(port: int, after: Case, long: Case) -> dict[str, Any]:
    """A stream closed after 3 chunks, then a client gone a second after sending its request: the seconds from
    sending each to the server's being idle, against what the request would take to finish (``after``'s seconds
    a token, times the long request's tokens); then ``after``'s answer."""
    began = time.monotonic()
    stream = stream_and_close(port, long, 3)
    wait_idle(port, 120)
    stream_seconds = time.monotonic() - began
    began = time.monotonic()
    disconnect_before_answer(port, long, 1.0)
    wait_idle(port, 120)
    disconnect_seconds = time.monotonic() - began
    began = time.monotonic()
    answer = generate(port, after)
    per_token = (time.monotonic() - began) / answer["meta_info"]["completion_tokens"]
    return {"stream": stream, "stream_seconds": stream_seconds, "disconnect_seconds": disconnect_seconds,
            "long_seconds": per_token * long.body["sampling_params"]["max_new_tokens"], "after": answer}


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer(smollm2_cpu):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_cpu.target_dir)


@pytest.fixture(scope="module")
def oracle(smollm2_plain_runs) -> dict[str, Any]:
    return smollm2_plain_runs["parity"]


@pytest.fixture(scope="module")
def requests(tokenizer, smollm2_prompts) -> dict[str, Any]:
    return {"cases": request_set(tokenizer, smollm2_prompts), "bodies": bad_bodies(tokenizer),
            "long": long_case(tokenizer)}


@pytest.fixture(scope="module")
def plain_concurrent(smollm2_cpu, server_logs, requests) -> Run:
    """SGLANG_SPEC_PARITY_FULL=1: a plain server's own answers to the concurrent requests (a diagnostic)."""
    if not FULL:
        pytest.skip("SGLANG_SPEC_PARITY_FULL=1 runs the plain server's concurrent requests")
    run = Run("plain")
    with running_server(smollm2_cpu, server_logs, "parity-plain", PARITY_SERVER_ARGS, speculative=False) as server:
        run.concurrent.extend(concurrent(server.port, requests["cases"]))
    return run


@pytest.fixture(scope="module", params=SERVED)
def tree_run(request, smollm2_cpu, server_logs, requests, oracle) -> Run:
    """One server per policy, every phase against it once."""
    run = Run(request.param)
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as monkeypatch:
        # SGLang looks for a gone client of a non-streaming request every this many seconds (default 4)
        monkeypatch.setenv("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", "1")
        monkeypatch.setenv(TREE_MASK_ENV, "full")  # the GPU's layout
        if request.param.removesuffix(GRAPHS).endswith("-overlap"):  # the GPU's default scheduler loop too
            monkeypatch.setenv(OVERLAP_ENV, "1")
        if request.param.endswith(GRAPHS):
            monkeypatch.setenv(GRAPHS_ENV, "1")
        with running_server(smollm2_cpu, server_logs, f"parity-{request.param}",
                            served_args(request.param, smollm2_cpu.profile)) as server:
            run.seconds["start"] = time.monotonic() - start
            serve(run, server.port, requests["cases"], requests["bodies"], requests["long"], single=FULL)
    run.seconds["total"] = time.monotonic() - start
    run.log = server.log_path.read_text(errors="replace")
    print(f"\n{run.name}: " + ", ".join(f"{key} {value:.1f} s" for key, value in run.seconds.items()))
    return run


# ---------------------------------------------------------------------------------------------- tests
def differences(name: str, answers: list[tuple[str, Any]], oracle: dict[str, Any]) -> tuple[list[str], float]:
    """Every answer against the oracle's: the failures (all of them, not only the first) and the largest logprob
    difference among the answers that agree."""
    failures, largest = [], 0.0
    for case, answer in answers:
        expected = oracle["single"][case]
        try:
            largest = max(largest, assert_same(f"{name} {case}", answer, expected))
        except AssertionError as error:
            failures.append(f"{error}:\n  plain: {comparable(expected)}\n  tree:  {comparable(answer)}")
    return failures, largest


def test_the_request_set_exercises_every_feature(oracle, tokenizer):
    """On the plain server: each request does what it is there for (a vacuous case would compare nothing)."""
    single = oracle["single"]
    assert single["stop"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "}, {"}
    assert len(single["max_new_tokens_1"]["output_ids"]) == 1 and len(single["max_new_tokens_2"]["output_ids"]) == 2
    meta = single["logprobs"]["meta_info"]
    assert len(meta["output_token_logprobs"]) == NEW_TOKENS
    assert all(len(top) == TOP_LOGPROBS for top in meta["output_top_logprobs"])
    assert single["frequency_penalty"]["output_ids"] != oracle["unpenalised"]["output_ids"]
    person = json.loads(single["json_schema"]["text"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(ANSWER_REGEX, single["regex"]["text"]), single["regex"]["text"]
    assert len(single["n_2"]) == 2
    ignored = single["ignore_eos"]
    assert len(ignored["output_ids"]) == NEW_TOKENS and tokenizer.eos_token_id in ignored["output_ids"][:-1]
    # SGLang caps the near-limit request at the context's end: context - 1 - prompt - 1 tokens
    near = single["near_context_limit"]
    assert near["meta_info"]["prompt_tokens"] == CONTEXT_LENGTH - FREE_POSITIONS
    assert near["meta_info"]["completion_tokens"] == FREE_POSITIONS - 2
    assert {status for status, _ in oracle["refusals"].values()} == {400}, oracle["refusals"]


def test_32_concurrent_mixed_requests_answer_as_plain_decoding(tree_run, oracle):
    tree_run.phase("concurrent")
    assert len(tree_run.concurrent) == CONCURRENT
    failures, largest = differences(f"{tree_run.name} concurrent", tree_run.concurrent, oracle)
    assert not failures, "\n".join(failures)
    print(f"\n{tree_run.name}: largest logprob difference from plain decoding {largest:.2e}")
    lengths = accept_lengths([answer for _, answer in tree_run.concurrent
                              if isinstance(answer, dict) and "meta_info" in answer])
    assert lengths and max(lengths) >= 2, f"{tree_run.name}: no draft was accepted ({lengths})"


def test_the_server_built_and_read_full_masks_only(tree_run):
    topk = POLICIES[tree_run.name.removesuffix(GRAPHS)][3]
    assert_full_masks_only(tree_run.name, tree_run.log, built=True, read=topk != 1)


def test_the_overlap_server_completed_every_output_that_lagged(tree_run):
    """The ``-overlap`` server ran SGLang's overlap loop (the output ids lag a step) and every verify's tokens
    completed the next step's penalties and context trees: no output was left unknown (``committed``; an unknown
    one falls back to SGLang's relaxed penalties, which the penalised request's answer would show). The others
    ran the synchronous loop, SGLang's rule for speculative servers on a CPU."""
    overlap = tree_run.name.removesuffix(GRAPHS).endswith("-overlap")
    assert ("'disable_overlap_schedule': False" in tree_run.log) is overlap
    completes = "overlap scheduler: each verify's committed tokens complete the next step's penalties"
    assert (completes in tree_run.log) is overlap
    assert "could not be completed from its last verify" not in tree_run.log


def test_the_graph_server_replayed_batches_padded_to_their_graphs(tree_run):
    """The ``-graphs`` server's verify steps ran on SGLang's graph runner, some of them on a graph captured for a
    larger batch (its padded rows beside the answers checked above), and the fused accept was read from the
    replayed graph; the others ran none."""
    replays = replays_in(tree_run.log)
    if not tree_run.name.endswith(GRAPHS):
        assert not replays
        return
    assert replays and any(batch < captured for batch, captured in replays), replays
    assert "fused accept: the greedy accept read from a replayed verify graph" in tree_run.log


def test_each_request_alone_answers_as_plain_decoding(tree_run, oracle):
    if not FULL:
        pytest.skip("SGLANG_SPEC_PARITY_FULL=1 sends every request alone too (the concurrent ones cover each kind)")
    tree_run.phase("single")
    failures, _ = differences(tree_run.name, list(tree_run.single.items()), oracle)
    assert not failures, "\n".join(failures)


def test_aborted_and_disconnected_requests_leave_the_server_serving(tree_run, oracle):
    """Each abort frees the server well before the request could have run to its end, and the server then answers
    as plain decoding does."""
    tree_run.phase("aborts")
    aborted = tree_run.aborts
    print(f"\n{tree_run.name}: idle {aborted['stream_seconds']:.1f} s after the stream began, "
          f"{aborted['disconnect_seconds']:.1f} s after the disconnecting request was sent; the request would take "
          f"about {aborted['long_seconds']:.0f} s")
    # closed mid-stream: one socket read may bring several chunks, so three or more were read, never the end
    assert aborted["stream"].chunks >= 3 and not aborted["stream"].ended, aborted["stream"]
    assert aborted["stream_seconds"] < aborted["long_seconds"] / 2
    assert aborted["disconnect_seconds"] < aborted["long_seconds"] / 2
    assert_same(f"{tree_run.name} after the aborts", aborted["after"], oracle["single"]["greedy"])


def test_bad_bodies_are_refused_as_the_plain_server_refuses_them(tree_run, oracle):
    tree_run.phase("refusals")
    assert tree_run.refusals == oracle["refusals"]


def test_the_plain_servers_own_concurrent_answers(plain_concurrent, oracle):
    """SGLANG_SPEC_PARITY_FULL=1, a diagnostic: the plain server's concurrent answers against its single ones. All
    agree but the penalised request's (SGLang's plain decoding, see the module's docstring), which is printed."""
    failures, _ = differences("plain concurrent", plain_concurrent.concurrent, oracle)
    print("\n" + "\n".join(failures))
    assert all("frequency_penalty" in failure.splitlines()[0] for failure in failures)
