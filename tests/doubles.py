"""Test doubles shared by the test suite: stand-ins for components whose real version needs a model."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.candidates import Candidates, CandidateSource, GrowingTree


class SyntheticCandidates(CandidateSource):
    """A seeded stand-in drafter: the next-token distribution after a path is a softmax of Gaussian logits
    (scaled by ``sharpness``) drawn from a generator seeded by a hash of the path's tokens. Deterministic, so
    two policies or two processes asking about the same path get the same answer."""

    def __init__(self, vocab_size: int, seed: int = 0, sharpness: float = 3.0) -> None:
        if vocab_size < 2:
            raise SpecError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.sharpness = sharpness

    def distribution(self, path_tokens: Sequence[int]) -> torch.Tensor:
        """[vocab_size] float32 next-token distribution after ``path_tokens``."""
        digest = hashlib.blake2b(
            np.asarray([self.seed, *path_tokens], dtype=np.int64).tobytes(), digest_size=8
        ).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        logits = torch.randn(self.vocab_size, generator=generator) * self.sharpness
        return torch.softmax(logits, dim=-1)

    def expand(self, tree: GrowingTree, node_ids: Sequence[int], k: int) -> Candidates:
        if k > self.vocab_size:
            raise SpecError(f"top-k {k} exceeds the vocabulary size {self.vocab_size}")
        distributions = torch.stack([self.distribution(tree.path_tokens(node)) for node in node_ids])
        probs, tokens = torch.topk(distributions, k, dim=-1)
        return Candidates(tokens=tokens, probs=probs)


def plugin_worker_state(options=None, drafter=None, **fields):
    """A tree server's ``WorkerState`` for tests that drive the plugin's hooks with stand-in workers: ``options``
    (default eagle 8/4/4/4), ``drafter`` (default SGLang's loop in that shape); ``width``, ``steps``, ``budget``:
    SGLang's draft shape where it differs from the options'; the other fields as given."""
    from sglang_spec.sglang_plugin.drafters.filler import filler_encoding
    from sglang_spec.sglang_plugin.drafters.sglang_loop import SGLangLoopDrafter
    from sglang_spec.sglang_plugin.options import TreeServerOptions
    from sglang_spec.sglang_plugin.state import WorkerState

    options = options or TreeServerOptions("eagle", 8, 4, 4, 4)
    width, steps = fields.pop("width", options.width), fields.pop("steps", options.depth)
    budget = fields.pop("budget", options.budget)
    drafter = drafter or SGLangLoopDrafter(width, steps)
    return WorkerState(options, drafter, width, steps, budget + 1, filler_encoding(budget, width, steps), **fields)
