"""The bad-input corpus: files every reader of the project must answer with one line, made fresh in a folder.

Each entry is named for what is wrong with it; ``make_corpus(folder)`` writes them all and returns name -> path.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable

GOOD_PROFILE = {"rank_acceptance": [0.6, 0.2, 0.1]}
GOOD_COSTS = {"verify": {"1": 0.01, "2": 0.012, "5": 0.02}, "draft_level": 0.001, "step_overhead": 0.001,
              "prefix": 200, "device": "cpu torch.float32", "plain_token": 0.01}


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def head_with_header(mtp_header: object) -> bytes:
    """A valid safetensors file (one tiny tensor) whose sglang_spec header is ``mtp_header`` (any JSON, or a raw
    string when it is a str)."""
    raw = mtp_header if isinstance(mtp_header, str) else json.dumps(mtp_header)
    header = {"__metadata__": {"sglang_spec_mtp": raw},
              "enorm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return safetensors_bytes(header, b"\0\0\0\0")


# a valid per-source section of a profile (tree/profile.SourceCounts) for matches of up to 2 tokens
GOOD_SOURCES = {"lookup": [[[1, 2]] * 4] * 2, "mtp": [[[1, 2]] * 10] * 3, "both": [[1, 2]] * 2,
                "mtp_top1": [[1, 2]] * 3}



def _profile_with(sources: object) -> bytes:
    """An acceptance profile whose positional table is fine and whose ``sources`` section is ``sources``."""
    return json.dumps({"rank_acceptance": [0.5], "sources": sources}).encode()


GOOD_HEADER = {"format": "sglang_spec.mtp/1", "target_model_type": "deepseek_v3", "hidden_size": 64,
               "vocab_size": 512, "feedback": "pre_norm", "draft_vocab_size": 512, "metadata": {}}

CORPUS: dict[str, Callable[[], bytes]] = {
    # profiles (tree --acceptance, generate --acceptance)
    "profile-truncated.json": lambda: b'{"rank_acceptance": [0.5, 0.',
    "profile-huge-integer.json": lambda: b'{"rank_acceptance": [1' + b"0" * 400 + b"]}",
    "profile-too-many-digits.json": lambda: b'{"rank_acceptance": [' + b"9" * 5000 + b"]}",
    "profile-deep.json": lambda: b"[" * 50_000 + b"]" * 50_000,
    "profile-invalid-utf8.json": lambda: b'{"rank_acceptance": [0.5], "note": "\xff\xfe"}',
    "profile-nan.json": lambda: b'{"rank_acceptance": [NaN]}',
    "profile-rows-not-lists.json": lambda: b'{"rank_acceptance": [[0.5], 3]}',
    "profile-empty.json": lambda: b"",
    # cost caches (generate --auto --costs)
    "costs-not-json.json": lambda: b'{"verify": {"1": 0.01',
    "costs-list.json": lambda: b"[1, 2, 3]",
    "costs-missing-key.json": lambda: json.dumps({k: v for k, v in GOOD_COSTS.items() if k != "verify"}).encode(),
    "costs-unknown-key.json": lambda: json.dumps({**GOOD_COSTS, "speed": 3}).encode(),
    "costs-bad-size.json": lambda: json.dumps({**GOOD_COSTS, "verify": {"one": 0.01}}).encode(),
    "costs-negative.json": lambda: json.dumps({**GOOD_COSTS, "verify": {"1": -0.01}}).encode(),
    "costs-nan.json": lambda: json.dumps({**GOOD_COSTS, "draft_level": float("nan")}).encode(),
    "costs-string-times.json": lambda: json.dumps({**GOOD_COSTS, "step_overhead": "fast"}).encode(),
    "costs-empty-verify.json": lambda: json.dumps({**GOOD_COSTS, "verify": {}}).encode(),
    "costs-deep.json": lambda: b"[" * 50_000 + b"]" * 50_000,
    # heads (generate / calibrate --mtp, train --init)
    "head-empty.safetensors": lambda: b"",
    "head-random.safetensors": lambda: bytes(range(256)) * 8,
    "head-truncated.safetensors": lambda: head_with_header(GOOD_HEADER)[:-2],
    "head-header-not-json.safetensors": lambda: head_with_header("{not json"),
    "head-header-a-list.safetensors": lambda: head_with_header([1, 2]),
    "head-header-missing-size.safetensors": lambda: head_with_header(
        {k: v for k, v in GOOD_HEADER.items() if k != "hidden_size"}),
    "head-header-string-size.safetensors": lambda: head_with_header({**GOOD_HEADER, "hidden_size": "64"}),
    "head-header-bad-feedback.safetensors": lambda: head_with_header({**GOOD_HEADER, "feedback": "sideways"}),
    "head-header-bad-metadata.safetensors": lambda: head_with_header({**GOOD_HEADER, "metadata": [1]}),
    "head-no-header.safetensors": lambda: safetensors_bytes(
        {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0\0\0\0"),
    # prompts (traffic generate --prompts) and traffic (train / calibrate --traffic)
    "prompts-invalid-utf8.txt": lambda: b"hello \xff\xfe world\n",
    "prompts-empty.txt": lambda: b"\n\n",
    "prompts-a-list.jsonl": lambda: b"[1, 2]\n",
    "prompts-messages-a-string.jsonl": lambda: b'{"messages": "hello"}\n',
    "prompts-messages-no-role.jsonl": lambda: b'{"messages": [{"content": "hi"}]}\n',
    "prompts-domain-a-number.jsonl": lambda: b'{"prompt": "hi", "domain": 5}\n',
    "prompts-surrogate.jsonl": lambda: b'{"prompt": "\\ud800"}\n',
    "prompts-deep.jsonl": lambda: b"[" * 50_000 + b"]" * 50_000 + b"\n",
    "traffic-a-list.jsonl": lambda: b"[1, 2]\n",
    "traffic-a-string.jsonl": lambda: b'"completion"\n',
    "traffic-no-completion.jsonl": lambda: b'{"prompt": "hi"}\n',
    "traffic-both-prompts.jsonl": lambda: b'{"prompt": "hi", "messages": [], "completion": "x"}\n',
    "traffic-deep.jsonl": lambda: b"[" * 50_000 + b"]" * 50_000 + b"\n",
    "traffic-invalid-utf8.jsonl": lambda: b'{"prompt": "\xff", "completion": "x"}\n',
    "traffic-surrogate.jsonl": lambda: b'{"prompt": "\\udc80", "completion": "x"}\n',
    "traffic-empty.jsonl": lambda: b"",
    # profiles whose per-source section is damaged (generate --policy lookup | hybrid --acceptance)
    "sources-truncated.json": lambda: b'{"rank_acceptance": [0.5], "sources": {"lookup": [[[1, 2]',
    "sources-a-list.json": lambda: _profile_with([1, 2]),
    "sources-missing-key.json": lambda: _profile_with({k: v for k, v in GOOD_SOURCES.items() if k != "both"}),
    "sources-wrong-shape.json": lambda: _profile_with({**GOOD_SOURCES, "mtp": [[[1, 2]]]}),
    "sources-accepted-past-offered.json": lambda: _profile_with({**GOOD_SOURCES, "both": [[3, 2]] * 2}),
    "sources-nan.json": lambda: _profile_with({**GOOD_SOURCES, "both": [[float("nan"), 2]] * 2}),
    "sources-huge-integer.json": lambda: _profile_with(GOOD_SOURCES).replace(b"[1, 2]", b"[1" + b"0" * 400 + b", 2]",
                                                                             1),
    "sources-invalid-utf8.json": lambda: b'{"rank_acceptance": [0.5], "sources": {"lookup": "\xff"}}',
    "a-file": lambda: b"not a folder\n",
}


def make_corpus(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in CORPUS.items():
        path = folder / name
        path.write_bytes(make())
        paths[name] = path
    fifo = folder / "a-fifo"
    os.mkfifo(fifo)
    paths["a-fifo"] = fifo
    return paths
