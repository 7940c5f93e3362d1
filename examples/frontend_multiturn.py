"""A multi-turn SGLang frontend program against a server with tree speculation.

    python -m sglang.launch_server ... --speculative-algorithm NEXTN --speculative-tree-policy sequoia ...
    python examples/frontend_multiturn.py --url http://127.0.0.1:30000

On a CPU, ``./scripts/sglang_cpu_server.sh`` starts SGLang's real server with SmolLM2 and a Sequoia tree on port
30000. The program is ordinary sglang.lang code: tree speculation is invisible to it, apart from speed (the
server's mean accept length is printed at the end).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import sglang as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=48))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=48))


def run(url: str, chat_template: str | None = "chatml") -> dict:
    backend = sgl.RuntimeEndpoint(url, chat_template_name=chat_template)
    sgl.set_default_backend(backend)
    single = multi_turn_question.run(
        question_1="What is the capital of France?", question_2="And of Italy?", temperature=0
    )
    batch = multi_turn_question.run_batch([
        {"question_1": "Name a prime number.", "question_2": "Name a bigger one."},
        {"question_1": "What does a CPU do?", "question_2": "And a GPU?"},
    ], temperature=0)
    with urllib.request.urlopen(url + "/server_info") as response:
        info = json.loads(response.read())
    # the scheduler's running statistics (one entry per data-parallel rank)
    states = info.get("internal_states") or [{}]
    return {
        "answers": [single["answer_1"], single["answer_2"]] + [s["answer_2"] for s in batch],
        "avg_spec_accept_length": states[0].get("avg_spec_accept_length"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--chat-template", default="chatml")
    args = parser.parse_args(argv)
    result = run(args.url, args.chat_template)
    for index, answer in enumerate(result["answers"]):
        print(f"--- answer {index}: {answer.strip()}")
    print(f"server mean accept length: {result['avg_spec_accept_length']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
