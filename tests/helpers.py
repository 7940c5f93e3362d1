"""Random inputs shared by the tests."""

from __future__ import annotations

import numpy as np
import torch

from sglang_spec.tree import TokenTree


def random_tree(
    rng: np.random.Generator, num_nodes: int, max_fanout: int, max_depth: int, vocab_size: int = 1000
) -> TokenTree:
    """A random parents-first tree: each new node picks a random parent that still has room."""
    parents, depths, fanout = [-1], [0], [0]
    for _ in range(1, num_nodes):
        open_nodes = [n for n in range(len(parents)) if fanout[n] < max_fanout and depths[n] < max_depth]
        parent = int(rng.choice(open_nodes))
        parents.append(parent)
        depths.append(depths[parent] + 1)
        fanout.append(0)
        fanout[parent] += 1
    tokens = [int(rng.integers(vocab_size))]
    used: dict[int, set] = {}
    for node in range(1, num_nodes):
        taken = used.setdefault(parents[node], set())
        token = int(rng.integers(vocab_size))
        while token in taken:
            token = int(rng.integers(vocab_size))
        taken.add(token)
        tokens.append(token)
    return TokenTree.from_parents(parents, tokens=tokens)


def chain_tree(length: int, tokens: list[int] | None = None) -> TokenTree:
    return TokenTree.from_parents(list(range(-1, length)), tokens=tokens)


def targets_following_drafts(
    rng: np.random.Generator, trees: list[TokenTree], max_nodes: int, accept_rate: float, vocab_size: int
) -> torch.Tensor:
    """[B, N] target tokens where each node's target equals one of its children's tokens with probability
    ``accept_rate`` (so deep accepted paths actually occur), else a random token."""
    result = torch.from_numpy(rng.integers(vocab_size, size=(len(trees), max_nodes))).long()
    for row, tree in enumerate(trees):
        for node, kids in enumerate(tree.children()):
            if kids and rng.random() < accept_rate:
                result[row, node] = tree.tokens[int(rng.choice(kids))]
    return result
