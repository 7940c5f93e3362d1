"""What the decoder needs from a target model (``TargetRunner``, the protocol), and its transformers implementation
(``TransformersRunner``): a causal LM run the way tree verification needs it. ``decode/static_runner.py`` is the
other implementation (Llama-style models on a static cache).

KV layout: one cache for the batch, left-aligned per request: request b's committed KV fills slots
``[0, lengths[b])`` of every layer and anything past that is stale and masked out. A verify forward appends the N
tree nodes of every request at slots ``[S, S + N)`` (S = the cache width); ``commit`` then gathers, per request,
its committed slots followed by the slots of its accepted path, so the cache is left-aligned again.

Works with any cache layer whose tensors are [B, heads, slots, dim] (Llama-style K/V, and transformers'
DeepSeek-V3 MLA cache, which stores the compressed latent and the rope key as [B, 1, slots, r]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sglang_spec.attention.kv_cache import new_dynamic_cache
from sglang_spec.attention.masks import attention_mask_for
from sglang_spec.tree.batch import TreeBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers import DynamicCache


@dataclass(frozen=True, eq=False)
class PrefillOutput:
    """hidden: [P, d] final (post-norm) hidden states of the prompt; last_logits: [V]; cache: batch-1 cache (a
    DynamicCache here, a StaticKVCache from ``decode/static_runner.py``)."""

    hidden: torch.Tensor
    last_logits: torch.Tensor
    cache: Any


@dataclass(frozen=True, eq=False)
class TreeForwardOutput:
    """logits: [B, N, V] float32 at every tree node; hidden: [B, N, d] final hidden states."""

    logits: torch.Tensor
    hidden: torch.Tensor


class TargetRunner(Protocol):
    """A target model as the decoder drives it: prompts prefilled one by one, merged into a batch, then per step
    one verify forward over every request's tree and a commit of each request's accepted path.

    Invariant: after ``start_batch`` the runner holds, per request b, ``lengths[b]`` committed tokens; ``verify``
    adds none of them; ``commit`` adds exactly the kept nodes; ``select`` drops requests and nothing else."""

    model: PreTrainedModel  # the target it runs
    config: Any  # the target's transformers config

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def prepare(self, rows: int) -> None:
        """Builds, before decoding, whatever a verify of up to ``rows`` tree tokens per request needs."""

    def prefill(self, prompt: torch.Tensor) -> PrefillOutput:
        """One prompt [P] alone (batch 1, causal): its hidden states, last logits and its own cache."""

    def decode_one(self, token: int, position: int, cache: Any) -> PrefillOutput:
        """Plain decoding: one token at ``position`` appended to a prefill's batch-1 ``cache``."""

    def start_batch(self, prefills: list[PrefillOutput]) -> None:
        """Merges prefills into the batch that ``verify`` / ``commit`` / ``select`` work on (rows in order)."""

    def verify(self, batch: TreeBatch) -> TreeForwardOutput:
        """One forward over every request's tree (row b of ``batch``): logits [B, N, V] and hidden [B, N, d] at
        every node, each node seeing its request's committed tokens, its ancestors and itself."""

    def commit(self, kept_nodes: list[list[int]]) -> None:
        """After ``verify``: request b keeps the KV of ``kept_nodes[b]`` (its accepted path, root first)."""

    def select(self, rows: list[int]) -> None:
        """Keeps only these requests, in this order (finished ones leave the batch)."""


def _cache_layers(cache: DynamicCache) -> list[Any]:
    return list(cache.layers)


