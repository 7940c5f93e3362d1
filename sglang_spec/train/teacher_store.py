"""Soft targets kept per captured sequence across training runs (``sglang-spec train --capture ... --teacher-store
DIR``): a rolling window trains on mostly the same sequences round after round (``sglang-spec adapt``), and
without it every round computes the target's full-vocabulary softmax over every sequence's captured states again.

An entry is named by a digest of what its targets are a function of: the sequence's captured states (float16
bytes), the output head's weights, the draft vocabulary and ``top_k``; another model, head or vocabulary never
reads it. Entries are written atomically (a reader sees a whole file or none); one that cannot be read is computed
again. Reading an entry touches it, so a caller that keeps the folder bounded deletes what a run did not touch
(``prune_untouched``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from sglang_spec.errors import SpecError
from sglang_spec.files import atomic_path

SUFFIX = ".targets.pt"


class TeacherStore:
    """folder: where the entries live (created on the first write). ``salt``: the digest of the output head's
    weights [V, d], the draft vocabulary [Vd] (None: the full vocabulary) and ``top_k``, computed once."""

    def __init__(self, folder: Path, output_weight: torch.Tensor, draft_vocab: torch.Tensor | None,
                 top_k: int) -> None:
        self.folder = Path(folder)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{tuple(output_weight.shape)} {output_weight.dtype} {top_k}".encode())
        digest.update(_tensor_bytes(output_weight))
        if draft_vocab is not None:
            digest.update(_tensor_bytes(draft_vocab.to(torch.int64)))
        self.salt = digest.digest()

    def path_for(self, states: torch.Tensor) -> Path:
        """The entry of a sequence's captured states [L, d] (float16 as captured)."""
        digest = hashlib.blake2b(self.salt, digest_size=20)
        digest.update(_tensor_bytes(states.to(torch.float16)))
        return self.folder / f"{digest.hexdigest()}{SUFFIX}"

    def get(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [L, K] int32, probs [L, K] float16) kept for ``states``, touched; None when absent or unreadable."""
        path = self.path_for(states)
        try:
            entry = torch.load(path, map_location="cpu", weights_only=True)
            ids, probs = entry["ids"], entry["probs"]
            os.utime(path)
        except Exception:  # absent, damaged, foreign: whatever a load raises, the targets are computed again
            return None
        if ids.shape[0] != states.shape[0] or probs.shape != ids.shape:
            return None
        return ids, probs

    def put(self, states: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> None:
        """Keeps the targets of ``states``; a folder that cannot be written keeps nothing (the run goes on)."""
        path = self.path_for(states)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as partial:
                torch.save({"ids": ids, "probs": probs}, partial)
        except (OSError, SpecError):
            pass


def prune_untouched(folder: Path, since: float) -> int:
    """Deletes the entries in ``folder`` neither written nor read since ``since`` (a ``time.time()``); returns how
    many."""
    removed = 0
    for path in Path(folder).glob(f"*{SUFFIX}"):
        try:
            if path.stat().st_mtime < since:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's values as bytes (bfloat16 through its 16-bit pattern: numpy has no bfloat16)."""
    contiguous = tensor.detach().cpu().contiguous()
    if contiguous.dtype == torch.bfloat16:
        contiguous = contiguous.view(torch.int16)
    return contiguous.numpy().tobytes()
