"""Reference verification rules (pure torch, batched; padded requests are no-ops).

Lossless: ``verify_greedy`` (temperature 0), ``verify_sample_match`` (deterministic top-k candidate trees,
SpecExec), ``verify_candidate_first`` (the same trees, SGLang's target-only sampling: ``verify/target_only.py``),
LOSSY, opt-in only: ``relaxed``. Every rule is a ``WalkRule`` run by the one walk in ``verify/walk.py``. Rules
for sampled drafts that nothing here drafts (Sequoia's SWOR, SpecInfer's i.i.d.) and Medusa's typical
acceptance are test references (``tests/reference_rules.py``).
"""

from sglang_spec.verify.greedy import verify_greedy
from sglang_spec.verify.relaxed import (
    RelaxedAcceptance,
    RelaxedRule,
    RelaxedVerifyResult,
    verify_relaxed_top_n,
    verify_relaxed_top_n_delta,
)
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.sample_match import verify_sample_match
from sglang_spec.verify.target_only import CandidateFirstRule, verify_candidate_first
from sglang_spec.verify.walk import MatchRule, WalkRule, walk, walk_matching_children

__all__ = [
    "CandidateFirstRule",
    "MatchRule",
    "RelaxedAcceptance",
    "RelaxedRule",
    "RelaxedVerifyResult",
    "VerifyResult",
    "WalkRule",
    "verify_greedy",
    "verify_relaxed_top_n",
    "verify_relaxed_top_n_delta",
    "verify_sample_match",
    "walk",
    "verify_candidate_first",
    "walk_matching_children",
]
