"""Traffic: what a deployment served, one request per JSONL line.

    {"id": "humaneval/3", "domain": "code", "messages": [{"role": "user", "content": "..."}],
     "completion": "...", "source": "generate smollm2 temperature=0.8", "meta": {...}}

Exactly one of ``prompt`` (raw text) or ``messages`` (chat messages before the completion) is given;
``completion`` is the target's own answer. Readers report every malformed line with its number; nothing is
dropped silently. Generated records name the model that wrote them (``meta.model``, and the ``source``);
``check_traffic_model`` refuses to train or calibrate one model on another's completions.

Writers are atomic (``sglang_spec.files``). ``traffic generate`` appends each finished record to ``OUT.partial``
(``PartialTraffic``) and renames it onto ``OUT`` at the end, so an interrupted run keeps its work and the same
command resumes it.

Importers: SGLang's JSON request log (``--log-requests --log-requests-format json --log-requests-level 3``:
``request.finished`` events carry the prompt text and the output text) and OpenAI-style chat logs (a line with
``messages`` ending in the assistant's answer, or ``request.messages`` + ``response.choices[0].message``, or
``prompt`` + ``completion``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable

from sglang_spec.errors import SpecError
from sglang_spec.files import atomic_write, check_input_file, check_output_path, parse_json, replace_file


@dataclass(frozen=True)
class TrafficRecord:
    id: str
    domain: str
    completion: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data: dict[str, Any] = {"id": self.id, "domain": self.domain}
        if self.messages is not None:
            data["messages"] = list(self.messages)
        else:
            data["prompt"] = self.prompt
        data["completion"] = self.completion
        if self.source:
            data["source"] = self.source
        if self.meta:
            data["meta"] = self.meta
        return json.dumps(data, ensure_ascii=False)

    @property
    def model(self) -> str | None:
        """The model whose completion this is: ``meta["model"]``, else the name in a ``generate MODEL
        temperature=T`` source; None for imported and reference records."""
        named = self.meta.get("model")
        if isinstance(named, str) and named:
            return named
        if self.source.startswith("generate ") and " temperature=" in self.source:
            return self.source[len("generate ") :].rsplit(" temperature=", 1)[0]
        return None


@dataclass(frozen=True)
class Problem:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def parse_messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list")
    result = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] needs a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            texts = [part.get("text", "") for part in content if isinstance(part, dict)]
            if not all(isinstance(text, str) for text in texts):
                raise ValueError(f"messages[{index}] has a content part whose 'text' is not a string")
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"messages[{index}] needs string 'content'")
        result.append({"role": message["role"], "content": content})
    return tuple(result)


def parse_record(data: Any, default_id: str) -> TrafficRecord:
    """One traffic line (already JSON-decoded) -> TrafficRecord; ValueError with the reason when malformed."""
    if not isinstance(data, dict):
        raise ValueError("a traffic line must be a JSON object")
    completion = data.get("completion")
    if not isinstance(completion, str):
        raise ValueError("missing string 'completion'")
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    if has_prompt and not isinstance(data["prompt"], str):
        raise ValueError("'prompt' must be a string")
    domain = data.get("domain", "general")
    if not isinstance(domain, str) or not domain:
        raise ValueError("'domain' must be a non-empty string")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("'meta' must be an object")
    record = TrafficRecord(
        id=str(data.get("id", default_id)),
        domain=domain,
        completion=completion,
        prompt=data["prompt"] if has_prompt else None,
        messages=parse_messages(data["messages"]) if has_messages else None,
        source=str(data.get("source", "")),
        meta=meta,
    )
    return _encodable(record)


def _encodable(record: TrafficRecord) -> TrafficRecord:
    """JSON can spell strings (unpaired surrogates, ``"\\ud800"``) that no tokenizer or UTF-8 file takes."""
    try:
        record.to_json().encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string in this record is not valid Unicode text (an unpaired surrogate)") from None
    return record


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    check_input_file(path, "traffic file")
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
    except OSError as error:
        raise SpecError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path} is not UTF-8 text") from None


def read_traffic(path: str | Path) -> tuple[list[TrafficRecord], list[Problem]]:
    """All well-formed records and a Problem for every malformed line."""
    path = Path(path)
    records, problems = [], []
    for number, line in _lines(path):
        try:
            records.append(parse_record(parse_json(line), f"{path.stem}:{number}"))
        except ValueError as error:
            problems.append(Problem(number, str(error)))
    return records, problems


def read_traffic_strict(paths: Iterable[str | Path]) -> list[TrafficRecord]:
    """Training input: any malformed line is an error (one line naming the first few)."""
    records = []
    for path in paths:
        good, problems = read_traffic(path)
        if problems:
            shown = "; ".join(str(problem) for problem in problems[:3])
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise SpecError(f"{path}: {len(problems)} malformed line(s): {shown}{more}; fix or remove them")
        records += good
    if not records:
        raise SpecError("no traffic records found")
    return records


def write_traffic(records: Iterable[TrafficRecord], path: str | Path, force: bool = False) -> int:
    """Writes ``records`` to ``path`` atomically (refused if it exists, unless ``force``); returns the count."""
    path = check_output_path(path, force)
    count = 0
    with atomic_write(path) as handle:
        for record in records:
            handle.write(record.to_json() + "\n")
            count += 1
    return count


def check_traffic_model(records: Iterable[TrafficRecord], model: str, allow_mismatch: bool = False) -> str | None:
    """Refuses records generated by another model than ``model`` (their completions are another model's
    distribution); with ``allow_mismatch`` returns a one-line warning instead. Records that name no model
    (imported, reference) pass."""
    others: dict[str, list[str]] = {}
    for record in records:
        source = record.model
        if source is not None and source != model:
            others.setdefault(source, []).append(record.id)
    if not others:
        return None
    name, ids = max(others.items(), key=lambda item: len(item[1]))
    count = sum(len(ids) for ids in others.values())
    message = (f"{count} traffic record(s) were generated by {name!r}, not {model!r} (e.g. {ids[0]!r})"
               + (f" and {len(others) - 1} other model(s)" if len(others) > 1 else ""))
    if allow_mismatch:
        return f"warning: {message}; using them anyway (--allow-model-mismatch)"
    raise SpecError(f"{message}; use {model}'s own traffic, or pass --allow-model-mismatch to use them anyway")


def partial_path(out: Path) -> Path:
    """Where ``traffic generate`` appends its finished records until it renames them onto ``out``."""
    return out.with_name(out.name + ".partial")


class PartialTraffic:
    """``OUT.partial``: records appended (flushed and fsynced) as they finish; ``finish()`` renames the file onto
    ``OUT``. ``done`` holds the records an earlier, interrupted run finished (a torn last line is cut off)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = partial_path(out)
        check_output_path(self.path, force=True, option="--out")
        self.done: list[TrafficRecord] = self._read_done()
        self._handle: IO[str] | None = None

    def _read_done(self) -> list[TrafficRecord]:
        if not self.path.exists():
            return []
        try:
            data = self.path.read_bytes()
        except OSError as error:
            raise SpecError(f"cannot read {self.path}: {error.strerror}") from None
        complete = data[: data.rfind(b"\n") + 1]  # a line without its newline was being written when stopped
        if len(complete) != len(data):
            try:
                with open(self.path, "r+b") as handle:
                    handle.truncate(len(complete))
            except OSError as error:
                raise SpecError(f"cannot repair {self.path}: {error.strerror}") from None
        records, problems = read_traffic(self.path)
        if problems:
            raise SpecError(f"{self.path} (an interrupted run's records) has a malformed line ({problems[0]}); "
                            f"delete it to start over")
        return records

    def append(self, record: TrafficRecord) -> None:
        if self._handle is None:
            try:
                self._handle = open(self.path, "a", encoding="utf-8")
            except OSError as error:
                raise SpecError(f"cannot write {self.path}: {error.strerror}") from None
        try:
            self._handle.write(record.to_json() + "\n")
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as error:
            raise SpecError(f"cannot write {self.path}: {error.strerror}") from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def finish(self) -> None:
        """All records are in: ``OUT.partial`` becomes ``OUT`` (atomically)."""
        self.close()
        if not self.path.exists():  # nothing was left to generate and nothing was done before
            self.path.touch()
        replace_file(self.path, self.out)


