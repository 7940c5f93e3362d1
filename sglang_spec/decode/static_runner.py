"""A Llama-family target run close to what a CPU can do: a pre-grown KV cache written in place, fused weights,
the fewest Python-level ops per step. A ``TargetRunner`` like ``TransformersRunner`` (prefill, decode_one,
start_batch, verify, commit, select), so the decoder and plain decoding use whichever runner fits the model.

What it does differently from ``TransformersRunner`` (transformers' forward over a DynamicCache):

* one KV tensor for every layer, ``kv [layers, 2, B, kv_heads, capacity, head_dim]``, grown by doubling; a forward
  writes its new rows in place at ``[length, length + T)`` of each request, never concatenating;
* a verify writes request b's N tree nodes at slots ``[lengths[b], lengths[b] + N)``; ``commit`` moves only the
  accepted rows that are not already in place (path node i to slot lengths[b] + i; a chain's accepted path never
  moves), in one indexing op over all layers;
* q/k/v and gate/up weights are concatenated (one matmul each), every matmul is a ``PackedLinear`` (the project's
  AVX-512 kernel at a step's or a verify's few rows, else MKL packed GEMMs, ``gemm/packed_linear.py``), RMSNorm is
  ``F.rms_norm``, and RoPE is one complex multiply: q and k rows are permuted within each head so each rotated pair
  (i, i + head_dim/2) sits side by side (a dot product is unchanged by permuting both operands the same way);
* attention is one ``scaled_dot_product_attention`` call per layer; in a decode step or a verify the query heads
  that share a kv head are folded into one head of ``groups * T`` rows (2x faster than SDPA's ``enable_gqa`` at 1
  and at 17 rows); a plain step and a prefill need no mask, a tree's ancestor mask is built once per tree shape
  and its additive bias once per verify.

Logits match the transformers forward to float32 rounding (``tests/decode/test_static_runner.py``); greedy
speculation is compared with plain decoding run by this same runner.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F

from sglang_spec.gemm.packed_linear import PackedLinear, best_backend
from sglang_spec.decode.target import PrefillOutput, TargetRunner, TransformersRunner, TreeForwardOutput
from sglang_spec.tree.batch import TreeBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_GROWTH_SLACK = 256  # slots added past what a forward needs when the cache grows (then it doubles)
# model -> ((parameter versions, GEMM backend), output head, fused layers): one copy of the fused weights per model
_FUSED: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], PackedLinear, list[_Layer]]] = weakref.WeakKeyDictionary()


def supports(model: PreTrainedModel) -> bool:
    """True for the decoder-only models this runner reproduces exactly: Llama-style layers (q/k/v/o projections
    without bias, SiLU gated MLP, RMSNorm, default RoPE, no sliding window)."""
    config = model.config
    if getattr(config, "model_type", None) not in ("llama", "mistral", "qwen2", "qwen3"):
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "sliding_window", None):
        return False
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or not layers:
        return False
    attention = layers[0].self_attn
    if any(getattr(getattr(attention, name), "bias", None) is not None
           for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    if hasattr(attention, "q_norm"):  # Qwen3's per-head norms: not reproduced here
        return False
    return model.get_output_embeddings() is not None


@dataclass
class StaticKVCache:
    """kv: [layers, 2, B, kv_heads, capacity, head_dim]; lengths[b]: committed slots of request b."""

    kv: torch.Tensor
    lengths: list[int]

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[4])

    def reserve(self, needed: int) -> None:
        """Grows the capacity to at least ``needed`` slots (doubling), keeping the contents."""
        if needed <= self.capacity:
            return
        capacity = max(needed + _GROWTH_SLACK, 2 * self.capacity)
        grown = self.kv.new_zeros(*self.kv.shape[:4], capacity, self.kv.shape[5])
        grown[:, :, :, :, : self.capacity] = self.kv
        self.kv = grown

    def get_seq_length(self) -> int:
        return max(self.lengths)


@dataclass(frozen=True, eq=False)
class _Layer:
    input_norm: torch.Tensor  # [d]
    qkv: PackedLinear  # weight [(heads + 2 * kv_heads) * head_dim, d], q and k rows permuted for complex RoPE
    output: PackedLinear  # weight [d, heads * head_dim]
    post_norm: torch.Tensor  # [d]
    gate_up: PackedLinear  # weight [2 * intermediate, d]
    down: PackedLinear  # weight [d, intermediate]


class StaticTargetRunner:
    """A ``TargetRunner`` over a static cache and a hand-written Llama forward (see module doc)."""

    def __init__(self, model: PreTrainedModel, backend: str | None = None) -> None:
        """``backend``: the GEMM backend of every matmul (``packed_linear.BACKENDS``; None: the best here)."""
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a Llama-style model this runner reproduces")
        self.model = model
        self.config = model.config
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.groups = self.num_heads // self.num_kv_heads  # query heads per kv head
        self.eps = float(config.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        base = model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.backend = best_backend() if backend is None else backend
        self.lm_head, self.layers = self._weights(model)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        half = self.head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        assert self.inv_freq.shape[0] == half
        self._rope = torch.empty(0, half, dtype=torch.complex64)
        self.cache: StaticKVCache | None = None
        self.lengths: list[int] = []
        self._tree_width = 0  # N of the last verify forward
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    # ---------------------------------------------------------------------------------------------- weights
    def _weights(self, model: PreTrainedModel) -> tuple[PackedLinear, list[_Layer]]:
        """The fused layers and output head, shared by every runner of ``model`` (a pack is made once per model
        and row bucket, not per runner), rebuilt when any parameter changed in place since."""
        versions = tuple(parameter._version for parameter in model.parameters())
        key = (versions, self.backend)
        cached = _FUSED.get(model)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        lm_head = PackedLinear(model.get_output_embeddings().weight, self.backend)
        layers = [self._fuse(layer) for layer in model.model.layers]
        _FUSED[model] = (key, lm_head, layers)
        return lm_head, layers

    def prepare(self, rows: int) -> None:
        """Makes the GEMM packs a forward over up to ``rows`` tokens uses now, so the first verify of that size
        does not pay for them (a server's start-up, like a CUDA graph capture)."""
        linears = [self.lm_head]
        for layer in self.layers:
            linears += [layer.qkv, layer.output, layer.gate_up, layer.down]
        for linear in linears:
            linear.prepare(rows)

    def _fuse(self, layer: Any) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        permute = self._pair_permutation()
        query = attention.q_proj.weight.detach().reshape(self.num_heads, self.head_dim, -1)[:, permute]
        key = attention.k_proj.weight.detach().reshape(self.num_kv_heads, self.head_dim, -1)[:, permute]
        qkv = torch.cat([query.flatten(0, 1), key.flatten(0, 1), attention.v_proj.weight.detach()]).contiguous()
        gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous()
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=PackedLinear(qkv, self.backend),
            output=PackedLinear(attention.o_proj.weight, self.backend),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=PackedLinear(gate_up, self.backend),
            down=PackedLinear(mlp.down_proj.weight, self.backend),
        )

    def _pair_permutation(self) -> torch.Tensor:
        """Head dims (i, i + D/2) of rotate-half RoPE placed side by side: [0, D/2, 1, D/2 + 1, ...]."""
        half = self.head_dim // 2
        return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()

    def _rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, 1, D/2] complex64 rotations at ``positions`` [T] (a table grown on demand)."""
        needed = int(positions.max()) + 1
        if needed > self._rope.shape[0]:
            size = max(needed + _GROWTH_SLACK, 2 * self._rope.shape[0])
            # the angle is formed exactly as transformers forms it: float position times inv_freq in float32
            angles = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            self._rope = torch.polar(torch.ones_like(angles), angles)
        return self._rope[positions][:, None, :]

    # ---------------------------------------------------------------------------------------------- forward
    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, starts: Sequence[int],
        mask: torch.Tensor | None, causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions: [B, T]; request b's new rows are written at slots [starts[b], starts[b] + T) and its
        queries see slots [0, S) with S = max(starts) + T, filtered by ``mask`` (``_tree_mask``: an additive
        [B, 1, groups * T, S] bias over the grouped queries; None: all of them; ``causal``: the prefill of an
        empty cache). Returns (logits [B, T, V] float32, hidden [B, T, d])."""
        batch, width = ids.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, k_size = heads * head_dim, kv_heads * head_dim
        groups = self.groups
        end = max(starts) + width
        cache.reserve(end)
        kv = cache.kv
        rotation = self._rotations(positions.reshape(-1))  # [B*T, 1, D/2]
        hidden = F.embedding(ids.reshape(-1), self.embed)  # [B*T, d]
        same_start = all(start == starts[0] for start in starts)
        for index, layer in enumerate(self.layers):
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.eps)
            qkv = layer.qkv(normed)  # [B*T, q + 2k]
            rotated = torch.view_as_real(
                torch.view_as_complex(
                    qkv[:, : q_size + k_size].reshape(batch * width, heads + kv_heads, head_dim // 2, 2)
                )
                * rotation
            )  # [B*T, heads + kv_heads, D/2, 2]
            if causal:
                query = rotated[:, :heads].reshape(batch, width, heads, head_dim).transpose(1, 2)
            else:  # [B, kv_heads, groups * T, D]: one attention per kv head, no kv repeat (module doc)
                query = rotated[:, :heads].reshape(batch, width, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
                query = query.reshape(batch, kv_heads, groups * width, head_dim)
            key = rotated[:, heads:].reshape(batch, width, kv_heads, head_dim).transpose(1, 2)
            value = qkv[:, q_size + k_size :].reshape(batch, width, kv_heads, head_dim).transpose(1, 2)
            layer_kv = kv[index]  # [2, B, kv_heads, capacity, D]
            if same_start:
                layer_kv[0, :, :, starts[0] : starts[0] + width] = key
                layer_kv[1, :, :, starts[0] : starts[0] + width] = value
            else:
                for row, start in enumerate(starts):
                    layer_kv[0, row, :, start : start + width] = key[row]
                    layer_kv[1, row, :, start : start + width] = value[row]
            attended = F.scaled_dot_product_attention(
                query, layer_kv[0, :, :, :end], layer_kv[1, :, :, :end], attn_mask=mask, is_causal=causal,
                scale=self.scale, enable_gqa=causal and heads != kv_heads,
            )
            if causal:  # [B, heads, T, D]
                attended = attended.transpose(1, 2).reshape(batch * width, q_size)
            else:  # [B, kv_heads, groups * T, D]
                attended = attended.reshape(batch, kv_heads, groups, width, head_dim).permute(0, 3, 1, 2, 4)
                attended = attended.reshape(batch * width, q_size)
            hidden = layer.output.add_to(hidden, attended)
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.post_norm, self.eps)
            gate, up = layer.gate_up(normed).chunk(2, dim=-1)
            hidden = layer.down.add_to(hidden, F.silu(gate).mul_(up))
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.final_norm, self.eps)
        logits = self.lm_head(hidden)
        return logits.float().reshape(batch, width, -1), hidden.reshape(batch, width, -1)

    def _new_cache(self, batch: int, capacity: int) -> StaticKVCache:
        layers = len(self.layers)
        kv = self.embed.new_zeros(layers, 2, batch, self.num_kv_heads, capacity, self.head_dim)
        return StaticKVCache(kv, [0] * batch)

    # ---------------------------------------------------------------------------------------------- runner API
    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> PrefillOutput:
        """Runs one prompt [P] alone (batch 1, causal); its cache is a StaticKVCache."""
        count = int(prompt.shape[0])
        cache = self._new_cache(1, count + _GROWTH_SLACK)
        ids = prompt.to(self.device)[None]
        positions = torch.arange(count, device=self.device)[None]
        logits, hidden = self._forward(ids, positions, cache, [0], None, causal=True)
        cache.lengths = [count]
        return PrefillOutput(hidden=hidden[0], last_logits=logits[0, -1], cache=cache)

    @torch.no_grad()
    def decode_one(self, token: int, position: int, cache: StaticKVCache) -> PrefillOutput:
        """Plain decoding: one token appended to a batch-1 cache at slot ``position`` (= its length)."""
        ids = torch.tensor([[token]], device=self.device)
        logits, hidden = self._forward(ids, ids.new_full((1, 1), position), cache, [position], None, causal=False)
        cache.lengths = [position + 1]
        return PrefillOutput(hidden=hidden[0], last_logits=logits[0, -1], cache=cache)

    def start_batch(self, prefills: list[PrefillOutput]) -> None:
        """Stacks batch-1 prefill caches into one batch cache (request b's slots stay [0, lengths[b]))."""
        caches = [prefill.cache for prefill in prefills]
        if len(caches) == 1:
            self.cache = StaticKVCache(caches[0].kv, list(caches[0].lengths))
        else:
            capacity = max(cache.capacity for cache in caches)
            merged = self._new_cache(len(caches), capacity)
            for row, cache in enumerate(caches):
                merged.kv[:, :, row : row + 1, :, : cache.capacity] = cache.kv
            merged.lengths = [cache.lengths[0] for cache in caches]
            self.cache = merged
        self.lengths = list(self.cache.lengths)

    @torch.no_grad()
    def verify(self, batch: TreeBatch) -> TreeForwardOutput:
        """One forward over every request's tree: node i of request b at slot lengths[b] + i and position
        lengths[b] + depth, seeing the request's committed slots, its ancestors and itself. Padding nodes run as
        token 0 at the root's position and see the committed slots, the root and themselves."""
        cache = self._batch_cache()
        count = batch.max_nodes
        depths = batch.depths.clamp(min=0)
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        positions = lengths[:, None] + depths
        # one node per request at one shared length attends to every slot: no mask (the plain-step path)
        aligned = count == 1 and all(length == self.lengths[0] for length in self.lengths)
        mask = None if aligned else self._tree_mask(batch)
        logits, hidden = self._forward(batch.tokens.clamp(min=0).to(self.device), positions.to(self.device), cache,
                                       self.lengths, mask, causal=False)
        self._tree_width = count
        return TreeForwardOutput(logits=logits, hidden=hidden)

    def _tree_mask(self, batch: TreeBatch) -> torch.Tensor:
        """[B, 1, groups * N, S] float additive bias over slots [0, S), S = max(lengths) + N: 0 where node i sees
        the slot (the request's committed slots, its ancestors and itself), -inf elsewhere; rows g * N + i
        repeat node i's row for each query head of a kv head (the grouped layout of ``_forward``). Built once
        per verify, not converted from a bool mask in every layer."""
        count = batch.max_nodes
        end = max(self.lengths) + count
        visible = torch.zeros(batch.batch_size, 1, count, end, dtype=torch.bool)
        parents = batch.parents.tolist()
        for row, length in enumerate(self.lengths):
            visible[row, 0, :, :length] = True
            visible[row, 0, :, length : length + count] = self._ancestors(tuple(parents[row]))
        bias = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        return bias.repeat(1, 1, self.groups, 1).to(self.device)

    def _ancestors(self, parents: tuple[int, ...]) -> torch.Tensor:
        """The [N, N] ancestor-or-self mask (root column always on) of one tree shape, built once."""
        mask = self._masks.get(parents)
        if mask is None:
            if len(self._masks) > 4096:
                self._masks.clear()
            mask = TreeBatch.from_parents(torch.tensor([parents]), torch.tensor([parents]),
                                          torch.tensor([len(parents)])).ancestor_mask()[0]
            self._masks[parents] = mask
        return mask

    def _batch_cache(self) -> StaticKVCache:
        if self.cache is None:
            raise AssertionError("start_batch() first: there is no batch cache")
        return self.cache

    def commit(self, kept_nodes: list[list[int]]) -> None:
        """After a verify forward: request b keeps its committed slots plus the tree slots of ``kept_nodes[b]``
        (the accepted path, root first): path node j moves to slot lengths[b] + j. Path nodes only increase
        and node j >= j, so moving in path order never overwrites a row still to be moved."""
        cache = self._batch_cache()
        rows, sources, targets = [], [], []
        for row, (length, nodes) in enumerate(zip(self.lengths, kept_nodes)):
            for offset, node in enumerate(nodes):
                if node != offset:
                    rows.append(row)
                    sources.append(length + node)
                    targets.append(length + offset)
        if rows:
            row_index = torch.tensor(rows, device=self.device)
            source = torch.tensor(sources, device=self.device)
            target = torch.tensor(targets, device=self.device)
            # [layers, 2, k, kv_heads, D] gathered first, then scattered: overlaps are safe
            cache.kv[:, :, row_index, :, target] = cache.kv[:, :, row_index, :, source]
        self.lengths = [length + len(nodes) for length, nodes in zip(self.lengths, kept_nodes)]
        cache.lengths = list(self.lengths)

    def select(self, rows: list[int]) -> None:
        """Keeps only the given requests (finished ones leave the batch)."""
        cache = self._batch_cache()
        keep = torch.tensor(rows, dtype=torch.int64, device=self.device)
        cache.kv = cache.kv.index_select(2, keep)
        self.lengths = [self.lengths[row] for row in rows]
        cache.lengths = list(self.lengths)


def target_runner_for(model: PreTrainedModel, static: bool | None = None) -> TargetRunner:
    """The fastest runner that reproduces ``model``: the static-cache runner for Llama-style models, else
    transformers' own forward (``TransformersRunner``). ``static``: force one (True fails for unsupported models)."""
    if static is None:
        static = supports(model)
    return StaticTargetRunner(model) if static else TransformersRunner(model)
