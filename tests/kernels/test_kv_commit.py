import numpy as np
import pytest
import torch

from helpers import random_candidate_batch, to_device
from sglang_spec.kernels.kv_commit import (
    commit_kv,
    commit_kv_reference,
    paged_tree_slots,
    paged_tree_slots_reference,
)
from sglang_spec.kernels.tree_metadata import build_tree_metadata_reference
from sglang_spec.kernels.verify_accept import MatchMode, accept_walk_reference


def accepted_paths(seed, batch=5, nodes=10, depth=4):
    rng = np.random.default_rng(seed)
    data = random_candidate_batch(rng, batch, nodes, 3, depth, 30, ("random", "chain", "full"), padded_every=4)
    keys = ("parents", "ranks", "topk_tokens", "topk_probs", "root_tokens", "prefix_lens", "num_nodes")
    meta = build_tree_metadata_reference(**{k: data[k] for k in keys}, max_depth=depth)
    # targets that follow a random child most of the time, so paths are deep and skip around
    target = torch.from_numpy(rng.integers(30, size=batch * nodes)).long()
    for b in range(batch):
        for node in range(nodes):
            kids = (meta.parents[b] == node).nonzero().flatten().tolist()
            if kids and rng.random() < 0.85:
                target[b * nodes + node] = meta.tokens[b, int(rng.choice(kids))]
    outputs = accept_walk_reference(meta.tokens, meta.parents, data["num_nodes"], depth,
                                    torch.zeros(batch, 8, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
                                    MatchMode(target))
    slots = torch.from_numpy(rng.permutation(200)[: batch * nodes].reshape(batch, nodes)).long() + 1
    return rng, outputs, data["num_nodes"], slots


def make_buffers(rng, layout):
    if layout == "mha":  # SGLang per-layer K and V [slots, heads, head_dim]
        return [torch.from_numpy(rng.normal(size=(208, 2, 8))).to(torch.float16) for _ in range(4)], False
    if layout == "mla":  # per-layer latent [slots, 1, kv_lora_rank + rope]
        return [torch.from_numpy(rng.normal(size=(208, 1, 24))).to(torch.bfloat16) for _ in range(2)], False
    return [torch.from_numpy(rng.normal(size=(3, 208, 40))).float()], True  # stacked [layers, slots, row]


@pytest.mark.parametrize("layout", ["mha", "mla", "stacked"])
@pytest.mark.parametrize("seed", range(3))
def test_commit_equals_reference_and_moves_the_accepted_rows(kernel_device, layout, seed):
    rng, outputs, num_nodes, slots = accepted_paths(seed)
    buffers, stacked = make_buffers(rng, layout)
    original = [buffer.clone() for buffer in buffers]
    kernel_buffers = [buffer.clone().to(kernel_device) for buffer in buffers]
    freed = torch.empty_like(slots, device=kernel_device)
    path = to_device((slots, outputs.accepted_nodes, outputs.accept_length, num_nodes), kernel_device)
    commit_kv(kernel_buffers, *path, freed, stacked=stacked, block=16)
    kernel_buffers, freed = to_device((kernel_buffers, freed), "cpu")
    reference_freed = torch.empty_like(slots)
    commit_kv_reference(buffers, slots, outputs.accepted_nodes, outputs.accept_length, num_nodes, reference_freed,
                        stacked=stacked)
    for kernel_buffer, reference_buffer, before in zip(kernel_buffers, buffers, original):
        assert torch.equal(kernel_buffer, reference_buffer)
        for b in range(slots.shape[0]):
            for j in range(int(outputs.accept_length[b])):
                source = slots[b, outputs.accepted_nodes[b, j]]
                row = kernel_buffer[:, slots[b, j]] if stacked else kernel_buffer[slots[b, j]]
                expected = before[:, source] if stacked else before[source]
                assert torch.equal(row, expected)
    assert torch.equal(freed, reference_freed)
    for b in range(slots.shape[0]):
        length, count = int(outputs.accept_length[b]), int(num_nodes[b])
        assert freed[b].tolist() == [-1] * length + slots[b, length:count].tolist() + [-1] * (slots.shape[1] - count)
    assert int(outputs.accept_length.max()) >= 3


def test_in_place_hazard_path_reads_before_it_overwrites(kernel_device):
    # path 0 -> 2 -> 5: position 1 <- node 2, position 2 <- node 5; node 2's row is read before it is overwritten
    slots = torch.tensor([[10, 11, 12, 13, 14, 15]])
    before = torch.arange(20 * 4, dtype=torch.float32).reshape(20, 4)
    accepted = torch.tensor([[0, 2, 5, -1]])
    args = to_device(([before.clone()], slots, accepted, torch.tensor([3]), torch.tensor([6]), torch.empty_like(slots)),
                     kernel_device)
    commit_kv(*args, block=2)
    buffer = args[0][0].cpu()
    assert torch.equal(buffer[11], before[12]) and torch.equal(buffer[12], before[15])
    assert torch.equal(buffer[10], before[10]) and torch.equal(buffer[13:], before[13:])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_tree_slots_equal_reference(kernel_device, page_size):
    rng = np.random.default_rng(page_size)
    prefix = torch.from_numpy(rng.integers(0, 50, size=5)).long()
    page_table = torch.from_numpy(rng.permutation(2000)[: 5 * 64].reshape(5, 64)).long()
    kernel = paged_tree_slots(*to_device((page_table, prefix), kernel_device), 9, page_size).cpu()
    assert torch.equal(kernel, paged_tree_slots_reference(page_table, prefix, 9, page_size))


def test_rows_must_be_contiguous(kernel_device):
    buffer = torch.zeros(16, 8, 4).transpose(1, 2)
    args = ([buffer], torch.zeros(1, 2).long(), torch.zeros(1, 2).long(), torch.ones(1).long(), torch.ones(1).long(),
            torch.zeros(1, 2).long())
    with pytest.raises(ValueError, match="contiguous"):
        commit_kv(*to_device(args, kernel_device))
