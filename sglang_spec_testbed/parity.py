"""What the server tests and the GPU server checks hold a tree server to plain decoding with: every kind of /generate
request and the bad bodies (``request_set``), the tree servers (``POLICIES``, ``tree_args``), the raw-text prompts
whose continuation repeats their context, the accept lengths an answer reports, and the HTTP client pieces
(refusals as answers, 32 concurrent requests, a stream closed early, a client that disconnects, waiting for an idle
server).

The plain server (``tests/sglang_server/conftest.py``, ``smollm2_plain_runs``) answers the set once, as the oracle,
so it runs with the same ``--context-length`` as the tree servers (``PARITY_SERVER_ARGS``).
``bench/gpu_server_checks.py`` sends the same set to the same servers on a GPU.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# Raw-text prompts whose continuation repeats their own context (code following a pattern, records extracted into
# a format the prompt shows): what SGLang's NGRAM drafts from. Decoded greedily for REPEAT_NEW_TOKENS tokens.
REPEAT_CONTEXT_PROMPTS = (
    "class Person:\n    def get_name(self):\n        return self.name\n\n    def get_age(self):\n"
    "        return self.age\n\n    def get_city(self):\n        return self.city\n\n    def get_email(self):\n",
    "Alice Moreau lives in Paris. Bob Lindqvist lives in Stockholm. Carol Mendes lives in Lisbon.\n"
    "As JSON:\n[{\"name\": \"Alice Moreau\", \"city\": \"Paris\"}, {\"name\": \"",
    "- id: 101, status: shipped, total: 12.50\n- id: 102, status: pending, total: 8.75\n"
    "- id: 103, status: shipped, total: 20.00\n\nThe same orders as a table:\n| id | status | total |\n",
)
REPEAT_NEW_TOKENS = 32


def tree_args(policy: str, budget: int, depth: int, topk: int, profile: Path | None = None) -> list[str]:
    args = ["--speculative-tree-policy", policy, "--speculative-tree-budget", str(budget),
            "--speculative-tree-depth", str(depth)]
    if policy != "chain":
        args += ["--speculative-tree-topk", str(topk)]
    if policy == "sequoia":
        assert profile is not None
        args += ["--speculative-acceptance-profile", str(profile)]
    return args


def accept_lengths(answers: list[dict]) -> list[int]:
    """Per-verify-step accept lengths (accepted drafts + 1) from SGLang's per-request histograms: entry k of
    ``spec_correct_drafts_histogram`` counts the steps that accepted k drafts."""
    lengths: list[int] = []
    for answer in answers:
        histogram = answer["meta_info"].get("spec_correct_drafts_histogram") or []
        for drafts, count in enumerate(histogram):
            lengths += [drafts + 1] * int(count)
    return lengths


CONTEXT_LENGTH = 512  # every server of the parity test, and the plain oracle: the near-limit prompt is measured on it
PARITY_SERVER_ARGS = ("--context-length", str(CONTEXT_LENGTH))
NEW_TOKENS = 16
FREE_POSITIONS = 7  # the near-limit prompt leaves this many positions: fewer than any tree of the test verifies (8-16);
# SGLang takes a prompt up to its context length - 7 (max_req_input_len), and caps its output at 5 tokens there
TOP_LOGPROBS = 4
# a tree server's logprobs come from its verify forward (13-16 tree tokens through extend attention with a tree
# mask), plain decoding's from a one-token decode forward: the float32 sums run in another order. They differ by
# ~1e-5 here (the test prints the largest); an error of meaning (another node's logits, a penalty on the wrong
# tokens) moves a logprob by far more than this
LOGPROB_TOLERANCE = 1e-3
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"]}
ANSWER_REGEX = r"(Yes|No), because [a-z ,]{1,60}\."

CONCURRENT = 32  # requests sent at once, cycling through the set
# name -> (policy, budget, depth, topk, extra options); trees of 8-16 verified tokens, all above FREE_POSITIONS
POLICIES = {
    "chain": ("chain", 7, 7, 1, ()),
    "eagle": ("eagle", 15, 4, 4, ()),
    "sequoia": ("sequoia", 15, 4, 4, ()),
    "specexec": ("specexec", 15, 4, 4, ()),
    "hybrid": ("hybrid", 12, 5, 0, ()),
    "lookup": ("lookup", 12, 5, 0, ()),
    "sequoia-fused": ("sequoia", 15, 4, 4, ("--speculative-tree-accept", "fused")),
    # SGLang's overlap scheduler kept (the bed's OVERLAP_ENV): output ids lag a step, the plugin completes them
    # (every step for a context tree; the penalised batches' steps for the head's trees)
    "hybrid-overlap": ("hybrid", 12, 5, 0, ()),
    "sequoia-overlap": ("sequoia", 15, 4, 4, ()),
    "sequoia-fused-overlap": ("sequoia", 15, 4, 4, ("--speculative-tree-accept", "fused")),
}


def policy_args(name: str, profile: Path | None) -> list[str]:
    """The tree options of POLICIES[name] and PARITY_SERVER_ARGS (``profile``: the head's acceptance profile)."""
    policy, budget, depth, topk, extra = POLICIES[name]
    if policy in ("hybrid", "lookup"):  # the context trees' width is the policy's own (test_context_trees.py)
        args = ["--speculative-tree-policy", policy, "--speculative-tree-budget", str(budget),
                "--speculative-tree-depth", str(depth), "--speculative-acceptance-profile", str(profile)]
    else:
        args = tree_args(policy, budget, depth, topk, profile)
    return args + list(extra) + list(PARITY_SERVER_ARGS)


@dataclass(frozen=True)
class Case:
    """One /generate request of the set: its name (the feature it covers) and its JSON body."""

    name: str
    body: dict[str, Any]


def greedy(max_new_tokens: int = NEW_TOKENS, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def chat_ids(tokenizer, content: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def near_limit_ids(tokenizer) -> list[int]:
    """A raw-text prompt of CONTEXT_LENGTH - FREE_POSITIONS tokens (records that repeat, so trees accept)."""
    line = "The order {} shipped on day {} and the invoice {} was paid in full.\n"
    ids: list[int] = []
    index = 0
    while len(ids) < CONTEXT_LENGTH:
        ids += tokenizer(line.format(100 + index, index % 7 + 1, 900 + index), add_special_tokens=False)["input_ids"]
        index += 1
    return ids[: CONTEXT_LENGTH - FREE_POSITIONS]


def request_set(tokenizer, heldout: list[list[int]]) -> list[Case]:
    """Every feature once (``heldout``: chat prompts as token ids); the first is what a server must answer after
    an abort."""
    _, people, orders = REPEAT_CONTEXT_PROMPTS
    return [
        Case("greedy", {"input_ids": heldout[0], "sampling_params": greedy()}),
        # the stop string ends the first record of the JSON list the prompt starts, about 10 tokens in
        Case("stop", {"text": people, "sampling_params": greedy(stop=["}, {"])}),
        Case("max_new_tokens_1", {"input_ids": heldout[1], "sampling_params": greedy(1)}),
        Case("max_new_tokens_2", {"input_ids": heldout[1], "sampling_params": greedy(2)}),
        Case("logprobs", {"input_ids": heldout[2], "sampling_params": greedy(), "return_logprob": True,
                          "top_logprobs_num": TOP_LOGPROBS}),
        # a table whose rows repeat: the penalty changes the greedy output (checked on the plain server)
        Case("frequency_penalty", {"text": orders, "sampling_params": greedy(20, frequency_penalty=0.8)}),
        Case("json_schema", {"input_ids": chat_ids(tokenizer, "Describe a person as JSON with a name and an age."),
                             "sampling_params": greedy(24, json_schema=json.dumps(PERSON_SCHEMA))}),
        Case("regex", {"input_ids": chat_ids(tokenizer, "Is the sea salty? Answer yes or no, and say why."),
                       "sampling_params": greedy(20, regex=ANSWER_REGEX)}),
        Case("n_2", {"text": people, "sampling_params": greedy(n=2)}),
        # answered in 7 tokens and an EOS: ignore_eos decodes on past it (into what the chat template follows it with)
        Case("ignore_eos", {"input_ids": chat_ids(tokenizer, "What is 2 + 2? Answer with the number only."),
                            "sampling_params": greedy(ignore_eos=True)}),
        Case("near_context_limit", {"input_ids": near_limit_ids(tokenizer),
                                    "sampling_params": greedy(FREE_POSITIONS)}),
    ]


def unpenalised(case: Case) -> Case:
    params = {key: value for key, value in case.body["sampling_params"].items() if key != "frequency_penalty"}
    return Case(f"{case.name}_off", {**case.body, "sampling_params": params})


def long_case(tokenizer) -> Case:
    """A request that would run far longer than the abort tests wait (ignore_eos to near the context's end)."""
    ids = chat_ids(tokenizer, "Write a long story about a lighthouse keeper.")
    return Case("long", {"input_ids": ids, "sampling_params": greedy(CONTEXT_LENGTH - len(ids) - 8, ignore_eos=True)})


def bad_bodies(tokenizer) -> dict[str, bytes]:
    """Bodies /generate must refuse, identically with and without trees."""
    too_long = near_limit_ids(tokenizer) + [198] * (FREE_POSITIONS - 4)
    return {
        "malformed_json": b'{"text": "Hello", "sampling_params": {"max_new_tokens": 4',
        "negative_max_new_tokens": json.dumps({"text": "Hello", "sampling_params": greedy(-1)}).encode(),
        "top_p_above_1": json.dumps({"text": "Hello", "sampling_params": greedy(4, top_p=1.5)}).encode(),
        "past_the_context": json.dumps({"input_ids": too_long, "sampling_params": greedy(16)}).encode(),
    }


# ---------------------------------------------------------------------------------------------- HTTP
def post(port: int, path: str, body: bytes, timeout: float = 600.0) -> tuple[int, Any]:
    """(status, decoded JSON or text) for any status: a refusal is an answer here, not an exception."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def answer_or_error(port: int, case: Case) -> Any:
    """The answer, or the refusal as ``{"status": ..., "body": ...}`` (compared like an answer)."""
    status, answer = post(port, "/generate", json.dumps(case.body).encode())
    return answer if status == 200 else {"status": status, "body": answer}


def generate(port: int, case: Case) -> Any:
    status, answer = post(port, "/generate", json.dumps(case.body).encode())
    assert status == 200, f"{case.name}: status {status}: {answer}"
    return answer


def concurrent(port: int, cases: list[Case]) -> list[tuple[str, Any]]:
    """CONCURRENT requests cycling through the set, all sent at once; (case name, answer) in submission order."""
    mixed = [cases[(index * 5) % len(cases)] for index in range(CONCURRENT)]  # 5 is prime to the set's size
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        answers = list(pool.map(lambda case: answer_or_error(port, case), mixed))
    return [(case.name, answer) for case, answer in zip(mixed, answers)]


def _send(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _close(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@dataclass(frozen=True)
class StreamRead:
    """What a client read of a stream before it closed the socket.

    chunks: the data chunks read, the stream's end marker (``data: [DONE]``) not among them; a socket read may
        bring several chunks at once, so at least the number asked for unless the stream ended first.
    ended: whether the stream's end marker was read (the request ran to its end before the client closed).
    """

    chunks: int
    ended: bool


def stream_and_close(port: int, case: Case, chunks: int) -> StreamRead:
    """A streaming request closed once ``chunks`` data chunks were read (or the stream ended)."""
    sock = _send(port, json.dumps({**case.body, "stream": True}).encode())
    received = b""
    try:
        while received.count(b"data: ") < chunks:
            data = sock.recv(65536)
            if not data:
                break
            received += data
    finally:
        _close(sock)
    ended = b"data: [DONE]" in received
    return StreamRead(received.count(b"data: ") - int(ended), ended)


def disconnect_before_answer(port: int, case: Case, seconds: float) -> None:
    """A non-streaming request whose client closes its socket ``seconds`` after sending it."""
    sock = _send(port, json.dumps(case.body).encode())
    try:
        time.sleep(seconds)
    finally:
        _close(sock)


def wait_idle(port: int, timeout: float) -> None:
    """Until the scheduler holds no request (SGLang's /flush_cache succeeds only then); raises past ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if post(port, "/flush_cache", b"")[0] == 200:
            return
        time.sleep(0.5)
    raise AssertionError(f"the server still held requests {timeout:.0f} s after the client left")


def plain_oracle(port: int, tokenizer, heldout: list[list[int]]) -> dict[str, Any]:
    """What the plain server answers: each request of the set alone (``single``), the penalised one without its
    penalty (``unpenalised``: the penalty must matter), and the bad bodies (``refusals``)."""
    cases = request_set(tokenizer, heldout)
    penalised = next(case for case in cases if case.name == "frequency_penalty")
    return {"single": {case.name: answer_or_error(port, case) for case in cases},
            "unpenalised": answer_or_error(port, unpenalised(penalised)),
            "refusals": {name: post(port, "/generate", body) for name, body in bad_bodies(tokenizer).items()}}


# ---------------------------------------------------------------------------------------------- comparison
def comparable(answer: Any) -> Any:
    """What must be identical: per output (n > 1 gives a list), ids, text, finish reason, token count, and the
    logprobs' token ids; a refusal as a whole. The logprob values go apart (``logprob_values``)."""
    if isinstance(answer, list):
        return [comparable(one) for one in answer]
    if "status" in answer:
        return answer
    meta = answer["meta_info"]
    out = {"output_ids": answer["output_ids"], "text": answer.get("text"), "finish_reason": meta["finish_reason"],
           "completion_tokens": meta["completion_tokens"]}
    if "output_token_logprobs" in meta:
        out["logprob_ids"] = [entry[1] for entry in meta["output_token_logprobs"]]
        # no top logprobs asked for, or no token (max_new_tokens 0): SGLang may leave the key out
        tops = meta.get("output_top_logprobs")
        out["top_logprob_ids"] = None if tops is None else [[entry[1] for entry in top] for top in tops]
    return out


def logprob_values(answer: Any) -> list[float]:
    if isinstance(answer, list):
        return [value for one in answer for value in logprob_values(one)]
    meta = answer.get("meta_info", {})
    if "output_token_logprobs" not in meta:
        return []
    return ([entry[0] for entry in meta["output_token_logprobs"]]
            + [entry[0] for top in meta["output_top_logprobs"] for entry in top])


def assert_same(name: str, got: Any, expected: Any) -> float:
    """Identical where it must be; returns the largest logprob difference (asserted within the tolerance)."""
    assert comparable(got) == comparable(expected), f"{name}: differs from plain decoding"
    got_values, expected_values = logprob_values(got), logprob_values(expected)
    assert len(got_values) == len(expected_values), name
    difference = max((abs(a - b) for a, b in zip(got_values, expected_values)), default=0.0)
    assert difference <= LOGPROB_TOLERANCE, f"{name}: a logprob differs by {difference:.2e}"
    return difference
