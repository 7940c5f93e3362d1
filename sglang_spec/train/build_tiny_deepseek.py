"""The model behind ``--model tiny-deepseek``: the tiny DeepSeek-V3 architecture (``models/tiny_deepseek.py``)
trained for a few minutes on a seeded toy language, with its MTP layer distilled from it, built once and cached.

A random model is a chaotic function that no one-layer head can predict; the toy-trained one gives real
acceptance rates.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from sglang_spec.decode.decoder import GenerationConfig, generate_plain
from sglang_spec.models.cache_dir import build_lock, cache_root
from sglang_spec.models.tiny_deepseek import (
    TINY_DEEPSEEK_CONFIG,
    build_tiny_deepseek,
    complete_checkpoint_config,
    save_tiny_deepseek,
)
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.train.distill import teacher_batch, unrolled_loss

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CACHE_NAME = "tiny-deepseek-v3-toy"
LANGUAGE_SEED = 123  # the toy language the cached model learnt (``train_tiny_deepseek``'s seed 0)
_COMPLETE = ".complete"


def train_tiny_deepseek(
    seed: int = 0, target_steps: int = 400, head_steps: int = 300, progress: bool = True
) -> tuple[PreTrainedModel, MTPHead]:
    """Trains the tiny model on the toy language, then distils its MTP head (unrolled 3 steps) on the model's own
    greedy and sampled continuations plus toy text.

    One thread: the model is so small that a second thread only waits, and on a busy machine the waiting made a
    step 5-20x slower (2.6 s instead of 0.14 s per step measured on a shared 2-core CPU: a 17-minute build). One
    thread also makes the build the same on every machine. About three minutes on a busy 2-core CPU."""
    language = ToyLanguage(TINY_DEEPSEEK_CONFIG["vocab_size"], seed=LANGUAGE_SEED + seed)
    bar = tqdm(total=target_steps + head_steps, desc="building tiny-deepseek (once)", disable=not progress)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, head = _train(language, seed, target_steps, head_steps, bar)
    finally:
        torch.set_num_threads(threads)
    bar.close()
    return model, head


def _train(
    language: ToyLanguage, seed: int, target_steps: int, head_steps: int, bar: tqdm
) -> tuple[PreTrainedModel, MTPHead]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_tiny_deepseek(seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(target_steps):
            batch = language.sample(32, 48)
            loss = model(input_ids=batch, labels=batch).loss
            _descend(optimizer, loss, bar)
            bar.set_postfix(target_loss=f"{loss.item():.3f}")
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        head = MTPHead.for_target(model)
        prompts = [language.sample(1, 4 + index % 8)[0].tolist() for index in range(64)]
        sequences = language.sample(64, 56).tolist()
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
            output = generate_plain(model, prompts, GenerationConfig(max_new_tokens=48, sampling=sampling, seed=seed))
            sequences += [prompt + request.tokens for prompt, request in zip(prompts, output.requests)]
        optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
        for _ in range(head_steps):
            rows = torch.randint(len(sequences), (16,))
            loss, metrics = unrolled_loss(head, teacher_batch(model, head, [sequences[row] for row in rows]), unroll=3)
            _descend(optimizer, loss, bar)
            bar.set_postfix(head_top1=f"{metrics.top1[0]:.2f}")
    head.eval()
    for parameter in head.parameters():
        parameter.requires_grad_(False)
    return model, head


def _descend(optimizer: torch.optim.Optimizer, loss: torch.Tensor, bar: tqdm) -> None:
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    bar.update()


def tiny_deepseek_dir(cache: Path | None = None, progress: bool = True) -> Path:
    """The toy-trained tiny DeepSeek-V3 checkpoint (with its MTP layer), built and cached on first use."""
    target = (cache or cache_root()) / CACHE_NAME
    if not (target / _COMPLETE).exists():
        with build_lock(target):
            if not (target / _COMPLETE).exists():  # another process may have built it while this one waited
                _build(target, progress)
    complete_checkpoint_config(target)
    return target


def _build(target: Path, progress: bool) -> None:
    model, head = train_tiny_deepseek(progress=progress)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-deepseek-"))
    try:
        save_tiny_deepseek(scratch, model, head)
        (scratch / _COMPLETE).write_text("toy-trained tiny DeepSeek-V3 with a distilled MTP layer\n")
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)  # an interrupted build leaves nothing half-made
        raise
