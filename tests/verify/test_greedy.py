import numpy as np
import pytest
import torch

from helpers import random_tree, targets_following_drafts
from sglang_spec.tree import TokenTree, TreeBatch, encode_sglang_verify
from sglang_spec.verify import verify_greedy


def test_hand_drawn_tree():
    #        0(5)
    #      /     \
    #   1(6)     2(7)
    #    |      /   \
    #   3(8)  4(9)  5(10)
    tree = TokenTree.from_parents([-1, 0, 0, 1, 2, 2], tokens=[5, 6, 7, 8, 9, 10])
    batch = TreeBatch.from_trees([tree, tree, None])
    predict = torch.tensor(
        [
            [7, 0, 10, 0, 0, 42],  # root -> 7 (node 2) -> 10 (node 5) -> bonus 42
            [3, 0, 0, 0, 0, 0],  # nothing matches at the root: bonus 3
            [0, 0, 0, 0, 0, 0],  # padded request
        ]
    )
    result = verify_greedy(batch, predict)
    assert result.accept_length.tolist() == [3, 1, 0]
    assert result.accepted_nodes.tolist() == [[0, 2, 5], [0, -1, -1], [-1, -1, -1]]
    assert result.bonus_token.tolist() == [42, 3, -1]
    assert result.output_tokens.tolist() == [[7, 10, 42], [3, -1, -1], [-1, -1, -1]]
    assert result.tokens(0) == [7, 10, 42]


def test_first_matching_sibling_wins_and_full_depth_accepts():
    chain = TokenTree.from_parents([-1, 0, 1, 2], tokens=[1, 2, 3, 4])
    result = verify_greedy(TreeBatch.from_trees([chain]), torch.tensor([[2, 3, 4, 99]]))
    assert result.tokens(0) == [2, 3, 4, 99] and result.accept_length.tolist() == [4]


@pytest.mark.sglang
@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_sglangs_verify_tree_greedy(sglang_kernels, seed):
    rng = np.random.default_rng(seed)
    batch_size = int(rng.choice([1, 3, 5, 7]))
    num_nodes = int(rng.choice([2, 5, 9, 17, 32]))
    depth_limit = int(rng.integers(1, 8))
    num_nodes = min(num_nodes, 1 + sum(4**level for level in range(1, depth_limit + 1)))
    vocab = 12
    trees = [random_tree(rng, num_nodes, max_fanout=4, max_depth=depth_limit, vocab_size=vocab)
             for _ in range(batch_size)]
    batch = TreeBatch.from_trees(trees)
    target = targets_following_drafts(rng, trees, num_nodes, accept_rate=0.85, vocab_size=vocab)
    ours = verify_greedy(batch, target)

    meta = encode_sglang_verify(trees, seq_lens=[4] * batch_size)
    depth = batch.max_depth()
    predicts, accept_index, accept_num = sglang_kernels.verify_greedy(
        batch.tokens, meta.retrieve_index, meta.retrieve_next_token, meta.retrieve_next_sibling, target, depth + 1
    )
    assert accept_num.tolist() == (ours.accept_length - 1).tolist()
    global_ids = torch.where(ours.accepted_nodes >= 0,
                             ours.accepted_nodes + num_nodes * torch.arange(batch_size)[:, None], -1)
    assert accept_index.long().tolist() == global_ids.tolist()
    for row in range(batch_size):
        for j in range(int(ours.accept_length[row])):
            assert int(predicts[global_ids[row, j]]) == int(ours.output_tokens[row, j])
    assert int((ours.accept_length > 2).sum()) > 0 or depth < 2  # deep paths really occur
