"""The plugin's per-(depth, rank) acceptance counts: a synthetic tree and accepted path give exact counts (no sglang
needed: the counting is torch on SGLang's tree links and eagle_sample's accepted path)."""

from __future__ import annotations

import torch

from sglang_spec.sglang_plugin.metrics import RankMetrics, tree_rank_counts

# request 0: root 0 -> 1 (rank 0), 2 (rank 1); 1 -> 3 (rank 0), 4 (rank 1); 2 -> 5 (rank 0); path 0, 1, 4
# request 1: root 0 -> 1, 2, 3 (ranks 0..2); 1 -> 4; 3 -> 5; path 0, 3 (then the bonus token), padded with -1
NEXT_TOKEN = torch.tensor([[1, 3, 5, -1, -1, -1], [1, 4, -1, 5, -1, -1]])
NEXT_SIBLING = torch.tensor([[-1, 2, -1, 4, -1, -1], [-1, 2, 3, -1, -1, -1]])
ACCEPT_INDEX = torch.tensor([[0, 1, 4], [6, 9, -1]], dtype=torch.int32)  # global: b * 6 + node


def test_counts_per_depth_and_rank_exactly():
    offered, accepted = tree_rank_counts(NEXT_TOKEN, NEXT_SIBLING, ACCEPT_INDEX, max_depth=3, max_rank=4)
    assert offered.tolist() == [
        [2, 0, 0, 0],  # row 0: the verify steps (one root per request)
        [2, 2, 1, 0],  # depth 1: both roots' children
        [2, 1, 0, 0],  # depth 2: request 0's node 1's children 3, 4; request 1's node 3's child 5
        [0, 0, 0, 0],  # depth 3: request 0's node 4 and request 1's node 5 have no children
    ]
    assert accepted.tolist() == [[2, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]


def test_a_child_off_the_accepted_path_is_not_offered():
    """Negative control: request 0's node 5 (child of the rejected node 2) and request 1's node 4 (child of the
    rejected node 1) are never counted; dropping the path's second node leaves depth 2 unoffered."""
    offered, accepted = tree_rank_counts(NEXT_TOKEN[:1], NEXT_SIBLING[:1], torch.tensor([[0, -1, -1]]),
                                         max_depth=3, max_rank=4)
    assert offered[2:].sum() == 0 and accepted[1:].sum() == 0
    assert offered[1].tolist() == [1, 1, 0, 0]
    only_second = tree_rank_counts(NEXT_TOKEN[1:], NEXT_SIBLING[1:], torch.tensor([[0, 3, -1]]), 3, 4)[0]
    assert only_second[2].tolist() == [1, 0, 0, 0]  # node 5 (under the accepted 3), not node 4 (under 1)


def test_ranks_and_depths_past_the_table_are_dropped():
    offered, _ = tree_rank_counts(NEXT_TOKEN, NEXT_SIBLING, ACCEPT_INDEX, max_depth=1, max_rank=2)
    assert offered.tolist() == [[2, 0], [2, 2]]


def test_accumulated_counts_reach_the_host_copy():
    ranks = RankMetrics()
    ranks.enable(prometheus=False)
    for _ in range(3):
        ranks.record(NEXT_TOKEN, NEXT_SIBLING, ACCEPT_INDEX)
    assert ranks.host[0, 0, 0] == 6 and ranks.host[0, 1, :3].tolist() == [6, 6, 3]
    assert ranks.host[1, 2, :2].tolist() == [0, 3]
