"""The fused accept on static buffers, the way SGLang's verify CUDA graph runs it: ``AcceptBuffers`` allocated once,
each batch's links, candidates and logits copied into static inputs, ``run_accept`` replayed.

* CPU (interpreted kernels): the same static buffers serve consecutive different batches without re-allocation and
  give what fresh buffers give, so nothing leaks from one batch into the next;
* GPU (``gpu``, compiled kernels): the greedy accept captured in a CUDA graph and replayed on new batches equals an
  eager run on fresh buffers.

Needs no sglang: trees come in SGLang's layout from ``encode_sglang_verify``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import random_tree, targets_following_drafts
from sglang_spec.sglang_plugin.fused_accept import AcceptBuffers, SGLangAccept, run_accept
from sglang_spec.tree import encode_sglang_verify

VOCAB, BATCH, NODES, DEPTH = 30, 3, 9, 4


def sglang_batch(seed: int) -> dict[str, torch.Tensor]:
    """One verify batch in SGLang's layout: links [B, N], candidates [B, N], logits [B * N, V] whose argmax
    follows a drafted child most of the time (deep accepted paths)."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, NODES, DEPTH, 3, vocab_size=VOCAB) for _ in range(BATCH)]
    meta = encode_sglang_verify(trees, [DEPTH + 1] * BATCH)
    target = targets_following_drafts(rng, trees, NODES, accept_rate=0.85, vocab_size=VOCAB)
    noise = torch.from_numpy(rng.random((BATCH * NODES, VOCAB))).float()
    return {
        "first_child": meta.retrieve_next_token.long(),
        "next_sibling": meta.retrieve_next_sibling.long(),
        "candidates": meta.draft_tokens.view(BATCH, NODES).long(),
        "logits": torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float() * 5 + noise,
    }


class StaticAccept:
    """Static buffers plus static candidate and logit inputs, as a captured verify graph holds them."""

    def __init__(self, device: str) -> None:
        self.buffers = AcceptBuffers.allocate(BATCH, NODES, DEPTH, device)
        self.candidates = torch.zeros(BATCH, NODES, dtype=torch.int64, device=device)
        self.logits = torch.zeros(BATCH * NODES, VOCAB, device=device)

    def load(self, batch: dict[str, torch.Tensor]) -> None:
        """What ``before_replay`` does for the links, plus what the graph's forward leaves in its static outputs."""
        self.buffers.first_child.copy_(batch["first_child"])
        self.buffers.next_sibling.copy_(batch["next_sibling"])
        self.candidates.copy_(batch["candidates"])
        self.logits.copy_(batch["logits"])

    def run(self) -> None:
        run_accept(self.buffers, self.candidates, self.logits, DEPTH)


def fresh_accept(batch: dict[str, torch.Tensor], device: str) -> SGLangAccept:
    buffers = AcceptBuffers.allocate(BATCH, NODES, DEPTH, device)
    buffers.first_child.copy_(batch["first_child"])
    buffers.next_sibling.copy_(batch["next_sibling"])
    run_accept(buffers, batch["candidates"].to(device), batch["logits"].to(device), DEPTH)
    return buffers.outputs(BATCH)


def assert_same(ours: SGLangAccept, theirs: SGLangAccept) -> None:
    for name in ("predict", "accept_lens", "accept_index"):
        assert torch.equal(getattr(ours, name).cpu(), getattr(theirs, name).cpu()), name


def storage(buffers: AcceptBuffers) -> list[int]:
    return [buffers.predict_with_spare.data_ptr(), buffers.accept_index.data_ptr(), buffers.target.data_ptr(),
            buffers.accept.accepted_nodes.data_ptr()]


def test_static_buffers_serve_consecutive_batches_like_fresh_ones(kernel_device):
    static = StaticAccept(kernel_device)
    before = storage(static.buffers)
    deepest = 0
    for seed in (0, 1, 0):  # the repeat shows nothing from batch 1 survives into the next run
        batch = sglang_batch(seed)
        static.load(batch)
        static.run()
        ours = static.buffers.outputs(BATCH)
        assert_same(ours, fresh_accept(batch, kernel_device))
        deepest = max(deepest, int(ours.accept_lens.max()))
    assert storage(static.buffers) == before
    assert deepest >= 3  # paths deep enough that the predict scatter and the index rows really vary


@pytest.mark.gpu
def test_cuda_graph_replay_of_the_greedy_accept_equals_eager_runs():
    static = StaticAccept("cuda")
    static.load(sglang_batch(0))
    static.run()  # compiles every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.run()
    for seed in (1, 2, 0):
        batch = sglang_batch(seed)
        static.load(batch)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(static.buffers.outputs(BATCH), fresh_accept(batch, "cuda"))
