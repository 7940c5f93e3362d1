"""Drafting token trees with an MTP head, with exact ancestry.

Each request has its own MTP KV cache. Slots ``[0, P)`` hold the committed pairs (h_i, t_{i+1}) for positions
0..P-1, where position P is the root (the last verified token); the last committed pair is the root's own
expansion, so the root's child distribution is known without another forward.

Expanding tree node v (depth d >= 1) runs the head on the pair (feedback hidden of v's parent, token of v) at
position P - 1 + d, with a mask that lets it see the committed slots, the slots of its own ancestors and itself:
never a sibling's or a cousin's. So every node's draft distribution is exactly what drafting its root-to-node
path alone as a chain would give. All nodes of one expansion round go through one forward.

After verify, ``commit`` drops every tree slot and runs the head over the newly accepted pairs (target hidden
states, next tokens) in one causal forward; its last row is the next root's expansion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from sglang_spec.attention.kv_cache import new_dynamic_cache
from sglang_spec.attention.masks import attention_mask_for
from sglang_spec.mtp.head import MTPHead, MTPStepOutput
from sglang_spec.tree.candidates import CandidateSource, Candidates, GrowingTree

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass(frozen=True, eq=False)
class ExpandedNode:
    """A tree node the head has run on: its cache slot, feedback hidden [d] and child logits [V_draft]."""

    slot: int
    hidden: torch.Tensor
    logits: torch.Tensor


@dataclass
class DraftState:
    """One request's drafting state.

    committed:    P, the number of committed pairs in the cache (= the root's position).
    root_hidden:  [d] feedback hidden state of the root's expansion.
    root_logits:  [V_draft] logits of the root's children.
    nodes:        growing-tree node id -> ExpandedNode, for expanded non-root nodes of the current tree.
    forwards:     head forwards run so far (a cost counter).
    """

    cache: DynamicCache
    committed: int
    root_hidden: torch.Tensor
    root_logits: torch.Tensor
    nodes: dict[int, ExpandedNode] = field(default_factory=dict)
    forwards: int = 0


class MTPDrafter:
    """Runs an MTPHead for the decoder: prefill, tree expansion (a CandidateSource per request), commit."""

    def __init__(self, head: MTPHead) -> None:
        self.head = head
        self.config = head.config

    @torch.no_grad()
    def prefill(self, target_hidden: torch.Tensor, tokens: torch.Tensor) -> DraftState:
        """target_hidden: [P, d] the target's final hidden states of the prompt; tokens: [P] the tokens that follow
        each of them (the prompt shifted by one, ending with the first generated token)."""
        cache = new_dynamic_cache()
        output = self._append_pairs(cache, 0, target_hidden, tokens)
        return DraftState(cache=cache, committed=tokens.shape[0], root_hidden=output.hidden[0, -1],
                          root_logits=output.logits[0, -1], forwards=1)

    @torch.no_grad()
    def commit(self, state: DraftState, target_hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Drops the tree slots and appends the accepted pairs. target_hidden: [m, d] at the accepted path nodes
        (root first); next_tokens: [m] the token after each (accepted drafts, then the bonus token)."""
        surplus = state.cache.get_seq_length() - state.committed
        if surplus > 0:
            state.cache.crop(-surplus)
        state.nodes.clear()
        output = self._append_pairs(state.cache, state.committed, target_hidden, next_tokens)
        state.forwards += 1
        state.committed += next_tokens.shape[0]
        state.root_hidden = output.hidden[0, -1]
        state.root_logits = output.logits[0, -1]

    def _append_pairs(
        self, cache: DynamicCache, committed: int, target_hidden: torch.Tensor, tokens: torch.Tensor
    ) -> MTPStepOutput:
        """The head over new exact pairs after ``committed`` cached ones: plain causal attention."""
        count = tokens.shape[0]
        positions = torch.arange(committed, committed + count, device=tokens.device)[None]
        allowed = torch.ones(count, committed + count, dtype=torch.bool, device=tokens.device)
        allowed[:, committed:] = torch.tril(allowed[:, committed:])
        return self.head(
            tokens[None],
            target_hidden[None].to(self._dtype),
            positions,
            attention_mask_for(self.config, allowed[None, None], self._dtype),
            cache,
        )

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.eh_proj.weight.dtype

    def source(self, state: DraftState) -> CandidateSource:
        """A CandidateSource that expands this request's tree with exact ancestry."""
        return _TreeSource(self, state)

    @torch.no_grad()
    def expand(self, state: DraftState, tree: GrowingTree, node_ids: Sequence[int]) -> torch.Tensor:
        """Draft logits [len(node_ids), V_draft] for the children of each node, in one forward for the non-root
        nodes."""
        pending = [node for node in node_ids if node != 0 and node not in state.nodes]
        if pending:
            self._forward_nodes(state, tree, pending)
        return torch.stack([state.root_logits if node == 0 else state.nodes[node].logits for node in node_ids])

    def _forward_nodes(self, state: DraftState, tree: GrowingTree, nodes: list[int]) -> None:
        device = state.root_logits.device
        width = state.cache.get_seq_length()
        count = len(nodes)
        allowed = torch.zeros(count, width + count, dtype=torch.bool, device=device)
        allowed[:, : state.committed] = True
        hidden, tokens, positions = [], [], []
        for row, node in enumerate(nodes):
            parent = tree.parents[node]
            ancestor = parent
            while ancestor > 0:
                allowed[row, state.nodes[ancestor].slot] = True
                ancestor = tree.parents[ancestor]
            allowed[row, width + row] = True
            hidden.append(state.root_hidden if parent == 0 else state.nodes[parent].hidden)
            tokens.append(tree.tokens[node])
            positions.append(state.committed - 1 + tree.depths[node])
        # a lone node whose ancestors fill the cache (a chain) needs no mask: the cheap chain path
        mask = (None if count == 1 and bool(allowed.all())
                else attention_mask_for(self.config, allowed[None, None], self._dtype))
        output = self.head(
            torch.tensor([tokens], device=device),
            torch.stack(hidden)[None],
            torch.tensor([positions], device=device),
            mask,
            state.cache,
        )
        state.forwards += 1
        for row, node in enumerate(nodes):
            state.nodes[node] = ExpandedNode(width + row, output.hidden[0, row], output.logits[0, row])


class _TreeSource(CandidateSource):
    def __init__(self, drafter: MTPDrafter, state: DraftState) -> None:
        self.drafter = drafter
        self.state = state

    def expand(self, tree: GrowingTree, node_ids: Sequence[int], k: int) -> Candidates:
        logits = self.drafter.expand(self.state, tree, node_ids)
        probs, indices = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        return Candidates(tokens=self.drafter.head.to_full_vocab(indices).cpu(), probs=probs.cpu())
