"""Capture from a live SGLang server: each prompt's answer and the target's final hidden states, into a captured
dataset (``train/capture.py``). The client speaks HTTP only (``/generate``); it never loads the target.

The server must be launched with ``--enable-return-hidden-states`` (or ``--return-hidden-states-mode full``);
each request then asks for ``return_hidden_states: true`` and SGLang answers ``meta_info.hidden_states`` =
[the prompt's states, [P][d]] followed by one [d] state per decode step: P + N - 1 rows for N answer tokens,
the output head's input at each position (post final norm for the Llama and DeepSeek-V3 families).

Prompts are tokenised here with the model folder's tokenizer (chat template for chat prompts, as the trainer
does) and sent as token ids, so the dataset's tokens are exactly what the server computed on. A prompt whose
prefix the server had cached comes back with fewer prompt states (SGLang returns states only for the tokens it
computed): that is refused, and the server must run with ``--disable-radix-cache`` while capturing.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from sglang_spec.errors import SpecError, brief
from sglang_spec.train.capture import CaptureManifest, CapturedSequence, CaptureWriter
from sglang_spec.train.prompts import PromptSpec


@dataclass(frozen=True)
class CaptureSettings:
    """The sampling of the answers and how requests and shards are batched."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 8
    shard_size: int = 64
    seed: int = 0


@dataclass(frozen=True)
class CaptureSummary:
    captured: int  # sequences captured by this run
    skipped: int  # prompts already in the dataset (a resumed capture)
    tokens: int  # tokens of the sequences captured by this run
    sequences: int  # sequences in the dataset now
    shards: int


