"""Start SGLang's real server on this CPU with the plugin and a small model (what ``scripts/sglang_cpu_server.sh``
runs). Every option SGLang's launch_server takes, the tree options included, passes through:

    python -m sglang_spec_testbed --model smollm2 --port 30000 \\
        --speculative-tree-policy sequoia --speculative-tree-budget 15 --speculative-tree-depth 4 \\
        --speculative-tree-topk 4 --enable-metrics

``--model smollm2`` (SmolLM2-135M-Instruct with the shipped MTP head, exported as an SGLang draft),
``smollm2-split`` (the same with zero attention heads appended, for ``--tp-size 2``) or ``tiny-deepseek`` (a tiny
DeepSeek-V3: MLA + MoE + its own MTP layer). For sequoia the shipped profile is used
unless ``--speculative-acceptance-profile`` is given. ``--no-speculation`` serves plain decoding. The algorithm
is NEXTN with the model's draft unless ``--speculative-algorithm`` says otherwise; SGLang's own n-gram drafting
needs no draft model:

    python -m sglang_spec_testbed --model smollm2 --speculative-algorithm NGRAM \
        --speculative-num-draft-tokens 8
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang_spec.errors import SpecError
from sglang_spec_testbed import check_sglang_version, server_environment
from sglang_spec_testbed.server import CPU_MODELS, cpu_launch_args, launch_ranks, prepare_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_spec_testbed",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Any other option is passed to python -m sglang.launch_server.")
    parser.add_argument("--model", choices=CPU_MODELS, default="smollm2")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding (no draft of any kind)")
    args, passthrough = parser.parse_known_args(argv)
    try:
        check_sglang_version()
        model = prepare_model(args.model)
    except SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if "sequoia" in passthrough and "--speculative-acceptance-profile" not in passthrough:
        if model.profile is None:
            print(f"error: {args.model} ships no acceptance profile; give --speculative-acceptance-profile",
                  file=sys.stderr)
            return 2
        passthrough += ["--speculative-acceptance-profile", str(model.profile)]
    try:
        launch = cpu_launch_args(model, args.port, speculative=not args.no_speculation, extra=passthrough)
        environment = server_environment(ranks=launch_ranks(launch))
    except SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "sglang.launch_server", *launch]
    print("starting:", " ".join(command), file=sys.stderr, flush=True)
    os.execve(sys.executable, command, environment)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