def import_sglang_log(path: str | Path, domain: str = "imported") -> tuple[list[TrafficRecord], list[Problem], int]:
    """``request.finished`` events of an SGLang JSON request log. Returns (records, problems, ignored events):
    ignored events are well-formed lines of other kinds (e.g. ``request.received``), counted, not problems."""
    path = Path(path)
    records, problems, ignored = [], [], 0
    for number, line in _lines(path):
        if "Finish: obj=" in line or "Receive: obj=" in line:
            problems.append(Problem(number, "text-format SGLang log; restart the server with "
                                            "--log-requests-format json --log-requests-level 3"))
            continue
        start = line.find("{")
        if start < 0:
            problems.append(Problem(number, "no JSON object on this line"))
            continue
        try:
            event = parse_json(line[start:])
        except ValueError as error:
            problems.append(Problem(number, str(error)))
            continue
        if not isinstance(event, dict) or "event" not in event:
            problems.append(Problem(number, "not an SGLang request-log event (no 'event' key)"))
            continue
        if event["event"] != "request.finished":
            ignored += 1
            continue
        request, outs = event.get("obj"), event.get("out")
        texts = request.get("text") if isinstance(request, dict) else None
        if isinstance(texts, str) and isinstance(outs, dict):
            pairs = [(texts, outs)]
        elif isinstance(texts, list) and isinstance(outs, list) and len(texts) == len(outs):
            pairs = list(zip(texts, outs))
        else:
            problems.append(Problem(number, "request.finished without prompt text (use --log-requests-level 3) "
                                            "or without output"))
            continue
        for index, (text, out) in enumerate(pairs):
            completion = out.get("text") if isinstance(out, dict) else None
            if not isinstance(text, str) or not isinstance(completion, str):
                problems.append(Problem(number, "request.finished entry without prompt or output text"))
                continue
            rid = event.get("rid")
            rid = (rid[index] if index < len(rid) else None) if isinstance(rid, list) else rid
            meta_info = out.get("meta_info") if isinstance(out, dict) else None
            record = TrafficRecord(
                id=str(rid or f"{path.stem}:{number}:{index}"), domain=domain, completion=completion, prompt=text,
                source=f"sglang log {path.name}",
                meta={"finish_reason": meta_info.get("finish_reason") if isinstance(meta_info, dict) else None},
            )
            try:
                records.append(_encodable(record))
            except ValueError as error:
                problems.append(Problem(number, str(error)))
    return records, problems, ignored


