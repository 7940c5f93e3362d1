"""No request takes a server down: request bodies drawn by Hypothesis (``request_bodies``: the generate routes'
schemas plus hostile values, streams closed early, clients that hang up) go to the servers that share this module
(SmolLM2 + its shipped head, the parity tests' context of 512): plain decoding and ``hybrid`` with
``--speculative-tree-auto --speculative-tree-accept fused`` (the planner, context and head trees, the fused accept);
by hand (``SGLANG_SPEC_FUZZ_EXAMPLES`` set) also ``sequoia`` with the fused accept. After every body, on every
server: an answer came (2xx or 4xx, never 5xx, within ``fuzz_client.ANSWER_TIMEOUT_S``), ``/health`` answers, and a
body delivered whole gets the same status from each; a greedy one the same outputs (``fuzz_client.outcome``;
``Send.exact`` says which bodies SGLang's speculative decoding itself answers otherwise).
The servers' logs hold no traceback when they stop (``running_server``).

Each request that killed a server or got a 500 before the plugin's checks (``hooks.requests``) has its regression
test here (``REGRESSIONS``), on the same servers: a 400 in one line, and the server alive after it.

The suite sends ``EXAMPLES`` bodies (derandomized: the same ones every run). By hand, many more, drawn afresh::

    SGLANG_SPEC_FUZZ_EXAMPLES=500 .venv/bin/python -m pytest -p no:cacheprovider -q -s \\
        tests/sglang_server/test_request_fuzz.py -k test_fuzz

prints how many bodies each server answered with which status (``-s``); a failure names the body (Hypothesis's
``Falsifying example``), not shrunk (a dead server fails every later body).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings

from cpu_server_helpers import running_server
from fuzz_client import Answer, alive, deliver, outcome
from request_bodies import Send, sends
from sglang_spec_testbed.parity import PARITY_SERVER_ARGS, policy_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

EXAMPLES_ENV = "SGLANG_SPEC_FUZZ_EXAMPLES"
EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "16"))
LONG = EXAMPLES_ENV in os.environ
PLAIN = "plain"
SENT: Counter[tuple[str, int | None]] = Counter()  # (server, status) of every body sent
PASSED: set[tuple[str, str, bytes]] = set()  # (route, delivery, body) already passed: Hypothesis draws some twice


@pytest.fixture(scope="module")
def servers(smollm2_cpu, server_logs):
    """name -> port of the servers, plain first."""
    launches = {PLAIN: (list(PARITY_SERVER_ARGS), False),
                "hybrid-auto-fused": (policy_args("hybrid", smollm2_cpu.profile)
                                      + ["--speculative-tree-auto", "--speculative-tree-accept", "fused"], True)}
    if LONG:
        launches["sequoia-fused"] = (policy_args("sequoia-fused", smollm2_cpu.profile), True)
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(running_server(smollm2_cpu, server_logs, f"fuzz-{name}", args,
                                                        speculative=speculative)).port
               for name, (args, speculative) in launches.items()}
    print(f"\nrequest fuzzer: {sum(SENT.values())} bodies sent, by server and status: "
          f"{dict(sorted(SENT.items(), key=str))}")


def send_to_all(servers: dict[str, int], send: Send) -> dict[str, Answer]:
    """``send`` to every server in turn; each must answer (no 5xx, no hang) and stay up."""
    answers = {}
    for name, port in servers.items():
        try:
            answer = deliver(port, send)
        except TimeoutError as error:
            raise AssertionError(f"{name}: {error} for {send}") from None
        SENT[name, answer.status] += 1
        assert answer.status is None or answer.status < 500, f"{name}: {answer.status} {answer.text[-600:]}"
        assert alive(port), f"{name}: /health failed after {send}"
        answers[name] = answer
    return answers


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(send=sends())
def test_fuzz_no_body_takes_a_server_down_and_trees_answer_as_plain_decoding(servers, send):
    key = (send.route, send.delivery, send.encoded())
    if key in PASSED:  # not sent again (a failing body is: Hypothesis replays it to report it)
        return
    note(f"{send.route} {send.delivery} {send.encoded()[:2000]!r}")
    answers = send_to_all(servers, send)
    if send.delivery == "whole":
        plain = answers[PLAIN]
        for name, answer in answers.items():
            assert answer.status == plain.status, f"{name}: {answer.status}, plain {plain.status}: {answer.text[-400:]}"
            if send.exact():
                assert outcome(send.route, answer) == outcome(send.route, plain), f"{name}: differs from plain decoding"
    PASSED.add(key)


# ---------------------------------------------------------------------------------------------- regressions
GREEDY = {"max_new_tokens": 4, "temperature": 0}
EMPTY = "the prompt is empty (0 tokens)"
# name -> (what was sent, the start of the one line it gets now); before: the scheduler died, or a 500
REGRESSIONS = {
    "empty_text": (Send("/generate", {"text": "", "sampling_params": GREEDY}), EMPTY),
    "empty_batch_member": (Send("/generate", {"text": ["Hello", ""], "sampling_params": GREEDY}), EMPTY),
    "empty_ids_member": (Send("/generate", {"input_ids": [[1, 2], []], "sampling_params": GREEDY}), EMPTY),
    "empty_ids_streamed": (Send("/generate", {"input_ids": [[], [5]], "stream": True, "sampling_params": GREEDY}),
                           EMPTY),
    "empty_completion_member": (Send("/v1/completions", {"model": "default", "prompt": ["Hello", ""],
                                                         "max_tokens": 4}), EMPTY),
    "id_past_the_vocabulary": (Send("/generate", {"input_ids": [49152], "sampling_params": GREEDY}),
                               "input_ids holds token id 49152, outside this model's vocabulary"),
    "negative_id": (Send("/v1/completions", {"model": "default", "prompt": [5, -1], "max_tokens": 4}),
                    "input_ids holds token id -1"),
    "top_k_past_int32": (Send("/generate", {"text": "Hello", "sampling_params": {**GREEDY, "top_k": 2**40}}),
                         "top_k 1099511627776 is past the largest SGLang's sampler holds"),
    "top_logprobs_past_the_vocabulary": (Send("/generate", {"text": "Hello", "return_logprob": True,
                                                            "top_logprobs_num": 10**6, "sampling_params": GREEDY}),
                                         "top_logprobs_num 1000000 is more than this model's vocabulary"),
    "chat_top_logprobs_past_the_vocabulary": (Send("/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True,
        "top_logprobs": 10**6}), "top_logprobs_num 1000000 is more than"),
    "broken_stop_regex": (Send("/generate", {"text": "Hello", "sampling_params": {**GREEDY, "stop_regex": "(("}}),
                          "stop_regex '((' is not a regular expression"),
    "sampling_params_short_of_the_batch": (Send("/generate", {"text": ["Hello", "Hi"], "sampling_params": [GREEDY]}),
                                           "sampling_params holds 1 entries for 2 prompts"),
    "sampling_params_list_for_one_prompt": (Send("/generate", {"text": "Hello", "sampling_params": [GREEDY]}),
                                            "sampling_params is a list for a single prompt"),
    "logprob_list_short_of_the_batch": (Send("/generate", {"text": ["Hello", "Hi"], "return_logprob": [True],
                                                           "sampling_params": GREEDY}),
                                        "the request's fields do not fit its prompts"),
    "empty_input_embeds": (Send("/generate", {"input_embeds": [], "sampling_params": GREEDY}),
                           "input_embeds is empty"),
    # found by the fuzzer: the grammar ends after one token, the min_new_tokens penalty forbids the end there
    "grammar_ending_before_min_new_tokens": (Send("/generate", {"text": "Hello", "sampling_params": {
        **GREEDY, "ebnf": 'root ::= "a" | "b"', "min_new_tokens": 3}}),
        "the grammar ended the output before min_new_tokens (3) tokens"),
    # the OpenAI chat route's request model reads the body as an object before checking it: a 500
    "chat_body_not_an_object": (Send("/v1/chat/completions", b"[]"), "the body is a JSON array, not an object"),
    "chat_response_format_not_an_object": (Send("/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "response_format": "json"}), "response_format is a JSON string: give an object"),
    # n copies of the request's state before anything is scheduled: past 2**63 an OverflowError (500); 10**9, the
    # host's memory (not sent here: refused by the same check, tests/sglang_plugin/test_request_checks.py)
    "samples_past_the_cap": (Send("/generate", {"text": "Hello", "sampling_params": {**GREEDY, "n": 2**63}}),
                             "n = 9223372036854775808 samples a prompt is more than this server takes"),
    "chat_samples_past_the_cap": (Send("/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2**63}),
        "n = 9223372036854775808 samples a prompt"),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_a_request_that_took_a_server_down_is_refused_in_one_line(servers, name):
    send, message = REGRESSIONS[name]
    for server, answer in send_to_all(servers, send).items():
        refusal = outcome(send.route, answer)
        if "stream" in refusal:  # a stream that refuses: its error chunk
            (refusal,) = [{"status": 400, "error": error} for error in refusal["errors"]]
        assert refusal["status"] == 400 and str(refusal["error"]).startswith(message), (server, answer.text[-400:])
        assert "\n" not in str(refusal["error"]), refusal


def test_a_body_that_fits_still_gets_its_answer(servers):
    """The checks refuse nothing they should not: a batch of two prompts with one sampling_params each, ids at the
    vocabulary's edges, top logprobs, a valid stop_regex; the same answer from every server."""
    send = Send("/generate", {"input_ids": [[0, 5], [49151]], "return_logprob": True, "top_logprobs_num": 2,
                              "sampling_params": [GREEDY, {**GREEDY, "stop_regex": r"\d"}]})
    answers = send_to_all(servers, send)
    assert all(answer.status == 200 for answer in answers.values()), answers
    assert len({json.dumps(outcome(send.route, answer)) for answer in answers.values()}) == 1
