"""Traffic: what a deployment served, one request per JSONL line.

    {"id": "humaneval/3", "domain": "code", "messages": [{"role": "user", "content": "..."}],
     "completion": "...", "source": "generate smollm2 temperature=0.8", "meta": {...}}

Exactly one of ``prompt`` (raw text) or ``messages`` (chat messages before the completion) is given;
``completion`` is the target's own answer. Readers report every malformed line with its number; nothing is
dropped silently.

Importers: SGLang's JSON request log (``--log-requests --log-requests-format json --log-requests-level 3``:
``request.finished`` events carry the prompt text and the output text) and OpenAI-style chat logs (a line with
``messages`` ending in the assistant's answer, or ``request.messages`` + ``response.choices[0].message``, or
``prompt`` + ``completion``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from sglang_spec.errors import SpecError


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


@dataclass(frozen=True)
class Problem:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list")
    result = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] needs a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
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
    return TrafficRecord(
        id=str(data.get("id", default_id)),
        domain=domain,
        completion=completion,
        prompt=data["prompt"] if has_prompt else None,
        messages=_messages(data["messages"]) if has_messages else None,
        source=str(data.get("source", "")),
        meta=meta,
    )


def _lines(path: Path) -> Iterable[tuple[int, str]]:
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
            records.append(parse_record(json.loads(line), f"{path.stem}:{number}"))
        except json.JSONDecodeError as error:
            problems.append(Problem(number, f"not JSON ({error.msg})"))
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
    path = Path(path)
    if path.exists() and not force:
        raise SpecError(f"{path} exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    temporary = path.with_suffix(path.suffix + ".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(record.to_json() + "\n")
            count += 1
    temporary.replace(path)
    return count


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
            event = json.loads(line[start:])
        except json.JSONDecodeError as error:
            problems.append(Problem(number, f"not JSON ({error.msg})"))
            continue
        if not isinstance(event, dict) or "event" not in event:
            problems.append(Problem(number, "not an SGLang request-log event (no 'event' key)"))
            continue
        if event["event"] != "request.finished":
            ignored += 1
            continue
        request, output = event.get("obj") or {}, event.get("out")
        texts, outs = request.get("text"), output
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
            rid = rid[index] if isinstance(rid, list) else rid
            records.append(TrafficRecord(
                id=str(rid or f"{path.stem}:{number}:{index}"), domain=domain, completion=completion, prompt=text,
                source=f"sglang log {path.name}",
                meta={"finish_reason": (out.get("meta_info") or {}).get("finish_reason")},
            ))
    return records, problems, ignored


def import_openai_chat(path: str | Path, domain: str = "imported") -> tuple[list[TrafficRecord], list[Problem], int]:
    """OpenAI-style chat logs, one exchange per line. Returns (records, problems, 0)."""
    path = Path(path)
    records, problems = [], []
    for number, line in _lines(path):
        try:
            data = json.loads(line)
            records.append(_openai_record(data, f"{path.stem}:{number}", domain, path.name))
        except json.JSONDecodeError as error:
            problems.append(Problem(number, f"not JSON ({error.msg})"))
        except ValueError as error:
            problems.append(Problem(number, str(error)))
    return records, problems, 0


def _openai_record(data: Any, default_id: str, domain: str, source: str) -> TrafficRecord:
    if not isinstance(data, dict):
        raise ValueError("a chat-log line must be a JSON object")
    record_id = str(data.get("id", default_id))
    if "request" in data or "response" in data:
        request, response = data.get("request") or {}, data.get("response") or {}
        messages = _messages(request.get("messages"))
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError("response.choices[0] is missing")
        answer = choices[0].get("message", {}).get("content")
        if not isinstance(answer, str):
            raise ValueError("response.choices[0].message.content is missing")
        return TrafficRecord(record_id, domain, answer, messages=messages, source=f"openai log {source}")
    if "messages" in data:
        messages = _messages(data["messages"])
        if messages[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's answer")
        if len(messages) < 2:
            raise ValueError("need at least one message before the assistant's answer")
        return TrafficRecord(record_id, domain, messages[-1]["content"], messages=messages[:-1],
                             source=f"openai log {source}")
    if isinstance(data.get("prompt"), str) and isinstance(data.get("completion"), str):
        return TrafficRecord(record_id, domain, data["completion"], prompt=data["prompt"], source=f"openai log {source}")
    raise ValueError("expected 'messages', 'request'/'response', or 'prompt'/'completion'")
