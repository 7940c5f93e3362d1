"""``--speculative-tree-accept fused`` against SGLang's own accept, op by op, on trees in SGLang's layout:

* greedy: ``run_accept`` == SGLang's ``verify_tree_greedy`` (its Triton twin, interpreted);
* sampled: ``run_accept`` with SGLang's coins == ``tree_speculative_sampling_target_only`` (the harness's
  stand-in, itself checked against exact target sampling in test_cpu_harness.py) for the same coins;
* KV commit: ``FusedAccept.commit_kv`` leaves the pool as ``move_accept_tokens_to_target_kvcache`` does, and so
  does a commit stopped by a fault after any number of layer buffers and finished (``KVCommit.finish``).

The end-to-end comparison through SGLang's server is in tests/sglang_server/test_tiny_deepseek_through_launch_server.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import random_tree, targets_following_drafts
from sglang_spec.errors import SpecError
from sglang_spec.kernels.verify_accept import CandidateSampleMode
from sglang_spec.sglang_plugin.fused_accept import (REFERENCE_KERNELS, TRITON_KERNELS, AcceptBuffers, AcceptKernels,
                                                    FusedAccept, KVCommit, accept_kernels, run_accept)
from sglang_spec.tree import encode_sglang_verify

pytestmark = pytest.mark.sglang

VOCAB = 30
# the Triton kernels (interpreted here) and their pure-torch references (the CPU bed's servers run these): each
# must give SGLang's accept
KERNELS = pytest.mark.parametrize("kernels", [TRITON_KERNELS, REFERENCE_KERNELS], ids=lambda k: k.name)


def sglang_trees(seed: int, batch: int, nodes: int, depth: int, fanout: int):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, nodes, fanout, depth, vocab_size=VOCAB) for _ in range(batch)]
    return rng, trees, encode_sglang_verify(trees, [depth + 1] * batch)


def buffers_for(meta, batch: int, nodes: int, depth: int) -> AcceptBuffers:
    buffers = AcceptBuffers.allocate(batch, nodes, depth, "cpu")
    buffers.first_child.copy_(meta.retrieve_next_token)
    buffers.next_sibling.copy_(meta.retrieve_next_sibling)
    return buffers


def assert_same_accept(buffers: AcceptBuffers, batch: int, predicts, accept_index, accepted_drafts) -> None:
    ours = buffers.outputs(batch)
    assert torch.equal(ours.accept_index, accept_index.to(torch.int32))
    assert torch.equal(ours.accept_lens, (accepted_drafts + 1).to(torch.int32))
    written = accept_index[accept_index >= 0].long()  # SGLang leaves the other predict slots untouched
    assert torch.equal(ours.predict[written], predicts[written].to(torch.int32))


@KERNELS
@pytest.mark.parametrize("seed, batch, nodes, depth, fanout", [(0, 3, 9, 4, 3), (1, 2, 16, 5, 4), (2, 4, 6, 5, 1)])
def test_greedy_accept_equals_sglangs_verify_tree_greedy(sglang_kernels, seed, batch, nodes, depth, fanout,
                                                         kernels: AcceptKernels):
    rng, trees, meta = sglang_trees(seed, batch, nodes, depth, fanout)
    target = targets_following_drafts(rng, trees, nodes, accept_rate=0.85, vocab_size=VOCAB)
    logits = torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float() * 5 + torch.rand(batch * nodes, VOCAB)
    predicts, accept_index, accepted_drafts = sglang_kernels.verify_greedy(
        meta.draft_tokens.view(batch, nodes), meta.retrieve_index, meta.retrieve_next_token,
        meta.retrieve_next_sibling, logits.argmax(-1).view(batch, nodes), depth + 1)
    buffers = buffers_for(meta, batch, nodes, depth)
    run_accept(buffers, meta.draft_tokens.view(batch, nodes).long(), logits, depth, kernels=kernels)
    assert_same_accept(buffers, batch, predicts, accept_index, accepted_drafts)
    assert int(accepted_drafts.sum()) > 0  # the targets follow the drafts often enough to walk


@KERNELS
@pytest.mark.parametrize("seed", range(6))
def test_sampled_accept_equals_sglangs_sampling_rule_for_the_same_coins(seed, kernels: AcceptKernels):
    from sglang_spec_testbed.sampling import tree_speculative_sampling_target_only

    batch, nodes, depth = 3, 10, 4
    rng, trees, meta = sglang_trees(100 + seed, batch, nodes, depth, 3)
    generator = torch.Generator().manual_seed(seed)
    # peaked at the drafted tokens so that paths get accepted, with enough mass elsewhere to reject too
    target = targets_following_drafts(rng, trees, nodes, accept_rate=0.7, vocab_size=VOCAB)
    logits = torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float() * 2.5 \
        + torch.randn(batch * nodes, VOCAB, generator=generator)
    temperatures = torch.tensor([0.7, 1.0, 1.6])
    coins = torch.rand(batch, nodes, generator=generator)
    final_coins = torch.rand(batch, generator=generator)

    target_probs = torch.softmax(logits / temperatures.repeat_interleave(nodes)[:, None], -1).view(batch, nodes, -1)
    predicts = torch.full((batch * nodes,), -7, dtype=torch.int32)
    accept_index = torch.full((batch, depth + 1), -1, dtype=torch.int32)
    accepted_drafts = torch.zeros(batch, dtype=torch.int32)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accepted_drafts, meta.draft_tokens.view(batch, nodes), meta.retrieve_index,
        meta.retrieve_next_token, meta.retrieve_next_sibling, coins, final_coins, target_probs,
        torch.zeros_like(target_probs))

    inverse_temperature = 1.0 / temperatures
    mode = CandidateSampleMode(logits, inverse_temperature,
                               kernels.node_normalizers(logits, nodes, inverse_temperature), coins.reshape(-1),
                               final_coins)
    buffers = buffers_for(meta, batch, nodes, depth)
    run_accept(buffers, meta.draft_tokens.view(batch, nodes).long(), logits, depth, mode, kernels)
    assert_same_accept(buffers, batch, predicts, accept_index, accepted_drafts)


class MovingPool:
    """Two layers of K and V rows, moved the way SGLang's pools move them (gather, then scatter)."""

    def __init__(self, slots: int) -> None:
        self.k_buffer = [torch.randn(slots, 2, 3) for _ in range(2)]
        self.v_buffer = [torch.randn(slots, 2, 3) for _ in range(2)]

    def move_kv_cache(self, target: torch.Tensor, source: torch.Tensor) -> None:
        for buffer in self.k_buffer + self.v_buffer:
            buffer[target] = buffer[source]

    def rows(self) -> list[torch.Tensor]:
        return [buffer.clone() for buffer in self.k_buffer + self.v_buffer]


