"""Random-weight layers with DeepSeek-V3's dimensions, for timing a verify forward (they generate nothing).

One dense layer, one MoE layer and the output head, as ``bench/verify_cost.py`` times them: MLA attention with the
weights absorbed (every head attends over one latent KV row per token, as decode and verify kernels run it), a
SwiGLU MLP, DeepSeek-V3's router (sigmoid scores, top-8 experts within the 4 best of 8 groups) over 256 routed
experts plus one shared expert. Left out as negligible or beside the point: RoPE, the embedding lookup, FP8 weights
(bf16 here) and FlashMLA (attention is plain matmuls, so its share of the time is an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ModelDims:
    """A DeepSeek-V3 layer's dimensions (config.json names in comments)."""

    hidden: int = 7168  # hidden_size
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    heads: int = 128  # num_attention_heads
    qk_nope: int = 128  # qk_nope_head_dim
    qk_rope: int = 64  # qk_rope_head_dim
    v_head: int = 128  # v_head_dim
    dense_intermediate: int = 18432  # intermediate_size
    moe_intermediate: int = 2048  # moe_intermediate_size
    routed_experts: int = 256  # n_routed_experts
    experts_per_token: int = 8  # num_experts_per_tok
    expert_groups: int = 8  # n_group
    groups_per_token: int = 4  # topk_group
    shared_experts: int = 1  # n_shared_experts
    vocab: int = 129280  # vocab_size
    layers: int = 61  # num_hidden_layers
    dense_layers: int = 3  # first_k_dense_replace


DEEPSEEK_V3 = ModelDims()
TINY = ModelDims(hidden=64, q_lora_rank=32, kv_lora_rank=16, heads=4, qk_nope=16, qk_rope=8, v_head=16,
                 dense_intermediate=128, moe_intermediate=32, routed_experts=8, experts_per_token=2, expert_groups=2,
                 groups_per_token=1, vocab=512)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class RandomWeights:
    """Seeded random weights scaled by 1 / sqrt(fan in), so activations stay O(1) through the layers."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator(device=device).manual_seed(0)

    def __call__(self, *shape: int) -> torch.Tensor:
        fan_in = shape[-2] if len(shape) > 1 else shape[-1]
        weight = torch.randn(*shape, generator=self.generator, device=self.device, dtype=self.dtype)
        return weight.mul_(fan_in ** -0.5)


class LatentAttention:
    """MLA as decode and verify kernels run it (weights absorbed): every head attends over the one latent KV
    row per token (kv_lora_rank + qk_rope wide), prefix rows all visible, tree rows under a causal mask."""

    def __init__(self, dims: ModelDims, weight: RandomWeights) -> None:
        d = dims
        self.dims = d
        self.q_down = weight(d.hidden, d.q_lora_rank)
        self.q_up = weight(d.q_lora_rank, d.heads * (d.qk_nope + d.qk_rope))
        self.kv_down = weight(d.hidden, d.kv_lora_rank + d.qk_rope)
        self.k_absorb = weight(d.heads, d.qk_nope, d.kv_lora_rank)
        self.v_absorb = weight(d.heads, d.kv_lora_rank, d.v_head)
        self.out = weight(d.heads * d.v_head, d.hidden)
        self.scale = (d.qk_nope + d.qk_rope) ** -0.5

    def __call__(self, x: torch.Tensor, cache: torch.Tensor, prefix: int) -> torch.Tensor:
        """x [B, n, hidden]; cache [B, >= prefix + n, kv_lora_rank + qk_rope] (the prefix rows filled)."""
        d = self.dims
        batch, nodes, _ = x.shape
        q = (_rms(x @ self.q_down) @ self.q_up).view(batch, nodes, d.heads, d.qk_nope + d.qk_rope)
        q_latent = torch.einsum("bnhd,hdl->bhnl", q[..., : d.qk_nope], self.k_absorb)  # [B, H, n, latent]
        query = torch.cat([q_latent, q[..., d.qk_nope:].transpose(1, 2)], -1).view(batch, d.heads * nodes, -1)
        cache[:batch, prefix : prefix + nodes] = x @ self.kv_down  # the tree's own latent rows
        keys = cache[:batch, : prefix + nodes]  # [B, S, latent + rope]
        scores = torch.bmm(query, keys.transpose(1, 2)).mul_(self.scale).view(batch, d.heads, nodes, -1)
        causal = torch.ones(nodes, nodes, dtype=torch.bool, device=x.device).tril()
        scores[..., prefix:].masked_fill_(~causal, -math.inf)
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(x.dtype).view(batch, d.heads * nodes, -1)
        latent = torch.bmm(probs, keys[..., : d.kv_lora_rank]).view(batch, d.heads, nodes, d.kv_lora_rank)
        values = torch.einsum("bhnl,hlv->bnhv", latent, self.v_absorb).reshape(batch, nodes, d.heads * d.v_head)
        return values @ self.out


class GatedMLP:
    """SwiGLU feed-forward: the dense layers' MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, weight: RandomWeights) -> None:
        self.gate, self.up = weight(hidden, intermediate), weight(hidden, intermediate)
        self.down = weight(intermediate, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.gate) * (x @ self.up)) @ self.down


