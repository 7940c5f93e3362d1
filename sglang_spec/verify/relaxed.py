"""LOSSY relaxed acceptance. These rules change the output distribution and exist only as an explicit opt-in.

* ``verify_relaxed_topn_delta`` (TensorRT-LLM ``use_relaxed_acceptance_for_thinking``, for DeepSeek-R1): with
  pi = softmax(logits) (plain softmax, no temperature), a draft d is accepted when it is among the top-N of pi and
  (it is the argmax, or pi(d) >= pi(argmax) - delta). delta applies inside the thinking span only (between
  ``<think>`` and ``</think>``); outside it delta is 0, so only the argmax (or an exact tie) passes. On a tree,
  among the acceptable children the one with the highest pi wins (ties: lower index), which is the greedy child
  whenever it is present. The bonus is the argmax.
* ``verify_typical`` (Medusa typical acceptance): with p_T = softmax(logits / T), a node's token is acceptable when
  p_T(x) > min(epsilon, alpha * exp(-H(p_T))); the accepted path is the deepest node whose whole path is
  acceptable, ties broken by the larger summed log p_T, then the lower index. The bonus is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.errors import SpecError
from sglang_spec.sampling import TEMPERATURE_FLOOR
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.verify.result import VerifyResult, finish
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


def verify_relaxed_topn_delta(
    batch: TreeBatch, target_logits: torch.Tensor, relaxed: RelaxedAcceptance, thinking: torch.Tensor
) -> RelaxedVerifyResult:
    """target_logits: [B, N, V]; pi = softmax(logits) (plain softmax, no temperature); see
    ``verify_relaxed_top_n``."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    top_probs, top_tokens = torch.topk(probs, min(relaxed.top_n, probs.shape[-1]), dim=-1)
    return verify_relaxed_top_n(batch, top_tokens, top_probs, relaxed, thinking)


def verify_typical(
    batch: TreeBatch, target_logits: torch.Tensor, temperature: float, epsilon: float, alpha: float
) -> VerifyResult:
    """target_logits: [B, N, V]. temperature 0 reduces to greedy. Medusa's defaults: epsilon 0.09, alpha 0.3."""
    if not temperature >= 0:  # NaN too
        raise SpecError(f"temperature must be >= 0, got {temperature}")
    if epsilon <= 0 or alpha <= 0:
        raise SpecError("typical acceptance needs epsilon > 0 and alpha > 0 (Medusa: 0.09 and 0.3)")
    batch_size, max_nodes = batch.tokens.shape
    logits = target_logits.float()
    argmax = logits.argmax(-1)
    if temperature < TEMPERATURE_FLOOR:  # greedy, as everywhere (1 / T would overflow)
        probs = torch.nn.functional.one_hot(argmax, logits.shape[-1]).float()
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))
    rows = torch.arange(batch_size, device=batch.device)
    path_ok = torch.zeros(batch_size, max_nodes, dtype=torch.bool, device=batch.device)
    path_ok[:, 0] = batch.num_nodes > 0
    path_score = torch.zeros(batch_size, max_nodes, dtype=torch.float64, device=batch.device)
    for node in range(1, max_nodes):
        parent = batch.parents[:, node]
        real = parent >= 0
        safe_parent = parent.clamp(min=0)
        token = batch.tokens[:, node].clamp(min=0)
        token_prob = probs[rows, safe_parent, token]
        ok = real & path_ok[rows, safe_parent] & (token_prob > threshold[rows, safe_parent])
        path_ok[:, node] = ok
        path_score[:, node] = torch.where(
            ok, path_score[rows, safe_parent] + torch.log(token_prob.double().clamp(min=1e-300)), 0.0
        )
    # deepest acceptable node; then larger summed log-prob; then lower index
    depth_key = torch.where(path_ok, batch.depths, torch.full_like(batch.depths, -1)).double()
    best_depth = depth_key.max(-1, keepdim=True).values
    candidate = path_ok & (depth_key == best_depth)
    score = torch.where(candidate, path_score, torch.full_like(path_score, -torch.inf))
    best = score.argmax(-1)
    depth = batch.max_depth()
    accepted = torch.full((batch_size, depth + 1), -1, dtype=torch.int64, device=batch.device)
    path_node = best.clone()
    node_depth = torch.where(batch.num_nodes > 0, batch.depths[rows, best], -1)
    for level in range(depth, -1, -1):
        here = node_depth == level
        accepted[:, level] = torch.where(here, path_node, accepted[:, level])
        path_node = torch.where(here, batch.parents[rows, path_node].clamp(min=0), path_node)
        node_depth = torch.where(here, node_depth - 1, node_depth)
    return finish(batch, accepted, argmax[rows, best])
