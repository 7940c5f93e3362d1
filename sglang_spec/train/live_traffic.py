"""Live traffic for ``sglang-spec adapt``: the requests a server served, read as they finish, and their capture.

``TrafficTail`` follows the server's traffic log (``--speculative-tree-traffic-log``: one JSON line per finished
request, token ids; rotated to PATH.1 past a size) from a saved position: the file's inode and byte offset, so a
resumed loop reads on where it stopped and a rotation loses nothing (the rest of the rotated file first). Only
whole lines are read. A line that is not a served request is counted and skipped.

``capture_served`` turns served requests into captured sequences (``train/capture.py``) by one prefill each: the
request's prompt and answer sent back to the server as token ids with ``return_hidden_states`` and one new token,
so the server computes the target's final hidden state at every position of what it served (the server must run
with ``--enable-return-hidden-states --disable-radix-cache``, as for ``sglang-spec capture``). HTTP only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.train.capture import CapturedSequence
from sglang_spec.train.server_capture import post_json

ROTATED_SUFFIX = ".1"  # the plugin's traffic_log.ROTATED_SUFFIX
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # SGLang's own /health requests


@dataclass(frozen=True)
class ServedRequest:
    """One finished request of the log: rid, prompt token ids, answer token ids, the label of the head that
    drafted it (SGLang's weight version)."""

    rid: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    head: str


@dataclass(frozen=True)
class TailPosition:
    """Where the tail reads on: the log file's inode (0: not opened yet) and the offset in it."""

    inode: int = 0
    offset: int = 0


class TrafficTail:
    """Reads the requests appended to the traffic log since ``position``; ``encode`` turns a logged prompt text
    into token ids (the server's tokenizer), for requests that came as text."""

    def __init__(self, path: Path, encode: Callable[[str], list[int]], position: TailPosition = TailPosition(),
                 ) -> None:
        self.path = path
        self.encode = encode
        self.position = position
        self.skipped = 0  # lines that were not a usable served request

    def read(self, limit: int | None = None) -> list[ServedRequest]:
        """The whole lines appended since the last read (at most ``limit`` requests), the position moved past
        them."""
        requests: list[ServedRequest] = []
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return requests  # nothing served yet
        if self.position.inode and self.position.inode != stat.st_ino:
            rotated = self.path.with_name(self.path.name + ROTATED_SUFFIX)
            if rotated.exists() and rotated.stat().st_ino == self.position.inode:
                requests += self._read_file(rotated, self.position.offset, limit)
                if limit is not None and len(requests) >= limit:
                    return requests  # the rotated file's rest is read next time
            self.position = TailPosition(stat.st_ino, 0)
        if not self.position.inode:
            self.position = TailPosition(stat.st_ino, 0)
        left = None if limit is None else limit - len(requests)
        requests += self._read_file(self.path, self.position.offset, left)
        return requests

    def _read_file(self, path: Path, offset: int, limit: int | None) -> list[ServedRequest]:
        inode = path.stat().st_ino
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
        requests: list[ServedRequest] = []
        consumed = 0
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n") or (limit is not None and len(requests) >= limit):
                break  # a line still being written, or enough for now
            consumed += len(raw)
            request = self._parse(raw)
            if request is None:
                self.skipped += 1
            else:
                requests.append(request)
        self.position = TailPosition(inode, offset + consumed)
        return requests

    def _parse(self, raw: bytes) -> ServedRequest | None:
        try:
            line = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(line, dict) or str(line.get("rid", "")).startswith(HEALTH_CHECK_PREFIX):
            return None
        output, prompt = line.get("output_ids"), line.get("input_ids")
        if not isinstance(output, list) or not _token_list(output):
            return None
        if not isinstance(prompt, list) or not _token_list(prompt):
            text = line.get("text")
            if not isinstance(text, str):
                return None
            prompt = self.encode(text)
            if len(prompt) != line.get("prompt_tokens"):  # tokenised otherwise than the server did: unusable
                return None
        return ServedRequest(str(line.get("rid")), tuple(prompt), tuple(output), str(line.get("head")))


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(token, int) and token >= 0 for token in value)


def capture_served(url: str, requests: Sequence[ServedRequest], domain: str, max_tokens: int,
                   hidden_size: int) -> list[CapturedSequence]:
    """Each served request with the target's final hidden states, computed by the server in one prefill of its
    whole prompt and answer, of which the last ``max_tokens`` tokens are kept (the answer and the end of the prompt:
    a long prompt would otherwise leave no answer to learn from; the states still saw the whole prompt). One batch
    request."""
    if not requests:
        return []
    sequences = [list(request.prompt + request.output) for request in requests]
    payload = {"input_ids": sequences, "return_hidden_states": True,
               "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    answers = post_json(url, "/generate", payload, timeout=3600)
    answers = answers if isinstance(answers, list) else [answers]
    if len(answers) != len(requests):
        raise SpecError(f"{url} answered {len(answers)} of {len(requests)} capture requests")
    captured = []
    for request, tokens, answer in zip(requests, sequences, answers):
        states = ((answer or {}).get("meta_info") or {}).get("hidden_states") if isinstance(answer, dict) else None
        if not isinstance(states, list) or not states:
            raise SpecError(f"{url} returned no hidden states; launch it with --enable-return-hidden-states")
        rows = states[0]
        if len(rows) != len(tokens):
            raise SpecError(f"{url} returned {len(rows)} hidden states for {len(tokens)} tokens (SGLang returns "
                            f"states only for the tokens it computes); launch it with --disable-radix-cache")
        first = max(0, len(tokens) - max_tokens)
        hidden = torch.tensor(rows[first : len(tokens) - 1], dtype=torch.float32)
        if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
            raise SpecError(f"{url} returned hidden states of size {tuple(hidden.shape)[1:]}, not {hidden_size}: "
                            f"it serves another model")
        kept = tokens[first:]
        start = min(max(len(request.prompt) - first, 1), len(kept) - 1)
        if len(request.prompt) < 1 or len(kept) < 3:
            continue
        captured.append(CapturedSequence(f"{request.rid}", domain, torch.tensor(kept, dtype=torch.int64), start,
                                         hidden))
    return captured


def position_to_json(position: TailPosition) -> dict[str, int]:
    return {"inode": position.inode, "offset": position.offset}


def position_from_json(data: Any) -> TailPosition:
    if not isinstance(data, dict):
        return TailPosition()
    inode, offset = data.get("inode"), data.get("offset")
    if not isinstance(inode, int) or not isinstance(offset, int) or inode < 0 or offset < 0:
        return TailPosition()
    return TailPosition(inode, offset)


def disk_free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize
