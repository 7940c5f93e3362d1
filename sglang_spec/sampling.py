"""Sampling parameters, the target distribution they define, and inverse-CDF sampling from uniform coins.

Randomness is always an input (``coins`` in [0, 1)), never drawn inside these functions, so a kernel and its
reference can be compared exactly and a losslessness test can replay the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_spec.errors import SpecError

# Temperatures below this are greedy (argmax), everywhere sampling happens: here, the decoder, the kernels and
# their references. Dividing logits by a tiny temperature overflows float32 (1 / 3e-39 is past its maximum) and
# turns the distribution into NaN; below 1e-5 a tempered distribution already is the argmax for any logit gap
# float32 can resolve at that scale, so nothing a user could want is lost.
TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off. Applied in the order temperature, top-k, top-p.

    A temperature below ``TEMPERATURE_FLOOR`` (1e-5) is greedy: it is stored as 0."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < TEMPERATURE_FLOOR:
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise SpecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs_from_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Sampling distribution per row.

    logits: [B, ..., V] float. temperature / top_k / top_p: [B] per request (temperature below
    ``TEMPERATURE_FLOOR``, 0 included = one-hot argmax, top_k 0 = all tokens, top_p 1 = all tokens). Returns
    float32 probabilities of the same shape as logits.

    With w = exp((logits - max) / temperature):
    * top-k keeps every token with w >= the k-th largest w (ties at the threshold are all kept);
    * top-p keeps, among those, every token with w >= t, where t is the largest value for which the kept mass
      of tokens with w >= t still reaches top_p times the mass kept by top-k (ties kept again).
    The kept mass is renormalised. These threshold definitions are what a GPU kernel can compute without
    sorting the vocabulary (``kernels/verify_accept.py`` finds the same thresholds by a k-ary search over float
    bit patterns). Whether any row uses top-k or top-p is read on the host: pass those two as CPU tensors to keep
    a device stream unsynced.
    """
    batch = logits.shape[0]
    vocab = logits.shape[-1]
    flat = logits.reshape(batch, -1, vocab).float()
    shape = (batch, 1, 1)
    temperature = temperature.to(flat.device, torch.float32).reshape(shape)
    is_greedy = ~(temperature >= TEMPERATURE_FLOOR)  # NaN too: never a NaN distribution
    safe_temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    weights = torch.exp((flat - flat.max(-1, keepdim=True).values) * (1.0 / safe_temperature))
    top_k = top_k.to(flat.device, torch.int64).reshape(shape)
    top_p = top_p.to(flat.device, torch.float32).reshape(shape)
    # the thresholds need the sorted weights only where top-p is on; top-k alone needs the k largest, and with
    # both off every weight is kept (a full sort of [rows, V] costs as much as a forward of a small model)
    uses_top_p = bool((top_p < 1).any())
    k_on = (top_k > 0) & (top_k < vocab)
    uses_top_k = bool(k_on.any())
    if not uses_top_p and not uses_top_k:
        threshold = torch.zeros_like(temperature)
    elif not uses_top_p:
        largest = int(torch.where(k_on, top_k, torch.ones_like(top_k)).max())
        top_weights = torch.topk(weights, largest, dim=-1).values
        kth = torch.gather(top_weights, -1, (top_k.clamp(min=1, max=largest) - 1).expand(batch, flat.shape[1], 1))
        threshold = torch.where(k_on, kth, torch.zeros_like(kth))
    else:
        sorted_weights = torch.sort(weights, dim=-1, descending=True).values
        kth_index = (top_k.clamp(min=1, max=vocab) - 1).expand(batch, flat.shape[1], 1)
        kth = torch.gather(sorted_weights, -1, kth_index)
        kth = torch.where(k_on, kth, torch.zeros_like(kth))
        kept = torch.where(sorted_weights >= kth, sorted_weights, torch.zeros_like(sorted_weights))
        # mass of tokens with w >= sorted[i] is the cumulative sum up to the last tie of sorted[i]; the first i
        # whose cumulative sum reaches the target gives the top-p threshold sorted[i]
        cumulative = torch.cumsum(kept, dim=-1)
        target = top_p * cumulative[..., -1:]
        first = (cumulative < target).sum(-1, keepdim=True).clamp(max=vocab - 1)
        top_p_threshold = torch.where(top_p < 1, torch.gather(sorted_weights, -1, first), torch.zeros_like(kth))
        threshold = torch.maximum(kth, top_p_threshold)
    filtered = weights if not (uses_top_k or uses_top_p) else torch.where(weights >= threshold, weights, 0.0)
    filtered = filtered / filtered.sum(-1, keepdim=True)
    if not bool(is_greedy.any()):
        return filtered.reshape(logits.shape)
    one_hot = torch.nn.functional.one_hot(flat.argmax(-1), vocab).to(torch.float32)
    return torch.where(is_greedy, one_hot, filtered).reshape(logits.shape)


def sample_from_probs(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row: the first token whose cumulative probability exceeds ``coin * total``.

    probs: [..., V] non-negative (need not be normalised). coins: [...] in [0, 1). Returns int64 [...].
    A token with zero probability is never returned; when rounding puts ``coin * total`` at or past the last
    cumulative value, the last token with positive probability is returned.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    threshold = coins.double().unsqueeze(-1) * cdf[..., -1:]
    index = (cdf <= threshold).sum(-1)
    positive = probs > 0
    last_positive = probs.shape[-1] - 1 - positive.flip(-1).to(torch.int64).argmax(-1)
    return torch.where(index >= probs.shape[-1], last_positive, index).clamp(max=probs.shape[-1] - 1)