def encode_prompt(tokenizer: Any, chat: bool, spec: PromptSpec) -> list[int]:
    """The prompt's token ids as the trainer encodes them (``train/records.py``)."""
    if spec.messages is not None and chat:
        return list(tokenizer.apply_chat_template(list(spec.messages), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    if spec.messages is not None:
        return list(tokenizer.encode("\n".join(message["content"] for message in spec.messages)))
    return list(tokenizer.encode(spec.prompt))


def check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise SpecError(f"--from-server {brief(url)}: give the server's URL, e.g. http://127.0.0.1:30000")
    return url.rstrip("/")


def post_json(url: str, path: str, payload: dict[str, Any] | None, timeout: float) -> Any:
    """POST (GET when ``payload`` is None) to the server; its JSON answer, or one line saying what went wrong
    (SGLang's own error message for a refused request)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail)
        except (ValueError, AttributeError):
            pass
        raise SpecError(f"{url}{path} refused the request (HTTP {error.code}: "
                        f"{' '.join(str(detail).split())[:300]})") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise SpecError(f"cannot reach {url} ({reason}); is the SGLang server running?") from None
    try:
        return json.loads(body)
    except ValueError:
        raise SpecError(f"{url}{path} answered something that is not JSON: {brief(body)}") from None


class ChunkedPromptStates(SpecError):
    """An answer with states for the last prefill chunk of its prompt only: SGLang split the prompt across steps
    (a batch's prompts together past ``--chunked-prefill-size``); sent alone, a prompt under that size is whole."""


def _hidden_rows(answer: dict[str, Any], prompt_length: int, prompt_id: str) -> torch.Tensor:
    """[P + N - 1, d] float32 from one answer's ``meta_info.hidden_states``."""
    meta = answer.get("meta_info") or {}
    states = meta.get("hidden_states")
    if not isinstance(states, list) or not states:
        raise SpecError("the server returned no hidden states; launch it with --enable-return-hidden-states")
    prompt_states = states[0]
    if len(prompt_states) != prompt_length:
        cached = meta.get("cached_tokens")
        if cached:
            raise SpecError(f"{prompt_id}: the server returned {len(prompt_states)} prompt hidden states for "
                            f"{prompt_length} prompt tokens ({cached} were cached, and SGLang returns states only "
                            f"for the tokens it computes); launch it with --disable-radix-cache for capturing")
        raise ChunkedPromptStates(f"{prompt_id}: the server returned {len(prompt_states)} prompt hidden states for "
                                  f"{prompt_length} prompt tokens (it prefilled the prompt in chunks and returns "
                                  f"states of the last chunk only); launch it with --chunked-prefill-size above "
                                  f"{prompt_length}")
    try:
        return torch.tensor([*prompt_states, *states[1:]], dtype=torch.float32)
    except (TypeError, ValueError):
        raise SpecError(f"{prompt_id}: the server's hidden states are not a table of numbers") from None


def to_sequence(spec: PromptSpec, prompt: list[int], answer: Any) -> CapturedSequence | None:
    """The captured sequence of one answer (None for an empty answer: nothing to train on)."""
    if not isinstance(answer, dict):
        raise SpecError(f"{spec.id}: the server's answer is not a JSON object")
    meta = answer.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise SpecError(f"{spec.id}: the server aborted the request ({brief(finish.get('message'), 200)})")
    output = answer.get("output_ids")
    if not isinstance(output, list) or not all(isinstance(token, int) for token in output):
        raise SpecError(f"{spec.id}: the server's answer has no output_ids list")
    if not output:
        return None
    hidden = _hidden_rows(answer, len(prompt), spec.id)
    tokens = torch.tensor(prompt + output, dtype=torch.int64)
    if hidden.shape[0] != len(tokens) - 1:
        raise SpecError(f"{spec.id}: {hidden.shape[0]} hidden states for {len(prompt)} prompt and {len(output)} "
                        f"answer tokens; expected {len(tokens) - 1}")
    return CapturedSequence(spec.id, spec.domain, tokens, len(prompt), hidden)


def capture_from_server(
    url: str,
    prompts: Sequence[PromptSpec],
    encoded: Sequence[list[int]],
    manifest: CaptureManifest,
    out: Path,
    settings: CaptureSettings,
    progress: bool = True,
) -> CaptureSummary:
    """Sends the prompts not yet in ``out`` to the server in batches and stores each answer as it comes.
    ``encoded``: each prompt's token ids; ``manifest``: the dataset's model and dtype (``source`` filled here)."""
    url = check_url(url)
    info = post_json(url, "/model_info", None, timeout=30)
    served_type = info.get("model_type") if isinstance(info, dict) else None
    if served_type is not None and served_type != manifest.model_type:
        raise SpecError(f"{url} serves a {served_type} model, but {manifest.model} is {manifest.model_type}; "
                        f"give the --model the server runs")
    sampling = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature}
    served_path = info.get("model_path") if isinstance(info, dict) else None
    source = {**manifest.source, "server": url, "server_model_path": served_path,
              "sampling": sampling, "seed": settings.seed}
    writer = CaptureWriter(out, CaptureManifest(**{**manifest.__dict__, "source": source}), settings.shard_size)
    pending = [index for index, spec in enumerate(prompts) if spec.id not in writer.done]
    skipped = len(prompts) - len(pending)
    captured = tokens = 0
    bar = tqdm(total=len(prompts), initial=skipped, desc="capturing", unit="prompt", disable=not progress)
    try:
        for start in range(0, len(pending), settings.batch_size):
            batch = pending[start : start + settings.batch_size]
            payload = {"input_ids": [encoded[index] for index in batch], "return_hidden_states": True,
                       "sampling_params": {**sampling, "sampling_seed": settings.seed}
                       if settings.temperature > 0 else sampling}
            answers = post_json(url, "/generate", payload, timeout=3600)
            answers = answers if isinstance(answers, list) else [answers]
            if len(answers) != len(batch):
                raise SpecError(f"the server answered {len(answers)} of {len(batch)} requests")
            for index, answer in zip(batch, answers):
                try:
                    sequence = to_sequence(prompts[index], encoded[index], answer)
                except ChunkedPromptStates:
                    if len(batch) == 1:
                        raise
                    # chunked beside the batch's other prompts: alone it is prefilled whole (or refused in one line)
                    alone = post_json(url, "/generate", {**payload, "input_ids": [encoded[index]]}, timeout=3600)
                    alone = (alone or [None])[0] if isinstance(alone, list) else alone
                    sequence = to_sequence(prompts[index], encoded[index], alone)
                if sequence is not None:
                    writer.add(sequence)
                    captured += 1
                    tokens += len(sequence.tokens)
            bar.update(len(batch))
    finally:
        writer.flush()  # what was captured stays, also on an error or Ctrl-C
        bar.close()
    return CaptureSummary(captured, skipped, tokens, writer.manifest.num_sequences, len(writer.manifest.shards))
