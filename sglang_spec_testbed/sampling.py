"""Stand-ins for SGLang's sampling-verify kernels, which exist only on CUDA (pure torch).

Without them SGLang's EAGLE verify commits the argmax on a CPU whatever the temperature
(``eagle_utils._verify_uses_greedy`` lists ``is_cpu``), so a sampled request would silently decode greedily. With
them the CPU test bed runs SGLang's real sampling path: temperature softmax, top-k / top-p renormalisation, and
``tree_speculative_sampling_target_only`` with SGLang's (seeded) coins.

``tree_speculative_sampling_target_only`` follows ``sgl_kernel/speculative/sampling.cuh`` line by line: from the
root with the root's coin, walk the current node's children in sibling order accumulating their target
probabilities; accept child x when p(x) > 0 and (coin < acc / threshold_acc or p(x) >= threshold_single), then
continue from x with x's coin; a rejected child's mass is copied into ``draft_probs`` (removing it from the
residual). The bonus token is drawn from relu(target - draft) at the last node with the final coin (the first
index whose running sum exceeds coin * total), draft taken as 0 after a full-depth accept.
"""

from __future__ import annotations

import torch


def tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                          retrive_next_token, retrive_next_sibling, uniform_samples,
                                          uniform_samples_for_final_sampling, target_probs, draft_probs,
                                          threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    batch, num_draft_tokens = candidates.shape
    num_speculative_tokens = accept_index.shape[1]
    threshold_acc = max(float(threshold_acc), 1e-9)
    for b in range(batch):
        next_token = retrive_next_token[b].tolist()
        next_sibling = retrive_next_sibling[b].tolist()
        retrieve = retrive_index[b].tolist()
        tokens = candidates[b].tolist()
        coins = uniform_samples[b].float()
        node = 0  # local index of the node whose children are being tried
        coin = float(coins[0])
        last = retrieve[0]
        accept_index[b, 0] = last
        accepted = 0
        probability_sum = torch.zeros((), dtype=torch.float32)
        current = 0
        for _ in range(1, num_speculative_tokens):
            current = next_token[current]
            while current != -1:
                token = tokens[current]
                single = target_probs[b, node, token].float()
                probability_sum = probability_sum + single
                if single > 0 and (coin < float(probability_sum / threshold_acc) or float(single) >= threshold_single):
                    probability_sum = torch.zeros((), dtype=torch.float32)
                    node = current
                    coin = float(coins[current])
                    predicts[last] = token
                    accepted += 1
                    accept_index[b, accepted] = retrieve[current]
                    last = retrieve[current]
                    break
                draft_probs[b, node, token] = target_probs[b, node, token]
                current = next_sibling[current]
            if current == -1:
                break
        accept_token_num[b] = accepted
        residual = target_probs[b, node].float()
        if accepted != num_speculative_tokens - 1:
            residual = (residual - draft_probs[b, node].float()).clamp(min=0)
        predicts[last] = _sample_first_above(residual, float(uniform_samples_for_final_sampling[b]))


def _sample_first_above(weights: torch.Tensor, coin: float) -> int:
    """The first index whose running sum exceeds coin * total; the last positive index when rounding leaves
    none (the kernel's ``last_valid_id``), the last index when there is no mass at all."""
    running = torch.cumsum(weights, dim=0)
    above = torch.nonzero((running > coin * running[-1]) & (weights > 0))
    if above.numel():
        return int(above[0])
    positive = torch.nonzero(weights > 0)
    return int(positive[-1]) if positive.numel() else weights.numel() - 1


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keeps each row's probabilities at or above its k-th largest (ties kept) and renormalises."""
    rows, vocab = probs.shape
    k = torch.as_tensor(top_k, device=probs.device).reshape(-1).expand(rows).long().clamp(1, vocab)
    ordered = torch.sort(probs.float(), dim=-1, descending=True).values
    pivot = ordered.gather(1, (k - 1)[:, None])
    kept = torch.where(probs.float() >= pivot, probs.float(), torch.zeros_like(probs, dtype=torch.float32))
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keeps each row's most likely tokens up to cumulative mass top_p (the token crossing it included, ties at the
    threshold kept) and renormalises."""
    rows = probs.shape[0]
    p = torch.as_tensor(top_p, device=probs.device, dtype=torch.float32).reshape(-1).expand(rows)
    ordered = torch.sort(probs.float(), dim=-1, descending=True).values
    mass_before = torch.cumsum(ordered, dim=-1) - ordered
    keep = mass_before < p[:, None]
    keep[:, 0].fill_(True)  # a scalar fill, no host tensor: capturable in a CUDA graph
    pivot = torch.where(keep, ordered, torch.full_like(ordered, float("inf"))).min(-1, keepdim=True).values
    kept = torch.where(probs.float() >= pivot, probs.float(), torch.zeros_like(probs, dtype=torch.float32))
    return kept / kept.sum(-1, keepdim=True)
