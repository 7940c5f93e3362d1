"""Random inputs shared by the tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from sglang_spec.attention.cascade import mla_tree_attention_reference
from sglang_spec.tree import TokenTree
from sglang_spec.tree.batch import with_prefix
from sglang_spec.tree.encode_sglang import TreeMaskMode


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


def random_candidate_batch(
    rng: np.random.Generator,
    batch_size: int,
    max_nodes: int,
    topk: int,
    max_depth: int,
    vocab_size: int,
    shapes: tuple[str, ...] = ("random",),
    padded_every: int = 0,
) -> dict:
    """Kernel inputs for a padded batch: per-request topology (parents, ranks), top-k candidates drafted at
    every node, root tokens, prefix lengths and node counts. Shapes: random, chain, star, full (max_nodes)."""
    parents = torch.full((batch_size, max_nodes), -1, dtype=torch.int64)
    ranks = torch.zeros((batch_size, max_nodes), dtype=torch.int64)
    num_nodes = torch.zeros(batch_size, dtype=torch.int64)
    trees = []
    for b in range(batch_size):
        if padded_every and b % padded_every == padded_every - 1:
            trees.append(None)
            continue
        shape = shapes[b % len(shapes)]
        if shape == "chain":
            count = min(max_nodes, max_depth + 1)
            tree = TokenTree.from_parents(list(range(-1, count - 1)))
        elif shape == "star":
            count = min(max_nodes, topk + 1)
            tree = TokenTree.from_parents([-1] + [0] * (count - 1))
        else:
            capacity = 1 + sum(topk**level for level in range(1, max_depth + 1))
            count = min(max_nodes, capacity) if shape == "full" else int(rng.integers(1, min(max_nodes, capacity) + 1))
            tree = random_tree(rng, count, max_fanout=topk, max_depth=max_depth)
        trees.append(tree)
        num_nodes[b] = tree.num_nodes
        parents[b, : tree.num_nodes] = tree.parents
        ranks[b, : tree.num_nodes] = tree.ranks.clamp(min=0)
    candidate_tokens = torch.stack(
        [torch.from_numpy(rng.permutation(vocab_size)[:topk]) for _ in range(batch_size * max_nodes)]
    ).reshape(batch_size, max_nodes, topk).long()
    candidate_probs = torch.sort(torch.from_numpy(rng.random((batch_size, max_nodes, topk))).float(), -1, True).values
    return dict(
        parents=parents,
        ranks=ranks,
        topk_tokens=candidate_tokens.contiguous(),
        topk_probs=candidate_probs.contiguous(),
        root_tokens=torch.from_numpy(rng.integers(vocab_size, size=batch_size)).long(),
        prefix_lens=torch.from_numpy(rng.integers(0, 40, size=batch_size)).long(),
        num_nodes=num_nodes,
        trees=trees,
    )


def to_device(value: Any, device: str) -> Any:
    """``value`` with every tensor in it (inside tuples, lists, dicts and dataclasses too) moved to ``device``. On
    the CPU the very same tensors come back, so in-place outputs stay visible to the caller."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {field.name: to_device(getattr(value, field.name), device) for field in dataclasses.fields(value)
                 if field.init}
        return dataclasses.replace(value, **moved)
    return value


def law_p_value(law: dict[tuple[int, ...], float], samples: list[tuple[int, ...]]) -> float:
    """Chi-square p-value of ``samples`` against the exact ``law`` (outcome -> probability); cells expected fewer
    than 5 times are merged into one bin."""
    from scipy import stats

    counts = {outcome: 0 for outcome in law}
    for sample in samples:
        counts[sample] += 1
    keys = sorted(law, key=lambda k: -law[k])
    expected = np.array([law[k] for k in keys]) * len(samples)
    observed = np.array([counts[k] for k in keys], dtype=float)
    rare = expected < 5
    expected = np.append(expected[~rare], expected[rare].sum())
    observed = np.append(observed[~rare], observed[rare].sum())
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


# MLA tree verify over a paged pool (tests/kernels/test_mla_tree_verify.py, tests/sglang_plugin/
# test_mla_tree_backend.py): H heads, L latent, R rope
MLA_HEADS, MLA_LATENT, MLA_ROPE = 3, 32, 8


def paged_mla_batch(seed, batch, tree_tokens, page_size, mode, heads=MLA_HEADS, latent=MLA_LATENT, rope=MLA_ROPE):
    """B requests in a paged pool (each request's pages drawn at random, SGLang's slot = page * size + offset),
    their trees' rows written at positions prefix .. prefix + n, SGLang's flat tree mask in ``mode``; ``heads``
    query heads over latent rows of ``latent + rope``."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    prefixes = [int(p) for p in rng.integers(1, 50, size=batch)]
    num_pages = sum(-(-(prefix + tree_tokens) // page_size) for prefix in prefixes) + 8
    context = 64 * page_size
    req_to_token = torch.zeros(batch + 2, context, dtype=torch.int32)
    rows = rng.permutation(batch + 2)[:batch]
    free_pages = list(rng.permutation(np.arange(1, num_pages)))  # page 0 is SGLang's padding page
    for row, prefix in zip(rows, prefixes):
        pages = [free_pages.pop() for _ in range(-(-(prefix + tree_tokens) // page_size))]
        positions = torch.arange(prefix + tree_tokens)
        req_to_token[row, : prefix + tree_tokens] = torch.tensor(pages)[positions // page_size] * page_size + (
            positions % page_size)
    kv_buffer = torch.randn(num_pages * page_size, 1, latent + rope, generator=generator)
    masks = [random_tree(rng, tree_tokens, 3, 5).ancestor_mask() for _ in range(batch)]
    if mode == TreeMaskMode.QLEN_ONLY:
        flat = torch.cat([mask.reshape(-1) for mask in masks])
    else:
        flat = torch.cat([with_prefix(mask, prefix).reshape(-1) for mask, prefix in zip(masks, prefixes)])
    tokens = batch * tree_tokens
    return dict(
        prefixes=prefixes, rows=torch.tensor(rows), req_to_token=req_to_token, kv_buffer=kv_buffer, masks=masks,
        flat_mask=flat,
        tree_slots=torch.cat([req_to_token[row, p:p + tree_tokens] for row, p in zip(rows, prefixes)]),
        q_latent=torch.randn(tokens, heads, latent, generator=generator),
        q_rope=torch.randn(tokens, heads, rope, generator=generator),
        scale=(latent + rope) ** -0.5,
    )


def paged_mla_reference(data, tree_tokens):
    """Per request: one masked attention over its prefix rows then its tree rows (read through req_to_token)."""
    rows = data["kv_buffer"][:, 0]
    outs = []
    for b, (row, prefix) in enumerate(zip(data["rows"].tolist(), data["prefixes"])):
        queries = slice(b * tree_tokens, (b + 1) * tree_tokens)
        prefix_rows = rows[data["req_to_token"][row, :prefix].long()]
        tree_rows = rows[data["req_to_token"][row, prefix:prefix + tree_tokens].long()]
        latent = data["q_latent"].shape[-1]
        prefix_kv = prefix_rows[:, :latent], prefix_rows[:, latent:]
        tree_kv = tree_rows[:, :latent], tree_rows[:, latent:]
        outs.append(mla_tree_attention_reference(data["q_latent"][queries], data["q_rope"][queries], *prefix_kv,
                                                 *tree_kv, data["masks"][b], data["scale"]).out)
    return torch.cat(outs)
