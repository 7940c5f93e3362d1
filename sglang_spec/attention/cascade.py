"""Tree attention as a cascade: the verified prefix without a mask, the tree with one, merged by log-sum-exp.

This is the plan for MLA (DeepSeek) tree verify on FlashInfer, whose MLA kernels take no custom mask:
every tree query attends to the request's whole prefix (a plain batched MLA decode over the paged latent cache,
N queries per request), and to its own ancestors among the N tree tokens (a small masked attention over the
tree's N latent rows); the two partial results are exact softmax pieces and merge exactly:

    o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b}),   lse = log(e^{lse_a} + e^{lse_b})

FlashInfer's ``merge_state`` does this merge on the GPU; note that FlashInfer reports lse in base 2. The
references here (natural log) define the semantics and are what the GPU path is to be checked against.

MLA in absorbed form: every head scores ``q_latent . c_kv + q_rope . k_rope`` against one shared latent row per
token (512 + 64 values for DeepSeek-V3) and reads ``c_kv`` as the value; the output stays in latent space (the
caller applies W_uv). Shapes: Q queries, H heads, L latent width, R rope width, P prefix rows, N tree rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_spec.tree.batch import with_prefix


@dataclass(frozen=True, eq=False)
class AttentionState:
    """out: [Q, H, Dv] softmax-weighted values; lse: [Q, H] natural-log sum of exp(scores) (-inf when empty)."""

    out: torch.Tensor
    lse: torch.Tensor


def merge_states(first: AttentionState, second: AttentionState) -> AttentionState:
    lse = torch.logaddexp(first.lse, second.lse)
    weight_first = torch.exp(first.lse - lse).nan_to_num(0.0)[..., None]
    weight_second = torch.exp(second.lse - lse).nan_to_num(0.0)[..., None]
    return AttentionState(first.out * weight_first + second.out * weight_second, lse)


def mla_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, scale: float,
    mask: torch.Tensor | None = None,
) -> AttentionState:
    """q_latent [Q, H, L], q_rope [Q, H, R]; c_kv [K, L], k_rope [K, R] shared by all heads; mask [Q, K] bool."""
    scores = (torch.einsum("qhl,kl->qhk", q_latent, c_kv) + torch.einsum("qhr,kr->qhk", q_rope, k_rope)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return AttentionState(torch.einsum("qhk,kl->qhl", weights, c_kv), lse)


def mla_tree_attention_cascade(
    q_latent: torch.Tensor, q_rope: torch.Tensor, prefix_c_kv: torch.Tensor, prefix_k_rope: torch.Tensor,
    tree_c_kv: torch.Tensor, tree_k_rope: torch.Tensor, tree_mask: torch.Tensor, scale: float,
) -> AttentionState:
    """One request: the N tree queries against the prefix (no mask) and against the tree (ancestor mask
    [N, N]), merged."""
    prefix = mla_attention(q_latent, q_rope, prefix_c_kv, prefix_k_rope, scale)
    tree = mla_attention(q_latent, q_rope, tree_c_kv, tree_k_rope, scale, mask=tree_mask)
    return merge_states(prefix, tree)


def mla_tree_attention_reference(
    q_latent: torch.Tensor, q_rope: torch.Tensor, prefix_c_kv: torch.Tensor, prefix_k_rope: torch.Tensor,
    tree_c_kv: torch.Tensor, tree_k_rope: torch.Tensor, tree_mask: torch.Tensor, scale: float,
) -> AttentionState:
    """The same attention in one piece: keys = prefix then tree, mask = all prefix columns + the ancestor mask."""
    c_kv = torch.cat([prefix_c_kv, tree_c_kv])
    k_rope = torch.cat([prefix_k_rope, tree_k_rope])
    full_mask = with_prefix(tree_mask, prefix_c_kv.shape[0])
    return mla_attention(q_latent, q_rope, c_kv, k_rope, scale, mask=full_mask)