class TransformersRunner:
    """``TargetRunner`` over transformers' own forward and a DynamicCache (any architecture transformers runs)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []
        self._tree_start = 0  # cache slot of the first tree node of the last verify forward

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def prepare(self, rows: int) -> None:
        """Nothing to build ahead: transformers allocates per forward."""

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache,
    ) -> TreeForwardOutput:
        output = self.model.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        hidden = output.last_hidden_state
        return TreeForwardOutput(logits=self.model.lm_head(hidden).float(), hidden=hidden)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> PrefillOutput:
        """Runs one prompt [P] alone (batch 1, causal)."""
        cache = new_dynamic_cache()
        ids = prompt.to(self.device)[None]
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        output = self._forward(ids, positions, None, cache)
        return PrefillOutput(hidden=output.hidden[0], last_logits=output.logits[0, -1], cache=cache)

    @torch.no_grad()
    def decode_one(self, token: int, position: int, cache: DynamicCache) -> PrefillOutput:
        """Plain decoding: one token for a batch-1 cache (the no-speculation baseline)."""
        ids = torch.tensor([[token]], device=self.device)
        output = self._forward(ids, torch.tensor([[position]], device=self.device), None, cache)
        return PrefillOutput(hidden=output.hidden[0], last_logits=output.logits[0, -1], cache=cache)

    def start_batch(self, prefills: list[PrefillOutput]) -> None:
        """Merges batch-1 prefill caches into one left-aligned batch cache."""
        self.lengths = [prefill.hidden.shape[0] for prefill in prefills]
        width = max(self.lengths)
        merged = new_dynamic_cache()
        for layer_index in range(len(_cache_layers(prefills[0].cache))):
            keys, values = [], []
            for prefill in prefills:
                layer = _cache_layers(prefill.cache)[layer_index]
                pad = width - layer.keys.shape[2]
                keys.append(torch.nn.functional.pad(layer.keys, (0, 0, 0, pad)))
                values.append(torch.nn.functional.pad(layer.values, (0, 0, 0, pad)))
            merged.update(torch.cat(keys), torch.cat(values), layer_index)
        self.cache = merged

    @torch.no_grad()
    def verify(self, batch: TreeBatch) -> TreeForwardOutput:
        """One forward over every request's tree (row b of ``batch``), each node seeing its request's committed KV,
        its ancestors and itself, at position ``lengths[b] + depth``. Padding nodes run as token 0 at position
        ``lengths[b]`` and see the committed KV, the root and themselves; nothing real sees them."""
        cache = self._batch_cache()
        width = cache.get_seq_length()
        device = self.device
        positions = torch.tensor(self.lengths, dtype=torch.int64)[:, None] + batch.depths.clamp(min=0)
        allowed = batch.attention_mask(self.lengths, tree_start=width)[:, None]  # [B, 1, N, width + N]
        mask = attention_mask_for(self.config, allowed.to(device), self.dtype)
        self._tree_start = width
        return self._forward(batch.tokens.clamp(min=0).to(device), positions.to(device), mask, cache)

    def _batch_cache(self) -> DynamicCache:
        if self.cache is None:
            raise AssertionError("start_batch() first: there is no batch cache")
        return self.cache

    def commit(self, kept_nodes: list[list[int]]) -> None:
        """After a verify forward: request b keeps its committed slots plus the tree slots of ``kept_nodes[b]``
        (the accepted path, root first), in that order."""
        new_lengths = [length + len(nodes) for length, nodes in zip(self.lengths, kept_nodes)]
        new_width = max(new_lengths)
        index = torch.zeros(len(kept_nodes), new_width, dtype=torch.int64)
        for row, (length, nodes) in enumerate(zip(self.lengths, kept_nodes)):
            index[row, :length] = torch.arange(length)
            index[row, length : length + len(nodes)] = self._tree_start + torch.tensor(nodes, dtype=torch.int64)
        self._gather(index.to(self.device))
        self.lengths = new_lengths

    def _gather(self, index: torch.Tensor) -> None:
        for layer in _cache_layers(self._batch_cache()):
            layer.keys = _gather_slots(layer.keys, index)
            layer.values = _gather_slots(layer.values, index)

    def select(self, rows: list[int]) -> None:
        """Keeps only the given requests (finished ones leave the batch)."""
        keep = torch.tensor(rows, dtype=torch.int64, device=self.device)
        for layer in _cache_layers(self._batch_cache()):
            layer.keys = layer.keys.index_select(0, keep)
            layer.values = layer.values.index_select(0, keep)
        self.lengths = [self.lengths[row] for row in rows]
        width = max(self.lengths)
        self._gather(torch.arange(width, device=self.device).expand(len(rows), width))


def _gather_slots(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor: [B, H, S, D]; index: [B, W] -> [B, H, W, D]."""
    batch, heads, _, dim = tensor.shape
    return torch.gather(tensor, 2, index[:, None, :, None].expand(batch, heads, index.shape[1], dim))
