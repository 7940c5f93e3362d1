"""LOSSY relaxed acceptance. These rules change the output distribution and exist only as an explicit opt-in.

* ``verify_relaxed_top_n_delta`` (TensorRT-LLM ``use_relaxed_acceptance_for_thinking``, for DeepSeek-R1): with
  pi = softmax(logits) (plain softmax, no temperature), a draft d is accepted when it is among the top-N of pi and
  (it is the argmax, or pi(d) >= pi(argmax) - delta). delta applies inside the thinking span only (between
  ``<think>`` and ``</think>``); outside it delta is 0, so only the argmax (or an exact tie) passes. On a tree,
  among the acceptable children the one with the highest pi wins (ties: lower index), which is the greedy child
  whenever it is present. The bonus is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.walk import WalkRule, walk

LOSSY = True  # everything in this module


@dataclass(frozen=True)
class RelaxedAcceptance:
    """LOSSY opt-in (TensorRT-LLM, DeepSeek-R1 thinking): accept a draft in the target's top-N within ``delta``
    of the top probability while inside <think> ... </think>. Output no longer equals the target's.

    The one relaxed type: the reference decoder, the kernels and the SGLang plugin's options all take it.
    top_n:             candidates of the target considered (>= 1).
    delta:             probability slack inside a thinking span, in [0, 1]; strict (0) outside.
    think_begin_token, think_end_token: the tokens that open and close a thinking span; -1 while unknown (for
                       example parsed from a command line before the tokenizer is loaded): the state never toggles.
    """

    top_n: int
    delta: float
    think_begin_token: int = -1
    think_end_token: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.top_n, int) or self.top_n < 1:
            raise SpecError(f"relaxed top_n must be >= 1, got {self.top_n}")
        if not (0 <= self.delta <= 1):
            raise SpecError(f"relaxed delta is a probability difference in [0, 1], got {self.delta}")

    def thinking_after(self, tokens: Sequence[int], thinking: bool = False) -> bool:
        """The thinking state after ``tokens``, starting from ``thinking``."""
        for token in tokens:
            if token == self.think_begin_token:
                thinking = True
            elif token == self.think_end_token:
                thinking = False
        return thinking

    def toggle(self, thinking: torch.Tensor, token: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
        """[B] bool thinking state after ``token`` [B] where ``emitted`` [B] bool."""
        thinking = torch.where(emitted & (token == self.think_begin_token), torch.ones_like(thinking), thinking)
        return torch.where(emitted & (token == self.think_end_token), torch.zeros_like(thinking), thinking)


@dataclass(frozen=True, eq=False)
class RelaxedVerifyResult:
    """A VerifyResult plus each request's thinking state after its emitted tokens ([B] bool)."""

    result: VerifyResult
    thinking_after: torch.Tensor


class RelaxedRule(WalkRule):
    """TensorRT-LLM's top-N / delta rule on the target's top-N at every node: a child is acceptable when its token
    is among them and is the argmax or within the request's delta of the top probability; the most probable
    acceptable child wins (ties: lower index); the bonus is the argmax. Every child is scored."""

    first_acceptable_wins = False

    def __init__(
        self,
        batch: TreeBatch,
        top_tokens: torch.Tensor,
        top_probs: torch.Tensor,
        relaxed: RelaxedAcceptance,
        thinking: torch.Tensor,
    ) -> None:
        self.tokens = batch.tokens
        self.top_tokens = top_tokens
        self.top_probs = top_probs
        self.relaxed = relaxed
        self.thinking = thinking.clone().bool()

    def score(self, rows: torch.Tensor, node: torch.Tensor, child: torch.Tensor, trying: torch.Tensor) -> torch.Tensor:
        node_tokens = self.top_tokens[rows, node]  # [B, n]
        node_probs = self.top_probs[rows, node]  # [B, n]
        top_prob = node_probs[:, 0]
        slack = torch.where(self.thinking, torch.full_like(top_prob, self.relaxed.delta), torch.zeros_like(top_prob))
        token = self.tokens[rows, child].clamp(min=0)
        match = node_tokens == token[:, None]
        token_prob = torch.where(match, node_probs, torch.zeros_like(node_probs)).sum(-1)
        acceptable = match.any(-1) & ((token == node_tokens[:, 0]) | (token_prob >= top_prob - slack))
        return torch.where(acceptable, token_prob.double(), -torch.inf)

    def moved(self, token: torch.Tensor, moved: torch.Tensor) -> None:
        self.thinking = self.relaxed.toggle(self.thinking, token, moved)

    def bonus(self, rows: torch.Tensor, node: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        bonus = self.top_tokens[rows, node, 0]
        self.thinking = self.relaxed.toggle(self.thinking, bonus, real)
        return bonus


def verify_relaxed_top_n(
    batch: TreeBatch,
    top_tokens: torch.Tensor,
    top_probs: torch.Tensor,
    relaxed: RelaxedAcceptance,
    thinking: torch.Tensor,
) -> RelaxedVerifyResult:
    """The relaxed rule on precomputed top-N: top_tokens [B, N, n] int64 and top_probs [B, N, n] float32, the
    target's n most likely tokens at every node and their plain-softmax probabilities, most likely first;
    thinking: [B] bool, whether each request is inside a thinking span at the root. The state toggles on the
    think tokens among the accepted tokens and the bonus."""
    rule = RelaxedRule(batch, top_tokens, top_probs, relaxed, thinking)
    result = walk(batch, rule)
    return RelaxedVerifyResult(result, rule.thinking)


def verify_relaxed_top_n_delta(
    batch: TreeBatch, target_logits: torch.Tensor, relaxed: RelaxedAcceptance, thinking: torch.Tensor
) -> RelaxedVerifyResult:
    """target_logits: [B, N, V]; pi = softmax(logits) (plain softmax, no temperature); see
    ``verify_relaxed_top_n``."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    top_probs, top_tokens = torch.topk(probs, min(relaxed.top_n, probs.shape[-1]), dim=-1)
    return verify_relaxed_top_n(batch, top_tokens, top_probs, relaxed, thinking)
