"""Frequency, presence, repetition and min-new-tokens penalties in a tree's verify, as plain decoding applies them.

Plain decoding penalises the token after outputs t_1 .. t_k by all k of them: SGLang's penalizers count every
output token (``cumulate_output_tokens`` once a decode step, one token a step). SGLang's speculative verify
(``eagle_sample``) instead adds each request's accumulated penalty to every node of its tree, the same at depth 3
as at the root ("a relaxed version of penalties for speculative decoding"), and accumulates only the last token of
a step that committed several. Greedy output then differs from plain decoding's as soon as a penalised request
accepts more than one token a step (SmolLM2 through the CPU bed, frequency penalty 0.8 on a repeating table: the
eleventh token differs).

Here every node gets the penalties plain decoding would apply after the request's committed output followed by
the node's path (its ancestors' tokens below the root, and its own): node i of depth d_i predicts output token
k + d_i + 1, so, with c_i(v) the count of v in output + path(i),

* frequency:  logits[i, v] -= frequency * c_i(v)
* presence:   logits[i, v] -= presence * [c_i(v) > 0]
* min_new_tokens: the stop tokens get -inf while k + d_i < min_new_tokens
* repetition: logits[i, v] scaled by the penalty (SGLang's ``apply_scaling_penalties``) where c_i(v) > 0,

additive first, then the scaling, in SGLang's order. The committed output is each request's ``output_ids`` on the
host, complete when the scheduler processed the last step before this verify (overlap scheduling off: every CPU
server); with the overlap scheduler on, the output ids lag a step behind the tree's root and the hook completes
them from the last verify (``committed``). An output that does not end with the tree's root makes
``tree_penalties`` return None, and SGLang's relaxed penalties stay (said in docs/sglang-plugin.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RequestPenalties:
    """One request's penalty settings (SGLang's ``SamplingParams``) and its committed output token ids."""

    frequency: float
    presence: float
    repetition: float
    min_new_tokens: int
    output_ids: Sequence[int]

    @classmethod
    def of(cls, req, output_ids: Sequence[int] | None = None) -> RequestPenalties:
        """From an SGLang ``Req``, with its committed output (``committed``; None: its ``output_ids``)."""
        params = req.sampling_params
        return cls(float(params.frequency_penalty), float(params.presence_penalty), float(params.repetition_penalty),
                   int(params.min_new_tokens or 0), list(req.output_ids if output_ids is None else output_ids))


@dataclass(frozen=True)
class TreePenalties:
    """Per node (bs * N rows, request-major as SGLang's verify logits): the additive penalty [bs * N, V] float32
    (-inf for banned stop tokens) and the repetition scale [bs * N, V] float32 (1 where none), or None when no
    request of the batch has a repetition penalty."""

    additive: torch.Tensor
    scaling: torch.Tensor | None

    def apply(self, logits: torch.Tensor) -> None:
        """In place on ``logits`` [bs * N, V], in SGLang's order (additive, then scaling)."""
        logits.add_(self.additive)
        if self.scaling is not None:
            logits.copy_(torch.where(logits < 0, logits * self.scaling, logits / self.scaling))


def node_paths(first_child: Sequence[int], next_sibling: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """Per node of one tree (SGLang's links, root = node 0): the tokens of its path below the root, from the
    root's child down to the node itself. The root's path is empty; a node no link reaches gets an empty path too
    (padding: its logits are never read)."""
    paths: list[list[int]] = [[] for _ in tokens]
    reached = [False] * len(tokens)
    reached[0] = True
    stack = [0]
    while stack:
        node = stack.pop()
        child = first_child[node]
        while 0 <= child < len(tokens) and not reached[child]:
            reached[child] = True
            paths[child] = paths[node] + [tokens[child]]
            stack.append(child)
            child = next_sibling[child]
    return paths


def tree_penalties(requests: Sequence[RequestPenalties], tokens: torch.Tensor, first_child: torch.Tensor,
                   next_sibling: torch.Tensor, stop_tokens: torch.Tensor, vocab_size: int) -> TreePenalties | None:
    """Every node's penalties, or None when some request's committed output does not end with its tree's root
    (output ids lagging: the overlap scheduler), where no exact penalty can be had.

    requests: one per row; tokens, first_child, next_sibling: [bs, N] (the verify input's draft tokens, root first,
    and SGLang's links); stop_tokens: [bs, V] bool, the tokens min_new_tokens bans for each request (read off SGLang's
    accumulated additive penalty, where the ban is -inf). The tensors are built on ``stop_tokens.device``."""
    batch, nodes = tokens.shape
    token_rows = tokens.tolist()
    if any(request.output_ids and request.output_ids[-1] != row[0] for request, row in zip(requests, token_rows)):
        return None
    device = stop_tokens.device
    first_rows, sibling_rows = first_child.tolist(), next_sibling.tolist()
    # counts[b * N + i, v]: occurrences of v in request b's output (counted once a request), then node i's path
    output_rows = [b for b, request in enumerate(requests) for _ in request.output_ids]
    output_tokens = [token for request in requests for token in request.output_ids]
    counts = _counted(torch.zeros(batch, vocab_size, dtype=torch.float32, device=device), output_rows, output_tokens)
    counts = counts.repeat_interleave(nodes, dim=0)
    path_rows: list[int] = []
    path_tokens: list[int] = []
    depths: list[int] = []
    for b in range(batch):
        for i, path in enumerate(node_paths(first_rows[b], sibling_rows[b], token_rows[b])):
            path_rows += [b * nodes + i] * len(path)
            path_tokens += path
            depths.append(len(path))
    counts = _counted(counts, path_rows, path_tokens)
    present = counts > 0

    def per_node(values: Sequence[float]) -> torch.Tensor:  # [bs] settings -> [bs * N, 1]
        return torch.tensor(values, dtype=torch.float32, device=device).repeat_interleave(nodes)[:, None]

    additive = -per_node([r.frequency for r in requests]) * counts - per_node([r.presence for r in requests]) * present
    emitted = torch.tensor([len(r.output_ids) for r in requests], device=device).repeat_interleave(nodes)
    banned = (emitted + torch.tensor(depths, device=device)) < per_node([r.min_new_tokens for r in requests])[:, 0]
    ban = banned[:, None] & stop_tokens.repeat_interleave(nodes, dim=0)
    additive = torch.where(ban, torch.full_like(additive, float("-inf")), additive)
    scaling = None
    if any(r.repetition != 1.0 for r in requests):
        scaling = torch.where(present, per_node([r.repetition for r in requests]), torch.ones_like(counts))
    return TreePenalties(additive, scaling)


def _counted(counts: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    """``counts`` with 1 added at every (row, token) pair, repeats accumulating."""
    device = counts.device
    return counts.index_put_((torch.tensor(rows, dtype=torch.long, device=device),
                              torch.tensor(tokens, dtype=torch.long, device=device)),
                             torch.ones(len(rows), dtype=torch.float32, device=device), accumulate=True)