@KERNELS
@pytest.mark.parametrize("interrupted_after", [None, 0, 1, 3])
def test_kv_commit_equals_sglangs_move_accept_tokens(sglang_with_plugin, interrupted_after, kernels: AcceptKernels):
    """Whole, or stopped by a fault after ``interrupted_after`` of the 4 layer buffers and finished by torch: the
    pool SGLang's move leaves (moving a buffer twice would not be: its second move reads moved rows)."""
    from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

    batch, nodes, depth = 3, 8, 4
    rng, trees, meta = sglang_trees(7, batch, nodes, depth, 2)
    target = targets_following_drafts(rng, trees, nodes, accept_rate=0.9, vocab_size=VOCAB)
    logits = torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float()
    buffers = buffers_for(meta, batch, nodes, depth)
    run_accept(buffers, meta.draft_tokens.view(batch, nodes).long(), logits, depth)
    accepted = buffers.outputs(batch)
    assert int(accepted.accept_lens.max()) >= 3  # paths long enough that rows really move

    out_cache_loc = torch.from_numpy(rng.permutation(64)[: batch * nodes]).long() + 10  # the verify window's slots
    sglang_pool, our_pool = MovingPool(80), MovingPool(80)
    for ours, theirs in zip(our_pool.k_buffer + our_pool.v_buffer, sglang_pool.k_buffer + sglang_pool.v_buffer):
        ours.copy_(theirs)
    schedule_batch = SimpleNamespace(seq_lens=torch.tensor([5, 9, 4]), out_cache_loc=out_cache_loc)
    allocator = SimpleNamespace(get_kvcache=lambda: sglang_pool)
    move_accept_tokens_to_target_kvcache(schedule_batch, accepted.accept_index.long(),
                                         accepted.accept_lens.long() - 1, allocator)
    if interrupted_after is None and kernels is TRITON_KERNELS:
        FusedAccept.commit_kv(our_pool, out_cache_loc, accepted.accept_index, accepted.accept_lens, nodes)
    elif interrupted_after is None:
        KVCommit.of(our_pool, out_cache_loc, accepted.accept_index, accepted.accept_lens, nodes, kernels).run()
    else:
        commit = KVCommit.of(our_pool, out_cache_loc, accepted.accept_index, accepted.accept_lens, nodes, kernels)

        def fault():
            if commit.done == interrupted_after:
                raise RuntimeError("injected")

        if interrupted_after == 0:
            commit.finish()
        else:
            with pytest.raises(RuntimeError, match="injected"):
                commit.run(between=fault)
            assert commit.done == interrupted_after
            commit.finish()
        assert commit.done == 4
    for ours, theirs in zip(our_pool.rows(), sglang_pool.rows()):
        assert torch.equal(ours, theirs)
    if interrupted_after:  # the negative control: the interrupted buffers moved again
        again = KVCommit.of(our_pool, out_cache_loc, accepted.accept_index, accepted.accept_lens, nodes)
        again.finish()
        assert any(not torch.equal(ours, theirs) for ours, theirs in zip(our_pool.rows(), sglang_pool.rows()))


def test_accept_kernels_by_name_and_the_one_line_refusals():
    assert accept_kernels("", "cpu") is TRITON_KERNELS and accept_kernels("triton", "cuda:0") is TRITON_KERNELS
    assert accept_kernels(" reference ", "cpu") is REFERENCE_KERNELS
    with pytest.raises(SpecError, match="SGLANG_SPEC_ACCEPT_KERNELS='torch' names no fused-accept kernels"):
        accept_kernels("torch", "cpu")
    with pytest.raises(SpecError, match="runs on CPU only"):
        accept_kernels("reference", "cuda:0")
