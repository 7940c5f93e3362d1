"""``sglang-spec tree``: build a tree with a policy and show its shape and expected accept length."""

from __future__ import annotations

import argparse
import json

from sglang_spec.cli.parser import path_arg
from sglang_spec.tree.candidates import ProfileCandidates
from sglang_spec.tree.policies import DEFAULT_TOPK, MAX_TOPK, POLICY_NAMES, TreePolicy
from sglang_spec.tree.profile import DEFAULT_PROFILE, AcceptanceProfile
from sglang_spec.tree.token_tree import TokenTree
from sglang_spec.tree.proposal import DraftSources


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "tree",
        help="build a token tree and print its shape and expected accept length",
        description=(
            "Builds a tree with one of the four policies. Without a model, candidates come from the acceptance "
            "profile itself (the rank-r child of a depth-d node has draft probability profile[d][r]), so eagle "
            "and specexec show the shapes they grow for a drafter calibrated to that profile."
        ),
    )
    parser.add_argument("--policy", required=True, choices=POLICY_NAMES)
    parser.add_argument("--budget", type=int, required=True, help="draft nodes, root excluded")
    parser.add_argument("--depth", type=int, required=True, help="most draft tokens on one root-to-leaf path")
    parser.add_argument(
        "--topk",
        type=int,
        default=None,
        help=f"candidates per expanded node, at most {MAX_TOPK} (eagle beam width; specexec/sequoia max "
        "children); "
        + ", ".join(f"{name} {value}" for name, value in DEFAULT_TOPK.items() if name != "chain"),
    )
    parser.add_argument(
        "--acceptance",
        type=path_arg,
        default=None,
        metavar="PROFILE.json",
        help=f"acceptance profile ({{\"rank_acceptance\": [...]}}); default: the built-in {DEFAULT_PROFILE}",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    profile = AcceptanceProfile.load(args.acceptance)
    policy = TreePolicy(args.policy, budget=args.budget, depth=args.depth, topk=args.topk, profile=profile)
    tree = policy.build(0, DraftSources(mtp=ProfileCandidates(profile))).tree
    reach = profile.node_reach_probabilities(tree)
    expected = profile.expected_accept_length(tree)
    if args.json:
        print(
            json.dumps(
                {
                    "policy": policy.name,
                    "budget": policy.budget,
                    "depth": policy.depth,
                    "topk": policy.effective_topk,
                    "num_nodes": tree.num_nodes,
                    "tree_depth": tree.depth,
                    "parents": tree.parents.tolist(),
                    "depths": tree.depths.tolist(),
                    "ranks": tree.ranks.tolist(),
                    "expected_accept_length": expected,
                    "profile": profile.source,
                }
            )
        )
        return 0
    print(
        f"policy {policy.name}: {tree.budget} draft nodes (budget {policy.budget}), depth {tree.depth} "
        f"(limit {policy.depth}), profile {profile.source}"
    )
    print(render_tree(tree, reach))
    print(f"expected accept length: {expected:.4f} tokens per step (bonus token included)")
    return 0


def render_tree(tree: TokenTree, reach: list[float]) -> str:
    """Indented drawing: one line per node with its index, parent, depth, 1-based rank and P(on accepted path)."""
    children = tree.children()
    ranks = tree.ranks.tolist()
    lines = ["node 0 (root)"]

    def visit(node: int, prefix: str) -> None:
        kids = children[node]
        for position, child in enumerate(kids):
            last = position == len(kids) - 1
            lines.append(
                f"{prefix}{'└── ' if last else '├── '}node {child}: rank {ranks[child] + 1}, "
                f"parent {node}, depth {int(tree.depths[child])}, reach {reach[child]:.4f}"
            )
            visit(child, prefix + ("    " if last else "│   "))

    visit(0, "")
    return "\n".join(lines)