def import_openai_chat(path: str | Path, domain: str = "imported") -> tuple[list[TrafficRecord], list[Problem], int]:
    """OpenAI-style chat logs, one exchange per line. Returns (records, problems, 0)."""
    path = Path(path)
    records, problems = [], []
    for number, line in _lines(path):
        try:
            data = parse_json(line)
            records.append(_encodable(_openai_record(data, f"{path.stem}:{number}", domain, path.name)))
        except ValueError as error:
            problems.append(Problem(number, str(error)))
    return records, problems, 0


def _openai_record(data: Any, default_id: str, domain: str, source: str) -> TrafficRecord:
    if not isinstance(data, dict):
        raise ValueError("a chat-log line must be a JSON object")
    record_id = str(data.get("id", default_id))
    if "request" in data or "response" in data:
        request, response = data.get("request"), data.get("response")
        if not isinstance(request, dict) or not isinstance(response, dict):
            raise ValueError("'request' and 'response' must both be objects")
        messages = parse_messages(request.get("messages"))
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError("response.choices[0] is missing")
        message = choices[0].get("message")
        answer = message.get("content") if isinstance(message, dict) else None
        if not isinstance(answer, str):
            raise ValueError("response.choices[0].message.content is missing")
        return TrafficRecord(record_id, domain, answer, messages=messages, source=f"openai log {source}")
    if "messages" in data:
        messages = parse_messages(data["messages"])
        if messages[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's answer")
        if len(messages) < 2:
            raise ValueError("need at least one message before the assistant's answer")
        return TrafficRecord(record_id, domain, messages[-1]["content"], messages=messages[:-1],
                             source=f"openai log {source}")
    if isinstance(data.get("prompt"), str) and isinstance(data.get("completion"), str):
        return TrafficRecord(record_id, domain, data["completion"], prompt=data["prompt"],
                             source=f"openai log {source}")
    raise ValueError("expected 'messages', 'request'/'response', or 'prompt'/'completion'")
