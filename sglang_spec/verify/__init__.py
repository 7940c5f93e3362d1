"""Reference verification rules (pure torch, batched; padded requests are no-ops).

Lossless: ``verify_greedy`` (temperature 0), ``verify_sample_match`` (deterministic top-k candidate trees,
SpecExec), ``verify_candidate_first`` (the same trees, SGLang's target-only sampling: ``verify/target_only.py``),
``verify_rejection(rule="swor")`` (children sampled without replacement, Sequoia) and
``verify_rejection(rule="iid")`` (children sampled i.i.d., SpecInfer). LOSSY, opt-in only: ``relaxed``.
Every rule but typical acceptance is a ``WalkRule`` run by the one walk in ``verify/walk.py``.
"""

from sglang_spec.verify.greedy import verify_greedy
from sglang_spec.verify.rejection import RejectionRule, RejectionStep, rejection_step, verify_rejection
from sglang_spec.verify.relaxed import (
    RelaxedAcceptance,
    RelaxedRule,
    RelaxedVerifyResult,
    verify_relaxed_top_n,
    verify_relaxed_topn_delta,
    verify_typical,
)
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.sample_match import verify_sample_match
from sglang_spec.verify.target_only import CandidateFirstRule, verify_candidate_first
from sglang_spec.verify.walk import MatchRule, WalkRule, walk, walk_matching_children

__all__ = [
    "CandidateFirstRule",
    "MatchRule",
    "RejectionRule",
    "RejectionStep",
    "RelaxedAcceptance",
    "RelaxedRule",
    "RelaxedVerifyResult",
    "VerifyResult",
    "WalkRule",
    "rejection_step",
    "verify_greedy",
    "verify_rejection",
    "verify_relaxed_top_n",
    "verify_relaxed_topn_delta",
    "verify_sample_match",
    "verify_typical",
    "walk",
    "verify_candidate_first",
    "walk_matching_children",
]
