"""Token trees: structure, acceptance profiles, the policies and the drafter interface, the Sequoia DP and sizing,
encoders."""

from sglang_spec.tree.batch import FlashInferIndptrs, FlashInferPlan, TreeBatch, encode_flashinfer_mask, with_prefix
from sglang_spec.tree.candidates import (
    CandidateSource,
    Candidates,
    GrowingTree,
    ProfileCandidates,
)
from sglang_spec.tree.encode_sglang import (
    SGLangDraftEncoding,
    SGLangVerifyMetadata,
    TreeMaskMode,
    decode_sglang_draft,
    encode_sglang_draft,
    encode_sglang_verify,
)
from sglang_spec.tree.proposal import DraftSources, DraftTree
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.policies import POLICY_NAMES, TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile, SourceCounts
from sglang_spec.tree.sequoia import SequoiaPlan, sequoia_plan, sequoia_table
from sglang_spec.tree.sizing import TreeSizeChoice, choose_speculation, choose_tree_size
from sglang_spec.tree.token_tree import MAX_BUDGET, MAX_DEPTH, MAX_TREE_NODES, TokenTree

__all__ = [
    "AcceptanceProfile",
    "CandidateSource",
    "Candidates",
    "DraftSources",
    "DraftTree",
    "FlashInferIndptrs",
    "FlashInferPlan",
    "GrowingTree",
    "MAX_BUDGET",
    "MAX_DEPTH",
    "MAX_TREE_NODES",
    "POLICY_NAMES",
    "ProfileCandidates",
    "SGLangDraftEncoding",
    "SGLangVerifyMetadata",
    "SequoiaPlan",
    "SourceCounts",
    "TokenTree",
    "TreeBatch",
    "TreeDrafter",
    "TreeMaskMode",
    "TreePolicy",
    "TreeSizeChoice",
    "choose_speculation",
    "choose_tree_size",
    "decode_sglang_draft",
    "encode_flashinfer_mask",
    "encode_sglang_draft",
    "encode_sglang_verify",
    "sequoia_plan",
    "sequoia_table",
    "with_prefix",
]
