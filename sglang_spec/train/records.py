"""Traffic records as the token sequences a head trains and calibrates on, and the stable train / eval split.

A record is tokenised as the server saw it: the prompt (through the chat template when the record has messages
and the model has one), then the completion and the end-of-turn token. Drafting happens inside the completion,
so ``completion_start`` marks where it begins.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from sglang_spec.models.loading import LoadedModel
from sglang_spec.train.traffic import TrafficRecord


@dataclass(frozen=True)
class EncodedRecord:
    """tokens: prompt + completion + end of turn; completion_start: index of the first completion token."""

    id: str
    tokens: list[int]
    completion_start: int

    @property
    def first_drafted(self) -> int:
        """The first position whose next token a served step drafts: the prefill answers the first completion
        token, so drafting starts at the one after it. Evaluations that should say what a server accepts count
        the positions from here on."""
        return self.completion_start + 1


def encode_record(loaded: LoadedModel, record: TrafficRecord, seq_len: int) -> EncodedRecord:
    if record.messages is not None and loaded.chat:
        prompt = list(loaded.tokenizer.apply_chat_template(list(record.messages), add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
    elif record.messages is not None:
        prompt = list(loaded.tokenizer.encode("\n".join(m["content"] for m in record.messages)))
    else:
        prompt = list(loaded.tokenizer.encode(record.prompt))
    encode = getattr(loaded.tokenizer, "encode")
    try:
        completion = list(encode(record.completion, add_special_tokens=False))
    except TypeError:  # tokenizers without the keyword (ByteTokenizer)
        completion = list(encode(record.completion))
    end = list(loaded.eos_token_ids[:1])
    tokens = (prompt + completion + end)[:seq_len]
    return EncodedRecord(record.id, tokens, min(len(prompt), len(tokens)))


def split_key(record_id: str) -> str:
    """Generated records are ``{prompt id}/{greedy|sampleN|reference}``: every completion of one prompt lands in
    the same split."""
    return record_id.rsplit("/", 1)[0] if "/" in record_id else record_id


def is_eval_record(record_id: str, fraction: float) -> bool:
    """A stable split by prompt (CRC32 of the split key), so resumed and repeated runs agree."""
    return (zlib.crc32(split_key(record_id).encode()) % 10_000) < fraction * 10_000
