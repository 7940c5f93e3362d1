"""Accept length through SGLang's real server for eagle (SGLang's own selection), the plugin's sequoia and its
specexec, at equal budgets on held-out prompts (HumanEval 134 onwards: never in the shipped head's traffic).

    python bench/sglang_trees.py                          # SmolLM2-135M + shipped head on this CPU (harness)
    python bench/sglang_trees.py --budgets 16,32 --num-prompts 4 --max-new-tokens 32   # quicker

Greedy decoding, batch of all prompts per server. Mean accept length = accepted drafts + 1 per verify step, from
SGLang's per-request histograms; greedy output is checked identical across policies. Writes JSON and a Markdown
table (docs/results/sglang_trees.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import REPO, markdown_table

from sglang_spec.cli.parser import OneLineErrorParser, comma_list, integer
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.tree.policies import MAX_TOPK
from sglang_spec.tree.token_tree import MAX_BUDGET, MAX_DEPTH

POLICIES = ("eagle", "sequoia", "specexec")
HELD_OUT_PROMPTS = 30  # HumanEval 134-163: never in the shipped head's traffic


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=comma_list(integer(1, MAX_BUDGET)), default="16,32,64")
    parser.add_argument("--depth", type=integer(1, MAX_DEPTH), default=6)
    parser.add_argument("--topk", type=integer(1, MAX_TOPK), default=4, help="children per expanded node")
    parser.add_argument("--num-prompts", type=integer(1, HELD_OUT_PROMPTS), default=12,
                        help=f"HumanEval 134 onwards (1-{HELD_OUT_PROMPTS})")
    parser.add_argument("--max-new-tokens", type=integer(1, 1024), default=64)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "sglang_trees.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for out in (args.out, args.out.with_suffix(".md")):  # a bad --out fails now, not after nine servers
        check_output_path(out, force=True)
    from transformers import AutoTokenizer

    from sglang_spec_testbed.server import SGLangServer, cpu_launch_args, free_port, prepare_model
    from sglang_spec.train.prompts import humaneval_prompts

    model = prepare_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model.target_dir)
    specs = humaneval_prompts(134, 134 + args.num_prompts - 1)
    prompts = [list(tokenizer.apply_chat_template(list(spec.messages), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for spec in specs]
    scratch = REPO / "runs" / "sglang_trees"  # server logs (gitignored)
    rows, outputs = [], {}
    for budget in args.budgets:
        for policy in POLICIES:
            tree = ["--speculative-tree-policy", policy, "--speculative-tree-budget", str(budget),
                    "--speculative-tree-depth", str(args.depth), "--speculative-tree-topk", str(args.topk)]
            if policy == "sequoia":
                tree += ["--speculative-acceptance-profile", str(model.profile)]
            port = free_port()
            with SGLangServer(cpu_launch_args(model, port, extra=tree), port,
                              scratch / f"{policy}-{budget}.log") as server:
                answers = server.generate(prompts, {"temperature": 0, "max_new_tokens": args.max_new_tokens})
                width = server.request("/server_info")["speculative_eagle_topk"]
            lengths = [drafts + 1 for answer in answers
                       for drafts, count in enumerate(answer["meta_info"]["spec_correct_drafts_histogram"])
                       for _ in range(count)]
            outputs[(policy, budget)] = [answer["output_ids"] for answer in answers]
            rows.append({"policy": policy, "budget": budget, "depth": args.depth, "topk": args.topk, "width": width,
                         "accept_length": sum(lengths) / len(lengths), "verify_steps": len(lengths)})
            print(f"{policy:<9} budget {budget:>3}: width {width:>3}, "
                  f"mean accept length {rows[-1]['accept_length']:.3f}",
                  flush=True)
    identical = len({json.dumps(tokens) for tokens in outputs.values()}) == 1
    command = "python bench/sglang_trees.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_text_atomic(args.out, json.dumps({"rows": rows, "greedy_identical": identical, "command": command.strip(),
                                    "prompts": f"HumanEval {134}-{134 + args.num_prompts - 1}",
                                    "max_new_tokens": args.max_new_tokens}, indent=1) + "\n")
    by = {(row["policy"], row["budget"]): row for row in rows}
    table = "\n".join(markdown_table(
        ["budget", "eagle (SGLang's selection, W = topk)", "sequoia (plugin loop)", "specexec (plugin loop)"],
        [[budget, *(f"{by[(policy, budget)]['accept_length']:.2f} (W {by[(policy, budget)]['width']})"
                    for policy in POLICIES)] for budget in sorted({row["budget"] for row in rows})]))
    write_text_atomic(
        args.out.with_suffix(".md"),
        f"Mean accept length through SGLang (SmolLM2-135M + shipped head, {len(prompts)} held-out HumanEval prompts, "
        f"{args.max_new_tokens} greedy tokens, depth {args.depth}, topk {args.topk}); greedy output identical across "
        f"all: {identical}.\n\n{table}\n\n`{command.strip()}`\n")
    print(table)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(exit_status(main))
