"""``--speculative-tree-traffic-log PATH``: what a server served, as token ids, for ``sglang-spec adapt`` to learn from.

Every finished generate request appends one JSON line to PATH (written by SGLang's tokenizer manager as it answers,
``hooks.adapt.finished_request_after``):

    {"rid": "...", "input_ids": [...] | null, "text": "..." | null, "output_ids": [...], "prompt_tokens": P,
     "head": "<served head label>"}

``input_ids`` when the client sent token ids (the chat endpoints do), else the prompt ``text`` (``adapt`` tokenises
it and keeps it only when it gives ``prompt_tokens`` ids). Left out: requests that asked for hidden states
(``adapt``'s own captures), aborted requests, and answers whose ``output_ids`` are not the whole answer (an
incrementally streamed request's last chunk). The file is bounded: past ``MAX_BYTES`` it is renamed to PATH.1
(replacing the previous one) and a new PATH starts, so the log holds at most twice that; a reader that follows
PATH by its inode finishes PATH.1 first (``train/live_traffic.py``).

No sglang import here.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.messages import log

OPTION = "--speculative-tree-traffic-log"
ATTRIBUTE = "_sglang_spec_traffic_log"  # on ServerArgs: the path; on SGLang's RequestLogger: the TrafficLog
MAX_BYTES = 64 * 2**20
ROTATED_SUFFIX = ".1"


def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("served traffic for sglang-spec adapt (sglang_spec)")
    group.add_argument(OPTION, default=None, metavar="PATH",
                       help="append each finished request's prompt and output token ids to this JSONL file (at "
                            f"most {MAX_BYTES // 2**20} MiB, then rotated to PATH{ROTATED_SUFFIX}), what "
                            "`sglang-spec adapt` captures and trains on")


def checked_path(value: Any) -> Path | None:
    """The log's path from the option's value (None: no log), or one line saying why it cannot be written."""
    if value is None:
        return None
    path = Path(str(value))
    if path.is_dir():
        raise SpecError(f"{OPTION} {path} is a folder; give a file path")
    if not path.parent.is_dir():
        raise SpecError(f"{OPTION} {path}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SpecError(f"{OPTION} {path} cannot be written")
    return path


def entry(obj: Any, out: dict[str, Any], head: str) -> dict[str, Any] | None:
    """The line for one finished request (``obj``: SGLang's GenerateReqInput for one request, ``out``: its answer),
    or None for a request the log leaves out."""
    if getattr(obj, "return_hidden_states", False):
        return None
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return None
    output_ids = out.get("output_ids")
    if not isinstance(output_ids, list) or not output_ids or len(output_ids) != meta.get("completion_tokens"):
        return None
    input_ids, text = getattr(obj, "input_ids", None), getattr(obj, "text", None)
    if not (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], int)):
        input_ids = None
    if input_ids is None and not isinstance(text, str):
        return None
    return {"rid": str(getattr(obj, "rid", "")), "input_ids": input_ids,
            "text": None if input_ids is not None else text, "output_ids": output_ids,
            "prompt_tokens": meta.get("prompt_tokens"), "head": head}


class TrafficLog:
    """The appending writer (one per server, in the tokenizer manager's process). A write that fails (a full disk)
    is counted and said once, in one line; the server goes on serving."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.failed = 0
        self._lock = threading.Lock()

    def write(self, line: dict[str, Any]) -> bool:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                if self.path.exists() and self.path.stat().st_size + len(data) > self.max_bytes:
                    os.replace(self.path, self.path.with_name(self.path.name + ROTATED_SUFFIX))
                with open(self.path, "ab") as handle:  # whole lines: a reader stops at its last newline
                    handle.write(data)
                return True
            except OSError as error:
                self.failed += 1
                if self.failed == 1:
                    log(f"traffic log {self.path}: a request was not logged ({error.strerror or error}); the "
                        f"server goes on serving, later failures are counted only")
                return False
