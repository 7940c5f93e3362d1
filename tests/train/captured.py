"""A captured dataset made without a server: the tiny DeepSeek's own hidden states on toy-language sequences
(what ``sglang-spec capture`` stores, computed by transformers instead of SGLang)."""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.train.capture import CaptureManifest, CapturedSequence, CaptureWriter


def tiny_manifest(model: str = "tiny-deepseek", dtype: str = "float16") -> CaptureManifest:
    return CaptureManifest(model, "deepseek_v3", 64, 512, dtype)


@torch.no_grad()
def toy_sequences(loaded, count: int, length: int = 24, prompt_length: int = 6, seed: int = 5
                  ) -> list[CapturedSequence]:
    """``count`` toy-language sequences of ``length`` tokens, the first ``prompt_length`` the prompt, with the
    model's final hidden states after each token but the last."""
    language = ToyLanguage(512, seed=123)  # the language tiny-deepseek was trained on
    torch.manual_seed(seed)
    tokens = language.sample(count, length)
    hidden = loaded.model.model(input_ids=tokens, use_cache=False).last_hidden_state
    return [CapturedSequence(f"toy/{index}", "toy", tokens[index], prompt_length, hidden[index, :-1])
            for index in range(count)]


def write_capture(folder: Path, sequences: list[CapturedSequence], shard_size: int = 4) -> Path:
    writer = CaptureWriter(folder, tiny_manifest(), shard_size)
    for sequence in sequences:
        writer.add(sequence)
    writer.flush()
    return folder
