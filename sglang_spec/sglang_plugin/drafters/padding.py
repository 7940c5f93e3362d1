"""Trees padded to SGLang's fixed verify shape: SGLang verifies ``budget`` draft nodes a request whatever the tree,
so a smaller tree gets filler leaves. A filler token differs from its siblings' (the smallest such id), so it is one
more deterministic proposal: verification stays exact whatever it is. The host form pads one ``TokenTree``; the
device form pads a batch of trees held as tensors with no host read; both place the same fillers.
"""

from __future__ import annotations

import torch

from sglang_spec.tree.token_tree import TokenTree


def pad_to_budget(tree: TokenTree, budget: int, width: int, steps: int) -> TokenTree:
    """``tree`` with filler leaves added until it has ``budget`` draft nodes: first under the shallowest nodes that
    keep fewer than ``width`` children, never deeper than ``steps``. A filler token differs from its siblings'
    (the smallest such id), so it is one more deterministic proposal: verification stays exact whatever it is."""
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    depths = tree.depths.tolist()
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(tokens[node])
    node = 0
    while len(parents) - 1 < budget:
        if node == len(parents):
            raise AssertionError(f"no room for {budget} nodes with width {width} and {steps} steps")
        if depths[node] >= steps or len(children[node]) >= width:
            node += 1
            continue
        used = set(children[node])
        filler = next(token for token in range(len(used) + 1) if token not in used)
        parents.append(node)
        tokens.append(filler)
        depths.append(depths[node] + 1)
        children[node].append(filler)
        children.append([])
    return TokenTree.from_parents(parents, tokens=tokens)


def pad_to_budget_device(parents: torch.Tensor, tokens: torch.Tensor, num_nodes: torch.Tensor, budget: int,
                         width: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_to_budget`` for a batch of trees held as device tensors, with no host read: parents / tokens
    [bs, >= budget + 1] int64 (node 0 the root, parents first, -1 past ``num_nodes`` [bs]) -> the padded
    (parents, tokens) [bs, budget + 1], the same fillers in the same places. Node by node, as the host form
    walks them: a node above ``steps`` keeps fewer than ``width`` children gets the smallest tokens its children
    do not hold, while the tree is short."""
    batch_size = parents.shape[0]
    columns = budget + 1
    device = parents.device
    rows = torch.arange(batch_size, device=device)
    spare = torch.full((batch_size, 1), -1, dtype=torch.int64, device=device)
    parents = torch.cat([parents[:, :columns], spare], 1)  # a spare column takes the writes that do not happen
    tokens = torch.cat([tokens[:, :columns], spare], 1)
    nodes = torch.arange(columns + 1, device=device)
    depths = torch.zeros_like(parents)
    for node in range(1, columns):
        depths[:, node] = depths[rows, parents[:, node].clamp(min=0)] + 1
    count = num_nodes.clone()
    candidates = torch.arange(2 * width + 1, device=device)
    for node in range(columns):
        children = (parents == node) & (nodes[None, :] < count[:, None])
        held = children.long().sum(1)
        room = torch.where((node < count) & (depths[:, node] < steps), (width - held).clamp(min=0), 0)
        added = torch.minimum(room, columns - count)
        # the smallest tokens its children do not hold, in order
        used = ((tokens[:, None, :] == candidates[None, :, None]) & children[:, None, :]).any(2)
        free_rank = (~used).long().cumsum(1) - 1  # [bs, candidates]
        take = ~used & (free_rank < added[:, None])
        target = torch.where(take, count[:, None] + free_rank, columns)
        parents.scatter_(1, target, torch.full_like(target, node))
        tokens.scatter_(1, target, candidates[None, :].expand(batch_size, -1))
        depths.scatter_(1, target, (depths[:, node] + 1)[:, None].expand_as(target))
        count = count + added
    return parents[:, :columns], tokens[:, :columns]
