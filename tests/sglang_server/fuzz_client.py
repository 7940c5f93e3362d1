"""The request fuzzer's client (``test_request_fuzz.py``): a ``request_bodies.Send`` delivered to a server as it
says (whole, a stream closed early, a hang-up), what of an answer must equal plain decoding's (``outcome``), and
whether the server is still up (``alive``)."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from request_bodies import Send
from sglang_spec_testbed.parity import comparable

ANSWER_TIMEOUT_S = 180.0  # a body's whole answer on the shared CPU; longer is a hang
# SGLang's /health answers 503 when its one-token generation takes over 20 s, which a scheduler starved of the shared
# CPU can take: a server is alive when /health answers 200 within this, asked again after each 503
ALIVE_WITHIN_S = 180.0


@dataclass(frozen=True)
class Answer:
    """What a server answered: ``status`` (None where the client left before reading it) and the body's text."""

    status: int | None
    text: str


def deliver(port: int, send: Send) -> Answer:
    """``send`` to the server on ``port``; raises ``TimeoutError`` past ``ANSWER_TIMEOUT_S`` (a hang)."""
    body = send.encoded()
    if send.delivery == "whole":
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=ANSWER_TIMEOUT_S)
        try:
            connection.request("POST", send.route, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return Answer(response.status, response.read().decode(errors="replace"))
        except socket.timeout as error:
            raise TimeoutError(f"no answer within {ANSWER_TIMEOUT_S:.0f} s") from error
        finally:
            connection.close()
    if send.delivery == "close_stream" and isinstance(send.body, dict):
        body = json.dumps({**send.body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S)
    try:
        sock.sendall(f"POST {send.route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if send.delivery == "hang_up":
            time.sleep(send.seconds)
            return Answer(None, "")
        received = b""
        while received.count(b"data: ") < send.chunks:  # 0 chunks: closed before the answer begins
            data = sock.recv(65536)
            if not data:
                break
            received += data
            if received.startswith(b"HTTP/") and not received.startswith(b"HTTP/1.1 200"):  # refused: no stream
                break
        status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/") else None
        return Answer(status, received.decode(errors="replace"))
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the server closed it first
            pass
        sock.close()


def alive(port: int) -> bool:
    """Whether SGLang's /health (200 once a one-token generation went through) answers 200 within
    ``ALIVE_WITHIN_S``; a refused connection (the server gone) is an answer at once."""
    deadline = time.monotonic() + ALIVE_WITHIN_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=ALIVE_WITHIN_S) as response:
                return response.status == 200
        except urllib.error.HTTPError as error:  # 503: the generation did not come back in time
            if error.code != 503 or time.monotonic() > deadline:
                return False
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False


# ---------------------------------------------------------------------------------------------- comparison
def outcome(route: str, answer: Answer) -> Any:
    """What must be identical between plain decoding and a tree server for a greedy body delivered whole: a refusal
    (status, message); per output its ids, text, finish reason and logprob token ids (``parity.comparable``; the
    OpenAI routes: text, finish reason, logprob tokens per choice); a stream as the outputs it assembles to."""
    if answer.status != 200:
        return {"status": answer.status, "error": _error_message(answer.text)}
    if answer.text.startswith("data:"):
        chunks = [json.loads(line[len("data: "):]) for line in answer.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [_error_message(json.dumps(chunk)) for chunk in chunks if "error" in chunk]
        outputs = [chunk for chunk in chunks if "error" not in chunk]
        assembled = _generate_stream(outputs) if route == "/generate" else _openai_stream(outputs)
        return {"stream": assembled, "errors": errors}
    payload = json.loads(answer.text)
    return comparable(payload) if route == "/generate" else _openai_choices(payload.get("choices", []))


def _error_message(text: str) -> Any:
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        return error.get("message", error) if isinstance(error, dict) else error
    return payload


def _generate_stream(chunks: list[dict]) -> list:
    """/generate's stream: every chunk holds its output so far; the last one per prompt (``index`` in a batch)."""
    final: dict[int, dict] = {}
    for chunk in chunks:
        final[chunk.get("index", 0)] = chunk
    return [comparable(final[index]) for index in sorted(final)]


def _openai_stream(chunks: list[dict]) -> list:
    """An OpenAI stream: each choice's deltas joined, its last finish reason, its logprob tokens."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            joined = choices.setdefault(choice["index"], {"text": "", "finish_reason": None, "tokens": []})
            delta = choice.get("delta")
            joined["text"] += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
            joined["finish_reason"] = choice.get("finish_reason") or joined["finish_reason"]
            joined["tokens"] += _logprob_tokens(choice.get("logprobs"))
    return [choices[index] for index in sorted(choices)]


def _openai_choices(choices: list[dict]) -> list:
    return [{"text": choice["message"].get("content") if "message" in choice else choice.get("text"),
             "finish_reason": choice.get("finish_reason"), "tokens": _logprob_tokens(choice.get("logprobs"))}
            for choice in sorted(choices, key=lambda choice: choice["index"])]


def _logprob_tokens(logprobs: Any) -> list:
    if not isinstance(logprobs, dict):
        return []
    if "content" in logprobs:  # chat
        return [entry.get("token") for entry in logprobs.get("content") or []]
    return list(logprobs.get("tokens") or [])  # completions
