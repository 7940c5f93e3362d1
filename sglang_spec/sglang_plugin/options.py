"""Tree-speculation server options: parsed by SGLang's own argparse parser, attached to its ServerArgs, checked
against the resolved configuration at start-up.

    --speculative-tree-policy {eagle,chain,sequoia,specexec}   default: unset, SGLang's behaviour unchanged
    --speculative-tree-budget N          draft nodes per request (SGLang's num_draft_tokens = N + 1)
    --speculative-tree-depth D           draft steps (SGLang's speculative_num_steps)
    --speculative-tree-topk K            candidates per expanded node (SGLang's speculative_eagle_topk)
    --speculative-acceptance-profile P   JSON profile for sequoia (``sglang-spec calibrate``)
    --speculative-relaxed-acceptance N,DELTA   LOSSY: TensorRT-LLM's thinking-phase rule (DeepSeek-R1)

This module imports no sglang at import time; the checks that need resolved values take the ServerArgs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from sglang_spec.errors import SpecError
from sglang_spec.tree.policies import POLICY_NAMES, TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile

ATTRIBUTE = "_sglang_spec_tree"  # where the parsed options ride on ServerArgs (pickled into subprocesses)
TREE_ALGORITHMS = ("EAGLE", "NEXTN")
DEFAULTS = {"budget": 8, "depth": 4, "topk": 4}
# attention backends whose target-verify path takes a tree mask (sglang-internals §9); MLA models only fa3 / triton
MHA_TREE_BACKENDS = ("flashinfer", "fa3", "triton", "fa4")
MLA_TREE_BACKENDS = ("fa3", "triton")
THINKING_PARSERS = ("deepseek-r1", "deepseek-v3", "qwen3", "glm45", "kimi", "step3", "gpt-oss", "minimax")


@dataclass(frozen=True)
class TreeServerOptions:
    policy: str
    budget: int
    depth: int
    topk: int
    profile_path: str | None = None
    relaxed_top_n: int | None = None
    relaxed_delta: float | None = None

    @property
    def relaxed(self) -> bool:
        return self.relaxed_top_n is not None

    def load_profile(self) -> AcceptanceProfile | None:
        return None if self.profile_path is None else AcceptanceProfile.from_json(self.profile_path)

    def tree_policy(self) -> TreePolicy:
        return TreePolicy(self.policy, budget=self.budget, depth=self.depth, topk=self.topk, profile=self.load_profile())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tree speculation (sglang_spec)")
    group.add_argument("--speculative-tree-policy", choices=POLICY_NAMES, default=None,
                       help="shape of the MTP draft tree; unset keeps SGLang's behaviour")
    group.add_argument("--speculative-tree-budget", type=int, default=None,
                       help=f"draft nodes per request, root excluded (default {DEFAULTS['budget']})")
    group.add_argument("--speculative-tree-depth", type=int, default=None,
                       help=f"most draft tokens on one path (default {DEFAULTS['depth']})")
    group.add_argument("--speculative-tree-topk", type=int, default=None,
                       help=f"candidates per expanded node (default {DEFAULTS['topk']}; chain uses 1)")
    group.add_argument("--speculative-acceptance-profile", default=None, metavar="PATH",
                       help="acceptance profile JSON (sglang-spec calibrate); required by sequoia")
    group.add_argument("--speculative-relaxed-acceptance", default=None, metavar="TOP_N,DELTA",
                       help="LOSSY opt-in: accept thinking-phase drafts in the target's top-N within DELTA of the "
                            "top probability (TensorRT-LLM's rule for DeepSeek-R1)")


def parse_relaxed(text: str) -> tuple[int, float]:
    try:
        top_n_text, delta_text = text.split(",")
        top_n, delta = int(top_n_text), float(delta_text)
    except ValueError:
        raise SpecError(f"--speculative-relaxed-acceptance takes TOP_N,DELTA (e.g. 10,0.6), got {text!r}") from None
    if top_n < 1 or not 0 <= delta <= 1:
        raise SpecError(f"--speculative-relaxed-acceptance needs TOP_N >= 1 and 0 <= DELTA <= 1, got {text!r}")
    return top_n, delta


def from_namespace(args: argparse.Namespace) -> TreeServerOptions | None:
    """The options given on the command line, checked on their own; None when tree speculation is off."""
    policy = getattr(args, "speculative_tree_policy", None)
    tree_flags = ("speculative_tree_budget", "speculative_tree_depth", "speculative_tree_topk",
                  "speculative_acceptance_profile", "speculative_relaxed_acceptance")
    if policy is None:
        given = [name for name in tree_flags if getattr(args, name, None) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise SpecError(f"{flag} needs --speculative-tree-policy (one of {', '.join(POLICY_NAMES)})")
        return None
    budget = args.speculative_tree_budget if args.speculative_tree_budget is not None else DEFAULTS["budget"]
    depth = args.speculative_tree_depth if args.speculative_tree_depth is not None else DEFAULTS["depth"]
    topk = 1 if policy == "chain" else (args.speculative_tree_topk or DEFAULTS["topk"])
    if policy == "chain" and args.speculative_tree_topk not in (None, 1):
        raise SpecError("the chain policy drafts one candidate per depth; drop --speculative-tree-topk or set it to 1")
    if policy == "chain":
        budget = min(budget, depth)
    profile = args.speculative_acceptance_profile
    if profile is not None and not Path(profile).exists():
        raise SpecError(f"--speculative-acceptance-profile {profile} does not exist")
    relaxed = parse_relaxed(args.speculative_relaxed_acceptance) if args.speculative_relaxed_acceptance else (None, None)
    options = TreeServerOptions(policy, budget, depth, topk, profile, *relaxed)
    options.tree_policy()  # budget / depth / topk ranges, sequoia needs a profile, eagle slot capacity
    return options


def apply_to_server_args(options: TreeServerOptions, server_args) -> None:
    """Before resolution: the tree shape becomes SGLang's own draft shape (steps, topk, verify tokens)."""
    setattr(server_args, ATTRIBUTE, options)
    for name, value in (("speculative_num_steps", options.depth), ("speculative_eagle_topk", options.topk),
                        ("speculative_num_draft_tokens", options.budget + 1)):
        current = getattr(server_args, name)
        if current is not None and current != value:
            flag = "--" + name.replace("_", "-")
            raise SpecError(f"{flag} {current} contradicts the tree options (which set it to {value}); drop {flag}")
        setattr(server_args, name, value)


