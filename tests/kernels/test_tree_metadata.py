import numpy as np
import pytest
import torch

from helpers import random_candidate_batch, random_tree, to_device
from sglang_spec.kernels.tree_metadata import (
    FlashInferIndptrs,
    TreeMetadata,
    build_tree_metadata,
    build_tree_metadata_reference,
    flashinfer_indptrs,
    flashinfer_indptrs_reference,
    pack_flashinfer_mask,
    pack_flashinfer_mask_reference,
)
from sglang_spec.tree import TreeBatch, encode_flashinfer_mask

CASES = [
    # batch, max nodes, topk, depth, shapes, padded_every
    (1, 2, 1, 1, ("chain",), 0),
    (3, 9, 1, 8, ("chain",), 0),
    (3, 9, 8, 1, ("star",), 0),
    (5, 17, 3, 6, ("random", "chain", "full"), 3),
    (2, 33, 4, 4, ("full", "random"), 0),
    (7, 12, 2, 10, ("random",), 2),
]


def metadata_args(case, seed):
    batch, nodes, topk, depth, shapes, padded = case
    data = random_candidate_batch(np.random.default_rng(seed), batch, nodes, topk, depth, 500, shapes, padded)
    keys = ("parents", "ranks", "topk_tokens", "topk_probs", "root_tokens", "prefix_lens", "num_nodes")
    return {key: data[key] for key in keys}, data["trees"], depth


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}n{c[1]}k{c[2]}d{c[3]}")
def test_tree_metadata_kernel_equals_reference(kernel_device, case):
    args, trees, depth = metadata_args(case, seed=sum(case[:4]))
    kernel = to_device(build_tree_metadata(**to_device(args, kernel_device), max_depth=depth), "cpu")
    reference = build_tree_metadata_reference(**args, max_depth=depth)
    for name in TreeMetadata.__dataclass_fields__:
        assert torch.equal(getattr(kernel, name), getattr(reference, name)), name
    # and the reference agrees with the core TokenTree semantics
    for b, tree in enumerate(trees):
        if tree is None:
            assert kernel.depths[b].tolist() == [-1] * case[1]
            continue
        n = tree.num_nodes
        assert kernel.depths[b, :n].tolist() == tree.depths.tolist()
        assert torch.equal(kernel.tree_mask[b, :n, :n].bool(), tree.ancestor_mask())


def test_one_topology_broadcast_to_every_request(kernel_device):
    args, _, depth = metadata_args((4, 8, 2, 3, ("full",), 0), seed=3)
    shared = dict(args, parents=args["parents"][0].clone(), ranks=args["ranks"][0].clone())
    shared["num_nodes"] = torch.full((4,), int(args["num_nodes"][0]))
    kernel = to_device(build_tree_metadata(**to_device(shared, kernel_device), max_depth=depth), "cpu")
    reference = build_tree_metadata_reference(**shared, max_depth=depth)
    assert torch.equal(kernel.tree_mask, reference.tree_mask) and torch.equal(kernel.tokens, reference.tokens)
    assert torch.equal(kernel.depths[0], kernel.depths[3])


@pytest.mark.parametrize("case", CASES[2:5], ids=lambda c: f"bs{c[0]}n{c[1]}")
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_mask_kernels_equal_reference_and_core_encoder(kernel_device, case, page_size):
    args, trees, depth = metadata_args(case, seed=7)
    meta = build_tree_metadata_reference(**args, max_depth=depth)
    nodes = case[1]
    indptrs = to_device(flashinfer_indptrs(args["prefix_lens"].to(kernel_device), nodes, page_size), "cpu")
    reference_indptrs = flashinfer_indptrs_reference(args["prefix_lens"], nodes, page_size)
    for name in FlashInferIndptrs.__dataclass_fields__:
        assert torch.equal(getattr(indptrs, name), getattr(reference_indptrs, name)), name
    capacity = int(indptrs.packed_mask_indptr[-1]) + 8
    empty = torch.zeros(capacity, dtype=torch.uint8)
    mask_args = (meta.tree_mask, args["prefix_lens"], indptrs.packed_mask_indptr, empty)
    packed = pack_flashinfer_mask(*to_device(mask_args, kernel_device), block=16, num_chunks=3).cpu()
    reference = pack_flashinfer_mask_reference(meta.tree_mask, args["prefix_lens"], indptrs.packed_mask_indptr,
                                               torch.zeros(capacity, dtype=torch.uint8))
    assert torch.equal(packed, reference)
    # full-size trees in the static layout equal the core encoder's packing
    full = [b for b, tree in enumerate(trees) if tree is not None and tree.num_nodes == nodes]
    if full:
        core = encode_flashinfer_mask([trees[b] for b in full], args["prefix_lens"][full], page_size)
        pieces = [packed[int(indptrs.packed_mask_indptr[b]) : int(indptrs.packed_mask_indptr[b + 1])] for b in full]
        assert torch.equal(torch.cat(pieces), core.packed_mask)


def test_parents_from_links_inverts_the_links(kernel_device):
    from sglang_spec.kernels.tree_metadata import parents_from_links, parents_from_links_reference

    rng = np.random.default_rng(7)
    trees = [random_tree(rng, 12, 3, 4, vocab_size=20) for _ in range(3)]
    batch = TreeBatch.from_trees(trees)
    kernel = parents_from_links(*to_device((batch.first_child, batch.next_sibling), kernel_device)).cpu()
    assert torch.equal(kernel, batch.parents)
    assert torch.equal(parents_from_links_reference(batch.first_child, batch.next_sibling), batch.parents)