class RoutedExperts:
    """DeepSeek-V3's MoE: sigmoid router scores, top-k experts within the best groups, one shared expert.

    Experts run as one grouped GEMM (``torch._grouped_mm``: only experts that received tokens read their weights)
    where this torch and GPU provide it and it agrees with the per-expert loop on a small input; else the loop
    (which reads only the experts in use, too, at one launch set per expert)."""

    def __init__(self, dims: ModelDims, weight: RandomWeights) -> None:
        d = dims
        self.dims = d
        self.router = weight(d.hidden, d.routed_experts)
        self.gate = weight(d.routed_experts, d.hidden, d.moe_intermediate)
        self.up = weight(d.routed_experts, d.hidden, d.moe_intermediate)
        self.down = weight(d.routed_experts, d.moe_intermediate, d.hidden)
        self.shared = GatedMLP(d.hidden, d.shared_experts * d.moe_intermediate, weight)
        self.implementation = "loop"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (experts [T, k] int64, weights [T, k])."""
        d = self.dims
        scores = torch.sigmoid((x @ self.router).float())  # [T, E]
        grouped = scores.view(-1, d.expert_groups, d.routed_experts // d.expert_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), -1).values.sum(-1)  # [T, G]
        best_groups = group_scores.topk(d.groups_per_token, -1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], 1), 0.0)
        weights, experts = scores.topk(d.experts_per_token, -1)
        return experts, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        run = self._grouped if self.implementation == "grouped_mm" else self._loop
        return run(x, experts, weights) + self.shared(x)

    def _sorted(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order [T*k]: assignments sorted by expert, token [T*k]: their tokens, rows [T*k, hidden])."""
        order = experts.reshape(-1).argsort()
        token = order // experts.shape[1]
        return order, token, x[token]

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, token, rows = self._sorted(x, experts)
        ends = torch.bincount(experts.reshape(-1), minlength=self.dims.routed_experts).cumsum(0).to(torch.int32)
        hidden = torch.nn.functional.silu(torch._grouped_mm(rows, self.gate, offs=ends)) * torch._grouped_mm(
            rows, self.up, offs=ends)
        out = torch._grouped_mm(hidden, self.down, offs=ends) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def _loop(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, token, rows = self._sorted(x, experts)
        counts = torch.bincount(experts.reshape(-1), minlength=self.dims.routed_experts).tolist()  # host read
        pieces, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                part = rows[start : start + count]
                hidden = torch.nn.functional.silu(part @ self.gate[expert]) * (part @ self.up[expert])
                pieces.append(hidden @ self.down[expert])
                start += count
        out = torch.cat(pieces) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def choose_implementation(self) -> str:
        """Grouped GEMM when it runs here and matches the loop on a small input; returns what was chosen and why."""
        if not hasattr(torch, "_grouped_mm"):
            return "loop (this torch has no _grouped_mm)"
        x = torch.randn(24, self.dims.hidden, device=self.router.device, dtype=self.router.dtype)
        experts, weights = self.route(x)
        try:
            grouped = self._grouped(x, experts, weights)
        except (RuntimeError, NotImplementedError) as error:
            first_line = (str(error).splitlines() or [type(error).__name__])[0]
            return f"loop (_grouped_mm failed: {first_line[:120]})"
        looped = self._loop(x, experts, weights)
        mismatch = float((grouped.float() - looped.float()).norm() / looped.float().norm().clamp(min=1e-12))
        if not mismatch < 2e-2:  # bf16 sums in another order differ by ~1e-3; a wrong grouping by ~1
            return f"loop (_grouped_mm disagrees with the loop: relative error {mismatch:.3g})"
        self.implementation = "grouped_mm"
        return "grouped_mm"


class Layer:
    """One decoder layer: attention then a feed-forward (dense MLP or MoE), pre-norm residuals."""

    def __init__(self, attention: LatentAttention, feed_forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.attention, self.feed_forward = attention, feed_forward

    def __call__(self, x: torch.Tensor, cache: torch.Tensor, prefix: int) -> torch.Tensor:
        x = x + self.attention(_rms(x), cache, prefix)
        flat = x.view(-1, x.shape[-1])
        return x + self.feed_forward(_rms(flat)).view_as(x)


class VerifyModel:
    """The pieces timed: one dense layer, one MoE layer, the output head; a latent cache shared by both layers
    (timing only: each layer writes the tree's rows after the same prefix)."""

    def __init__(self, dims: ModelDims, device: str, dtype: torch.dtype, max_batch: int, max_tokens: int) -> None:
        weight = RandomWeights(device, dtype)
        self.dims = dims
        self.dense = Layer(LatentAttention(dims, weight), GatedMLP(dims.hidden, dims.dense_intermediate, weight))
        self.experts = RoutedExperts(dims, weight)
        self.moe = Layer(LatentAttention(dims, weight), self.experts)
        self.head = weight(dims.hidden, dims.vocab)
        self.cache = torch.randn(max_batch, max_tokens, dims.kv_lora_rank + dims.qk_rope, device=device, dtype=dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x).view(-1, x.shape[-1]) @ self.head


def weight_bytes(dims: ModelDims, bytes_per_element: int = 2) -> int:
    """Bytes of the timed pieces' weights (two attention blocks, dense MLP, experts, shared expert, head)."""
    d = dims
    attention = (d.hidden * d.q_lora_rank + d.q_lora_rank * d.heads * (d.qk_nope + d.qk_rope)
                 + d.hidden * (d.kv_lora_rank + d.qk_rope) + d.heads * d.kv_lora_rank * (d.qk_nope + d.v_head)
                 + d.heads * d.v_head * d.hidden)
    experts = 3 * d.hidden * d.moe_intermediate * (d.routed_experts + d.shared_experts) + d.hidden * d.routed_experts
    return bytes_per_element * (2 * attention + 3 * d.hidden * d.dense_intermediate + experts + d.hidden * d.vocab)