def validate_resolved(options: TreeServerOptions, config) -> None:
    """Start-up checks against resolved settings (``config`` is SGLang's resolved view of ServerArgs)."""
    algorithm = (config.speculative_algorithm or "").upper()
    if algorithm not in TREE_ALGORITHMS:
        raise SpecError(
            f"--speculative-tree-policy needs --speculative-algorithm NEXTN or EAGLE (got {algorithm or 'none'})"
        )
    topk, steps = config.speculative_eagle_topk, config.speculative_num_steps
    capacity = topk + (steps - 1) * topk * topk
    if options.budget > capacity:
        raise SpecError(
            f"--speculative-tree-budget {options.budget} exceeds the {capacity} draft tokens that topk {topk} and "
            f"depth {steps} can produce (topk + (depth-1)*topk^2); raise --speculative-tree-topk or -depth"
        )
    backend = getattr(config, "attention_backend", None)
    is_mla = bool(getattr(config, "_sglang_spec_is_mla", False))
    if topk > 1 and backend is not None:
        allowed = MLA_TREE_BACKENDS if is_mla else MHA_TREE_BACKENDS
        if backend not in allowed:
            what = "an MLA model (DeepSeek)" if is_mla else "this model"
            raise SpecError(
                f"attention backend {backend} cannot verify trees for {what}; use --attention-backend "
                f"{' or '.join(allowed)}, or --speculative-tree-policy chain"
            )
    if options.relaxed:
        parser = getattr(config, "reasoning_parser", None)
        if parser not in THINKING_PARSERS:
            raise SpecError(
                "--speculative-relaxed-acceptance applies inside thinking spans only: it needs a thinking model "
                "served with --reasoning-parser (e.g. deepseek-r1)"
            )
