"""A head that keeps learning while it serves, against fixed heads, on one stream of requests (CPU test bed).

    python bench/adapt_stream.py

The stream (``--stream``): document-extraction requests over the Python reference (``pydoc:0-95``: a new passage
each request; ``pydoc:0-23x6``: 24 passages asked six times in turn, a new question each; no shipped head trained
on that domain), sent one at a time, greedy, to SGLang's real server with SmolLM2-135M and a chain tree. Three arms,
each its own server with the same flags:

* ``generic``: the shipped generic head, fixed.
* ``adapt``: the same head at launch, with ``sglang-spec adapt`` beside the server (capture, rolling window,
  training rounds, swaps under probation).
* ``domain``: a head batch-trained beforehand from the generic one on other passages of the same domain
  (``pydoc:100-163``, captured from a server, ``train --capture --keep-draft-vocab``), fixed.

Per request: accept length (SGLang's ``spec_correct_drafts_histogram``), tokens/s (answer tokens over its
end-to-end latency), the head label that served it. Prints a table by quarter of the stream and writes
``docs/results/adapt_stream.json`` and ``adapt_stream.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from harness import environment, markdown_table

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "results" / "adapt_stream.json"
TREE = ("--speculative-tree-policy", "chain", "--speculative-tree-budget", "4", "--speculative-tree-depth", "4")
FLAGS = ("--enable-metrics", "--enable-return-hidden-states", "--disable-radix-cache")
ARMS = ("generic", "adapt", "domain")


def chat_ids(tokenizer, specs) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(list(spec.messages), add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for spec in specs]


def stream(server, prompts, max_new_tokens: int) -> list[dict]:
    """Each prompt in turn, greedy: its accept length, verify steps, tokens, seconds, tokens/s, head label."""
    rows = []
    for index, prompt in enumerate(prompts):
        answer = server.generate([prompt], {"temperature": 0, "max_new_tokens": max_new_tokens})[0]
        meta = answer["meta_info"]
        histogram = meta.get("spec_correct_drafts_histogram") or []
        steps = sum(int(count) for count in histogram)
        emitted = sum((drafts + 1) * int(count) for drafts, count in enumerate(histogram))
        seconds = float(meta.get("e2e_latency") or 0.0)
        tokens = len(answer["output_ids"])
        rows.append({"request": index, "accept_length": emitted / steps if steps else 1.0, "verify_steps": steps,
                     "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0,
                     "head": str(meta.get("weight_version")), "output_ids": answer["output_ids"]})
        print(f"  request {index}: accept length {rows[-1]['accept_length']:.2f}, "
              f"{rows[-1]['tokens_per_second']:.1f} tok/s, head {rows[-1]['head']}", flush=True)
    return rows


def passages(specs) -> set[str]:
    """The pydoc passages a prompt set asks about (ids ``pydoc/<index>`` or ``pydoc/<index>/<visit>``)."""
    return {spec.id.split("/")[1] for spec in specs if spec.id.startswith("pydoc/")}


def train_domain_head(model, generic: Path, work: Path, args) -> Path:
    """The batch-trained domain head: other passages of the domain captured from a plain server, then trained."""
    from sglang_spec.cli import main as cli
    from sglang_spec_testbed.server import SGLangServer, cpu_launch_args, free_port

    capture, head = work / "domain-capture", work / "domain.safetensors"
    port = free_port()
    launch = cpu_launch_args(model, port, speculative=False, extra=["--enable-return-hidden-states",
                                                                    "--disable-radix-cache",
                                                                    *args.server_args.split()])
    with SGLangServer(launch, port, work / "domain-capture.log"):
        code = cli(["capture", "--from-server", f"http://127.0.0.1:{port}", "--model", "smollm2", "--prompts",
                    args.domain_prompts, "--out", str(capture), "--max-new-tokens", str(args.max_new_tokens),
                    "--json"])
        assert code == 0, "capture failed"
    code = cli(["train", "--capture", str(capture), "--init", str(generic), "--out", str(head), "--keep-draft-vocab",
                "--steps", str(args.domain_steps), "--batch-size", "8", "--seq-len", str(args.seq_len), "--lr",
                str(args.lr), "--unroll", "3", "--eval-fraction", "0", "--checkpoint-every",
                str(args.domain_steps), "--bf16", "--force", "--json"])
    assert code == 0, "training the domain head failed"
    return head


def run_arm(arm: str, model, head: Path, prompts, work: Path, args) -> dict:
    from sglang_spec.sglang_plugin.export import export_llama_draft
    from sglang_spec_testbed.server import SGLangServer, cpu_launch_args, free_port

    export = export_llama_draft(head, model.target_dir, work / f"{arm}-draft")
    served = replace(model, draft_args=tuple(export.server_args()))
    log = work / f"{arm}-traffic.jsonl"
    port = free_port()
    launch = cpu_launch_args(served, port, extra=[*TREE, *FLAGS, "--speculative-tree-traffic-log", str(log),
                                                  *args.server_args.split()])
    adapt, events = None, []
    print(f"{arm}: {len(prompts)} requests", flush=True)
    start = time.perf_counter()
    with SGLangServer(launch, port, work / f"{arm}-server.log") as server:
        if arm == "adapt":
            command = [sys.executable, "-m", "sglang_spec.cli", "adapt", "--from-server", f"http://127.0.0.1:{port}",
                       "--traffic-log", str(log), "--model", "smollm2", "--head", str(head), "--work",
                       str(work / "adapt"), "--force", *args.adapt_args.split()]
            adapt = subprocess.Popen(command, stdout=open(work / "adapt.out", "w"), stderr=subprocess.STDOUT)
        rows = stream(server, prompts, args.max_new_tokens)
        if adapt is not None:
            adapt.terminate()
            adapt.wait(timeout=120)
            events_file = work / "adapt" / "events.jsonl"
            events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    return {"arm": arm, "head": head.name, "rows": rows, "events": events,
            "wall_seconds": time.perf_counter() - start}


def quarters(rows: list[dict]) -> list[dict]:
    size = max(1, len(rows) // 4)
    out = []
    for number in range(4):
        part = rows[number * size : (number + 1) * size] if number < 3 else rows[3 * size :]
        steps = sum(row["verify_steps"] for row in part)
        emitted = sum(row["accept_length"] * row["verify_steps"] for row in part)
        tokens, seconds = sum(row["tokens"] for row in part), sum(row["seconds"] for row in part)
        out.append({"requests": f"{part[0]['request']}-{part[-1]['request']}",
                    "accept_length": emitted / steps if steps else 1.0,
                    "tokens_per_second": tokens / seconds if seconds else 0.0})
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    window = 8
    for arm in results["arms"]:
        rows = arm["rows"]
        x = [row["request"] for row in rows]
        for axis, key in zip(axes, ("accept_length", "tokens_per_second")):
            values = [row[key] for row in rows]
            smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                      for i in range(len(values))]
            axis.plot(x, smooth, label=arm["arm"])
        seen = {rows[0]["head"]} if rows else set()
        for before, row in zip(rows, rows[1:]):  # the first request each swapped-in head served
            if row["head"] != before["head"]:
                back = row["head"] in seen  # a head served before: a rollback
                axes[0].axvline(row["request"], color="red" if back else "green", alpha=0.4)
                seen.add(row["head"])
    axes[0].set_title(f"accept length (mean of the last {window} requests)\n"
                      "lines: a new head served (red: rolled back)",
                      fontsize=10)
    axes[1].set_title(f"tokens/s (mean of the last {window} requests)")
    for axis in axes:
        axis.set_xlabel("requests served")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", default="pydoc:0-95",
                        help="the requests, in order: pydoc:A-B (a new passage each), pydoc:A-BxK (recurring passages)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--domain-prompts", default="pydoc:100-163")
    parser.add_argument("--domain-steps", type=int, default=150)
    parser.add_argument("--domain-head", type=Path, default=None, help="a batch-trained domain head to reuse")
    parser.add_argument("--seq-len", type=int, default=256, help="the domain head's training windows")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--adapt-args", default="--window 48 --train-every 12 --steps 32 --batch-size 8 "
                        "--seq-len 256 --lr 0.001 --holdout 0.25 --probation-steps 60 --train-nice 0 "
                        "--bf16 --poll-seconds 0.5")
    parser.add_argument("--server-args", default="", help="more launch_server options for every server")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    arms = args.arms.split(",")
    from sglang_spec.errors import SpecError
    from sglang_spec.train.prompts import load_prompts

    try:
        stream_specs, domain_specs = load_prompts(args.stream), load_prompts(args.domain_prompts)
    except SpecError as error:
        parser.error(str(error))
    if "domain" in arms and passages(stream_specs) & passages(domain_specs):
        parser.error(f"the stream {args.stream} overlaps the domain head's --domain-prompts "
                     f"{args.domain_prompts}: the domain head would be scored on passages it trained on")
    from transformers import AutoTokenizer

    from sglang_spec.models.loading import shipped_head_path
    from sglang_spec_testbed.server import prepare_model

    model = prepare_model("smollm2", progress=False)
    generic = shipped_head_path("smollm2").with_name("smollm2-135m-instruct-generic.safetensors")
    prompts = chat_ids(AutoTokenizer.from_pretrained(model.target_dir), stream_specs)
    work = Path(tempfile.mkdtemp(prefix="adapt-stream-"))
    results = {"command": " ".join(["python bench/adapt_stream.py", *sys.argv[1:]]), "environment": environment(),
               "stream": args.stream, "max_new_tokens": args.max_new_tokens, "tree": list(TREE),
               "adapt_args": args.adapt_args, "domain_prompts": args.domain_prompts,
               "domain_steps": args.domain_steps, "domain_seq_len": args.seq_len, "arms": []}
    for arm in arms:
        head = generic
        if arm == "domain":
            head = args.domain_head or train_domain_head(model, generic, work, args)
        results["arms"].append(run_arm(arm, model, head, prompts, work, args))
    outputs = [[row["output_ids"] for row in arm["rows"]] for arm in results["arms"]]
    results["greedy_identical"] = all(output == outputs[0] for output in outputs)
    for arm in results["arms"]:
        arm["quarters"] = quarters(arm["rows"])
        for row in arm["rows"]:
            del row["output_ids"]
    by_arm = {arm["arm"]: arm for arm in results["arms"]}
    header = ["arm", *(f"AL {q['requests']}" for q in results["arms"][0]["quarters"]),
              *(f"tok/s {q['requests']}" for q in results["arms"][0]["quarters"])]
    print("\n".join(markdown_table(header, [[arm["arm"], *(f"{q['accept_length']:.2f}" for q in arm["quarters"]),
                          *(f"{q['tokens_per_second']:.1f}" for q in arm["quarters"])] for arm in results["arms"]])))
    for event in by_arm.get("adapt", {}).get("events", []):
        print(f"  adapt at {event['time']:.0f} s, {event['requests_seen']} requests seen: {event['message']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
