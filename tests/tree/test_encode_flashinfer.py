import numpy as np
import torch

from helpers import random_tree
from sglang_spec.tree import TokenTree, encode_flashinfer_mask
from sglang_spec.tree.bits import pack_bits_little_endian


def test_bit_order_matches_the_environment_notes():
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert pack_bits_little_endian(bits).tolist() == [205, 5]
    assert np.packbits(bits.numpy(), bitorder="little").tolist() == [205, 5]


def test_random_batches_equal_segment_packbits_reference():
    rng = np.random.default_rng(5)
    for batch_size in [1, 3, 6]:
        trees = [
            None if rng.random() < 0.2 else random_tree(rng, int(rng.integers(1, 20)), 4, 6)
            for _ in range(batch_size)
        ]
        prefix_lens = rng.integers(0, 30, size=batch_size).tolist()
        page_size = int(rng.choice([1, 4, 16]))
        mask = encode_flashinfer_mask(trees, prefix_lens, page_size=page_size)
        q_lens = [0 if tree is None else tree.num_nodes for tree in trees]
        kv_lens = [prefix + q for prefix, q in zip(prefix_lens, q_lens)]
        assert mask.qo_indptr.tolist() == np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        pages = [-(-kv // page_size) for kv in kv_lens]
        assert mask.paged_kv_indptr.tolist() == np.concatenate([[0], np.cumsum(pages)]).tolist()
        for kv, count, last in zip(kv_lens, pages, mask.paged_kv_last_page_len.tolist()):
            assert (count - 1) * page_size + last == kv or count == 0
        # FlashInfer's segment_packbits(bitorder="little"): each request's block packed and padded on its own
        reference_bytes, reference_indptr = [], [0]
        for index, (tree, prefix) in enumerate(zip(trees, prefix_lens)):
            block = mask.custom_mask[mask.mask_indptr[index] : mask.mask_indptr[index + 1]]
            if tree is not None:
                expected = np.concatenate([np.ones((tree.num_nodes, prefix), bool), tree.ancestor_mask().numpy()], 1)
                assert block.numpy().tolist() == expected.reshape(-1).tolist()
            packed = np.packbits(block.numpy(), bitorder="little")
            reference_bytes.extend(packed.tolist())
            reference_indptr.append(reference_indptr[-1] + len(packed))
        assert mask.packed_mask.tolist() == reference_bytes
        assert mask.packed_mask_indptr.tolist() == reference_indptr


def test_single_chain_layout():
    mask = encode_flashinfer_mask([TokenTree.from_parents([-1, 0, 1])], [2])
    assert mask.custom_mask.reshape(3, 5).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask.qo_indptr.tolist() == [0, 3] and mask.paged_kv_indptr.tolist() == [0, 5]
    assert mask.packed_mask_indptr.tolist() == [0, 2]
