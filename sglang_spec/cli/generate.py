"""``sglang-spec generate``: tree-speculative decoding with the reference decoder, optionally checked against
plain decoding."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import (
    MAX_SAMPLING_TOP_K,
    TEMPERATURE_HELP,
    integer,
    number,
    path_arg,
    seed,
    temperature,
    text_arg,
)
from sglang_spec.decode.autotune import load_or_measure
from sglang_spec.decode.decoder import (
    GenerationConfig,
    GenerationOutput,
    SpeculativeDecoder,
    compare_with_plain,
    generate_plain,
)
from sglang_spec.errors import SpecError
from sglang_spec.files import check_output_path
from sglang_spec.models.cache_dir import cache_root
from sglang_spec.models.registry import LoadedModel, load_head_for, shipped_profile_path
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.tree.cost_model import choose_speculation
from sglang_spec.tree.policies import MAX_TOPK, POLICY_NAMES, TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "generate",
        help="decode with tree speculation (reference decoder) and report accept length and speed",
        description="Drafts a token tree per step with the MTP head, verifies it in one target forward and commits "
        "the accepted path. Greedy output equals plain greedy decoding; sampled output has the target's law.",
    )
    parser.add_argument("--model", required=True, type=text_arg,
                        help="smollm2, tiny-deepseek, or a local model folder")
    parser.add_argument("--mtp", default=None, type=text_arg,
                        help="MTP head (.safetensors) or DeepSeek checkpoint folder; "
                        "default: the model's own MTP layer or the shipped head")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="sequoia")
    parser.add_argument("--budget", type=int, default=8, help="draft nodes per step, root excluded")
    parser.add_argument("--depth", type=int, default=4, help="most draft tokens on one path (with --auto: the most "
                        "it may choose)")
    parser.add_argument("--topk", type=int, default=None, help="candidates per expanded node (policy default); at "
                        f"most {MAX_TOPK} and the head's draft vocabulary")
    parser.add_argument("--acceptance", type=path_arg, default=None, metavar="PROFILE.json",
                        help="acceptance profile for sequoia (default: the model's shipped profile, else built-in)")
    parser.add_argument("--auto", action="store_true",
                        help="pick budget and depth for this machine: sequoia with the calibrated profile and a "
                        "measured cost curve (cached); picks no speculation where none pays")
    parser.add_argument("--costs", type=path_arg, default=None, metavar="COSTS.json",
                        help="with --auto: cost curve to read, or to measure and write (default: per model and "
                        "machine in the cache folder)")
    parser.add_argument("--prompt", action="append", required=True, type=text_arg,
                        help="prompt text; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=integer(1), default=64,
                        help="at most the model's context minus the longest prompt")
    parser.add_argument("--temperature", type=temperature, default=0.0, help=TEMPERATURE_HELP)
    parser.add_argument("--top-k", type=integer(0, MAX_SAMPLING_TOP_K), default=0,
                        help="sample among the k most likely tokens (0 = off; past the vocabulary = off)")
    parser.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0,
                        help="nucleus sampling mass in (0, 1] (1 = off)")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="use an --mtp head trained for another model (its metadata names the model)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--check", action="store_true", help="also decode without speculation and compare")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class AutoChoice:
    """What ``--auto`` chose: ``policy`` None means plain decoding; ``summary`` goes into the report."""

    policy: TreePolicy | None
    summary: dict[str, Any]


def run(args: argparse.Namespace) -> int:
    # everything that can be checked without the model first, so a typo fails before a model loads
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    profile_path = args.acceptance
    if profile_path is None and (args.policy == "sequoia" or args.auto):
        profile_path = shipped_profile_path(args.model, args.temperature)
    profile = AcceptanceProfile.load(profile_path)
    policy: TreePolicy | None = TreePolicy(args.policy, budget=args.budget, depth=args.depth, topk=args.topk,
                                           profile=profile)
    if args.mtp is not None and not Path(args.mtp).exists():
        raise SpecError(f"MTP head {args.mtp} does not exist")
    if args.auto and args.costs is not None and not args.costs.exists():
        check_output_path(args.costs, option="--costs")  # measured and written there: fail now, not after
    loaded = load_model(args.model, progress=not args.json)
    head = load_head_for(loaded, args.mtp, allow_model_mismatch=args.allow_model_mismatch)
    if policy is not None and policy.name != "chain" and policy.effective_topk > head.draft_vocab_size:
        raise SpecError(f"--topk {policy.effective_topk} exceeds the head's draft vocabulary of "
                        f"{head.draft_vocab_size} tokens; use at most {head.draft_vocab_size}")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                              eos_token_ids=loaded.eos_token_ids)
    prompts = [loaded.encode_prompt(text, chat=False if args.no_chat else None) for text in args.prompt]
    loaded.check_lengths([len(prompt) for prompt in prompts], args.max_new_tokens)
    auto = None
    if args.auto:
        auto = choose_auto_policy(loaded, head, profile, args.depth, args.costs, sampling)
        policy = auto.policy
    if args.check:  # warm the kernels up first, so neither timed run pays one-time start-up costs
        generate_plain(loaded.model, prompts[:1], GenerationConfig(max_new_tokens=2, sampling=sampling))
    if policy is None:  # the cost model says speculation does not pay here
        output = generate_plain(loaded.model, prompts, config)
    else:
        output = SpeculativeDecoder(loaded.model, head, policy).generate(prompts, config)
    report = _report(loaded, policy, auto, profile, sampling, output)
    if args.check:
        report.update(_check_against_plain(loaded, prompts, config, output))
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(args.prompt, loaded, report, output, sampling)
    return 0


def _report(
    loaded: LoadedModel,
    policy: TreePolicy | None,
    auto: AutoChoice | None,
    profile: AcceptanceProfile,
    sampling: SamplingParams,
    output: GenerationOutput,
) -> dict[str, Any]:
    requests = output.requests
    return {
        "model": loaded.name,
        "policy": policy.name if policy else "none",
        "budget": policy.budget if policy else 0,
        "depth": policy.depth if policy else 0,
        "auto": auto.summary if auto else None,
        "profile": profile.source if policy is not None and policy.name == "sequoia" else None,
        "temperature": sampling.temperature,
        "tokens": requests[0].tokens if len(requests) == 1 else [request.tokens for request in requests],
        "text": [loaded.decode(request.tokens) for request in requests],
        "finish_reasons": [request.finish_reason for request in requests],
        "accept_length_mean": output.accept_length_mean,
        "accept_length_histogram": output.accept_length_histogram(),
        "steps": output.stats.steps,
        "draft_seconds": output.stats.draft_seconds,
        "verify_seconds": output.stats.verify_seconds,
        "total_seconds": output.stats.total_seconds,
        "tokens_per_second": output.tokens_per_second,
    }


def _check_against_plain(
    loaded: LoadedModel, prompts: list[list[int]], config: GenerationConfig, output: GenerationOutput
) -> dict[str, Any]:
    """``--check``: plain decoding of the same prompts, its speed, and (greedy) whether the outputs are identical."""
    baseline = generate_plain(loaded.model, prompts, config)
    comparisons = [compare_with_plain(ours, theirs) for ours, theirs in zip(output.requests, baseline.requests)]
    result: dict[str, Any] = {
        "baseline_tokens_per_second": baseline.tokens_per_second,
        "speedup": output.tokens_per_second / baseline.tokens_per_second if baseline.tokens_per_second else None,
    }
    if config.sampling.greedy:
        result["identical_to_baseline"] = all(c.identical for c in comparisons)
        result["near_tie_divergences"] = sum(c.excused for c in comparisons)
    else:
        # sampled runs draw different random numbers; equality is in distribution, not token by token
        result["identical_to_baseline"] = None
    return result


def _print_table(
    prompt_texts: list[str], loaded: LoadedModel, report: dict[str, Any], output: GenerationOutput,
    sampling: SamplingParams,
) -> None:
    for index, (prompt_text, request) in enumerate(zip(prompt_texts, output.requests)):
        print(f"--- prompt {index}: {prompt_text!r}")
        print(loaded.decode(request.tokens))
    auto = report["auto"]
    if auto is not None:
        print(f"--- auto: predicted speedup {auto['predicted_speedup']:.2f}x with budget {auto['budget']}, depth "
              f"{auto['depth']} on {auto['device']}" + (" -> no speculation" if report["policy"] == "none" else ""))
    print(f"--- {report['policy']} budget {report['budget']} depth {report['depth']} on {loaded.name}, temperature "
          f"{sampling.temperature}")
    print(f"accept length mean {report['accept_length_mean']:.3f} tokens/step (bonus included) over "
          f"{output.stats.steps} steps; histogram {report['accept_length_histogram']}")
    print(f"draft {output.stats.draft_seconds:.2f} s, verify {output.stats.verify_seconds:.2f} s, "
          f"{report['tokens_per_second']:.1f} tokens/s")
    if "baseline_tokens_per_second" in report:
        print(f"plain decoding {report['baseline_tokens_per_second']:.1f} tokens/s, speedup {report['speedup']:.2f}x")
        if sampling.greedy:
            verdict = "identical" if report["identical_to_baseline"] else "DIFFERENT"
            ties = report["near_tie_divergences"]
            print(f"greedy output {verdict} to plain decoding"
                  + (f" ({ties} divergence(s) at near-ties < 1e-4)" if ties else ""))
        else:
            print("sampling: outputs are compared in distribution (tests), not token by token")


def choose_auto_policy(
    loaded: LoadedModel,
    head: MTPHead,
    profile: AcceptanceProfile,
    max_depth: int,
    costs_path: Path | None,
    sampling: SamplingParams,
) -> AutoChoice:
    """Measured (or cached) costs + profile -> the sequoia policy to use, or None for plain decoding."""
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    # sampled verification costs more per step than greedy, so each mode has its own curve
    mode = "greedy" if sampling.greedy else "sampled"
    path = costs_path or cache_root() / "costs" / f"{loaded.name}-{dtype}-{mode}-{platform.node() or 'host'}.json"
    # our own cache may be rebuilt when it is damaged; a file the user named is theirs: a problem there is refused
    warn = None if costs_path is not None else (lambda message: print(f"warning: {message}", file=sys.stderr))
    costs = load_or_measure(path, loaded.model, head, sampling, on_bad_cache=warn)
    choice = choose_speculation(profile, costs, max_depth=max_depth)
    summary = {"budget": choice.budget, "depth": choice.depth, "predicted_speedup": choice.speedup,
               "expected_accept_length": choice.expected_accept_length, "costs": str(path), "device": costs.device}
    if choice.budget == 0:
        return AutoChoice(None, summary)
    return AutoChoice(TreePolicy("sequoia", budget=choice.budget, depth=choice.depth, profile=profile), summary)
