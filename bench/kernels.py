"""Per-kernel latency of the speculative step against batch size and tree budget, beside the equivalents that
ship with SGLang / FlashInfer / torch where they exist. Prints a table and writes JSON.

    python bench/kernels.py                                   # on a CUDA GPU: the full sweep
    python bench/kernels.py --batch-sizes 1,8,64 --budgets 4,16,64 --vocab 129280
    python bench/kernels.py --smoke                           # any machine: tiny shapes, checks the harness

Timing on a GPU: each op is captured in a CUDA graph and replayed (these are microsecond kernels, so launch
overhead would otherwise dominate); median, p20 and p80 over repeats, in microseconds.

Providers per op:
  tree_metadata   ours | sglang build_tree_kernel_efficient (JIT CUDA if it builds, else its Triton twin)
  flashinfer_mask ours | flashinfer.segment_packbits over the same unpacked mask
  target_greedy   ours | torch.argmax
  target_sample   ours | torch softmax + sort-based top-k/top-p + inverse CDF (no fused equivalent in SGLang)
  accept_walk     ours | sglang verify_tree_greedy (JIT CUDA, else Triton twin)
  commit_kv       ours | torch index copy (SGLang's move_kv_cache_native does the same per layer)
  step            the whole captured step with a trivial target (logits from a table)
  ngram_match     ours | its torch reference (the CPU back-end): a lookup round's queries, budget per request
  lookup_trees    the device growth of lookup trees (device_trees/lookup), with ours | with the torch reference
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from harness import REPO, balanced_tree, depth_of, device_name, environment  # harness imports no Triton kernel

from sglang_spec.decode.autotune import interleaved_times
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_text_atomic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16,64,256")
    parser.add_argument("--budgets", default="4,8,16,32,64,128", help="draft nodes per request (root excluded)")
    parser.add_argument("--vocab", type=int, default=129280, help="DeepSeek-V3/R1 vocabulary by default")
    parser.add_argument("--topk", type=int, default=8, help="candidates drafted per node")
    parser.add_argument("--context", type=int, default=2048, help="prefix length per request")
    parser.add_argument("--kv-row", type=int, default=576, help="KV row elements (576 = DeepSeek MLA latent)")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "kernels.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: Triton interpreter)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_path(args.out, force=True)  # a bad --out fails now, not after the run
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print(
            "bench/kernels.py times GPU kernels (CUDA-graph replay, CUDA events) and there is no CUDA device here, "
            "so there is nothing meaningful to time.\nRun it on a GPU host, or pass --smoke to check the harness on "
            "tiny shapes with the Triton interpreter (its numbers are not kernel timings)."
        )
        return 0
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit function is defined
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.batch_sizes, args.budgets, args.vocab, args.topk = "2", "4", 32, 3
        args.context, args.kv_row, args.layers, args.repeats = 8, 8, 2, 1
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    rows = []
    for batch in batch_sizes:
        for budget in budgets:
            case = Case(batch, budget + 1, args.topk, args.vocab, args.context, args.kv_row, args.layers, device)
            for op, provider, function in case.providers():
                timing = measure(function, args.repeats, device)
                rows.append({"op": op, "provider": provider, "batch": batch, "budget": budget, **timing})
                print(format_row(rows[-1]), flush=True)
    report = {"environment": kernel_environment(device), "config": {k: str(v) for k, v in vars(args).items()},
              "rows": rows}
    write_text_atomic(args.out, json.dumps(report, indent=1) + "\n")
    print_table(rows)
    print(f"\nwrote {args.out}" + ("  (smoke run: CPU interpreter, not kernel timings)" if args.smoke else ""))
    return 0


class Case:
    """Inputs for one (batch, nodes) point, built once; ``providers`` yields (op, provider, callable)."""

    def __init__(self, batch, nodes, topk, vocab, context, kv_row, layers, device):
        import torch

        from sglang_spec.kernels.tree_metadata import build_tree_metadata, flashinfer_indptrs

        self.torch = torch
        self.batch, self.nodes, self.topk, self.vocab = batch, nodes, topk, vocab
        self.device = device
        generator = torch.Generator().manual_seed(0)
        parents, ranks = balanced_tree(nodes, topk)
        self.parents = torch.tensor(parents, device=device).expand(batch, nodes).contiguous()
        self.ranks = torch.tensor(ranks, device=device).expand(batch, nodes).contiguous()
        self.max_depth = depth_of(parents)
        self.topk_tokens = torch.randint(vocab, (batch, nodes, topk), generator=generator).to(device)
        self.topk_probs = torch.rand(batch, nodes, topk, generator=generator).to(device)
        self.root_tokens = torch.randint(vocab, (batch,), generator=generator).to(device)
        self.prefix_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.num_nodes = torch.full((batch,), nodes, dtype=torch.int64, device=device)
        self.meta = build_tree_metadata(
            self.parents, self.ranks, self.topk_tokens, self.topk_probs, self.root_tokens, self.prefix_lens,
            self.num_nodes, max_depth=self.max_depth,
        )
        self.indptrs = flashinfer_indptrs(self.prefix_lens, nodes)
        self.packed = torch.zeros(batch * ((nodes * (context + nodes) + 7) // 8), dtype=torch.uint8, device=device)
        self.logits = torch.randn(batch * nodes, vocab, generator=generator).to(device)
        self.coins = torch.rand(batch * nodes, generator=generator).to(device)
        self.temperature = torch.full((batch,), 0.7, device=device)
        self.top_k = torch.full((batch,), 50, dtype=torch.int64, device=device)
        self.top_p = torch.full((batch,), 0.9, device=device)
        self.target = torch.zeros(batch * nodes, dtype=torch.int64, device=device)
        self.output_ids = torch.zeros(batch, 4096, dtype=torch.int64, device=device)
        self.output_lens = torch.zeros(batch, dtype=torch.int64, device=device)
        slots = batch * nodes + 1
        self.kv = torch.randn(layers, slots, kv_row, generator=generator).to(torch.bfloat16).to(device)
        self.tree_slots = (torch.arange(batch * nodes) + 1).reshape(batch, nodes).to(device)
        self.freed = torch.zeros(batch, nodes, dtype=torch.int64, device=device)

    def providers(self):
        from sglang_spec.kernels import kv_commit, tree_metadata, verify_accept

        torch = self.torch
        yield "tree_metadata", "ours", lambda: tree_metadata.build_tree_metadata(
            self.parents, self.ranks, self.topk_tokens, self.topk_probs, self.root_tokens, self.prefix_lens,
            self.num_nodes, max_depth=self.max_depth, out=self.meta,
        )
        sglang_build = sglang_build_tree(self)
        if sglang_build is not None:
            yield "tree_metadata", sglang_build[0], sglang_build[1]
        yield "flashinfer_mask", "ours", lambda: tree_metadata.pack_flashinfer_mask(
            self.meta.tree_mask, self.prefix_lens, self.indptrs.packed_mask_indptr, self.packed
        )
        flashinfer_pack = flashinfer_segment_packbits(self)
        if flashinfer_pack is not None:
            yield "flashinfer_mask", "flashinfer", flashinfer_pack
        yield "target_greedy", "ours", lambda: verify_accept.target_tokens(
            self.logits, self.nodes, self.temperature, self.top_k, self.top_p, self.coins, False, out=self.target
        )
        yield "target_greedy", "torch", lambda: torch.argmax(self.logits, dim=-1, out=self.target)
        yield "target_sample", "ours", lambda: verify_accept.target_tokens(
            self.logits, self.nodes, self.temperature, self.top_k, self.top_p, self.coins, True, out=self.target
        )
        yield "target_sample", "torch", lambda: verify_accept.target_tokens_reference(
            self.logits, self.nodes, self.temperature, self.top_k, self.top_p, self.coins, True, out=self.target
        )

        def walk():
            self.output_lens.zero_()
            return verify_accept.accept_walk(
                self.meta.tokens, self.meta.parents, self.num_nodes, self.max_depth, self.output_ids,
                self.output_lens, verify_accept.MatchMode(self.target),
            )

        yield "accept_walk", "ours", walk
        sglang_verify = sglang_verify_greedy(self)
        if sglang_verify is not None:
            yield "accept_walk", sglang_verify[0], sglang_verify[1]
        accept = walk()
        yield "commit_kv", "ours", lambda: kv_commit.commit_kv(
            [self.kv], self.tree_slots, accept.accepted_nodes, accept.accept_length, self.num_nodes, self.freed,
            stacked=True,
        )
        path = accept.accepted_nodes.clamp(min=0)
        source = torch.gather(self.tree_slots, 1, path).reshape(-1)
        target = self.tree_slots[:, : path.shape[1]].reshape(-1)

        def torch_move():
            self.kv[:, target] = self.kv[:, source]

        yield "commit_kv", "torch", torch_move
        yield "step", "ours", self.whole_step()
        yield from self.lookup()

    def lookup(self):
        """The context lookup over histories of ``context`` tokens that copy earlier spans: one round's queries
        (``budget`` a request, tails of up to 3 tokens) and a whole growth of depth 4."""
        from sglang_spec.kernels.ngram_match import NgramMatches, ngram_match, ngram_match_reference
        from sglang_spec.device_trees.lookup import build_lookup_trees, lookup_estimates
        from sglang_spec.tree.profile import SourceCounts

        torch = self.torch
        generator = torch.Generator().manual_seed(1)
        context = int(self.prefix_lens[0])
        history = torch.randint(64, (self.batch, context), generator=generator)
        span = 16
        for start in range(context // 4, context - span, max(context // 4, 1)):  # copied spans: matches run long
            history[:, start: start + span] = history[:, start // 2: start // 2 + span].clone()
        history = history.to(self.device)
        lengths = torch.full((self.batch,), context, dtype=torch.int64, device=self.device)
        queries = self.batch * (self.nodes - 1)
        rows = torch.arange(self.batch, device=self.device).repeat_interleave(self.nodes - 1)
        tails = torch.randint(64, (queries, 3), generator=generator).to(self.device)
        tail_lengths = torch.randint(4, (queries,), generator=generator).to(self.device)
        out = NgramMatches.empty(queries, 2, self.device)
        for name, match in (("ours", ngram_match), ("torch", ngram_match_reference)):
            yield "ngram_match", name, lambda match=match: match(history, lengths, rows, tails, tail_lengths, 8, 2,
                                                                  out=out)
        estimates = lookup_estimates(SourceCounts.generic(8), self.device)
        batch_rows = torch.arange(self.batch, device=self.device)
        for name, match in (("ours", ngram_match), ("torch", ngram_match_reference)):
            yield "lookup_trees", name, lambda match=match: build_lookup_trees(
                history, lengths, batch_rows, estimates, self.nodes - 1, 4, 2, match=match)

    def whole_step(self) -> Callable:
        """The chained step (metadata, mask, a table-lookup target, sampling verify, accept, KV commit)."""
        from spec_step import SpecStep, StepConfig

        torch = self.torch
        config = StepConfig(batch_size=self.batch, max_nodes=self.nodes, topk=self.topk, max_depth=self.max_depth,
                            vocab_size=self.vocab, max_context_len=int(self.prefix_lens[0]), mode="sample",
                            output_capacity=self.output_ids.shape[1])
        table = torch.randn(self.vocab, self.vocab if self.vocab <= 4096 else 1, device=self.device)

        def target(buffers, inputs):
            if table.shape[1] == self.vocab:
                torch.index_select(table, 0, buffers.metadata.input_ids, out=buffers.logits)
            else:
                buffers.logits.copy_(self.logits)

        step = SpecStep(config, target, kv_buffers=[self.kv], stacked_kv=True, device=self.device)
        for name in ("parents", "ranks", "topk_tokens", "topk_probs", "root_tokens", "prefix_lens", "num_nodes",
                     "tree_slots", "temperature", "top_k", "top_p", "coins"):
            getattr(step.inputs, name).copy_(getattr(self, name))

        def run():
            step.inputs.output_lens.zero_()
            step.run()

        return run


def sglang_build_tree(case: Case) -> tuple[str, Callable] | None:
    """SGLang's build_tree_kernel_efficient on the same trees (UNO encoding), if sglang imports here."""
    try:
        from sglang.kernels.ops.speculative import spec_tree
    except Exception:
        return None
    from sglang_spec.tree import TokenTree, encode_sglang_draft

    torch = case.torch
    tree = TokenTree.from_parents(case.parents[0].tolist())
    spec_steps = max(tree.depth, 1)
    encoding = encode_sglang_draft([tree] * case.batch, topk=case.topk, spec_steps=spec_steps)
    parent_list = encoding.parent_list.to(case.device)
    selected = encoding.top_scores_index.to(case.device)
    n = case.nodes
    mask = torch.ones(int(case.prefix_lens.sum()) * n + n * n * case.batch, dtype=torch.bool, device=case.device)
    positions = torch.empty(case.batch * n, dtype=torch.int64, device=case.device)
    retrieve = torch.full((3, case.batch, n), -1, dtype=torch.int64, device=case.device)
    if case.device == "cuda":
        try:
            from sglang.kernels.ops.speculative.tree import build_tree_kernel_efficient

            def jit():
                retrieve.fill_(-1)
                build_tree_kernel_efficient(parent_list, selected, case.prefix_lens, mask, positions, retrieve[0],
                                            retrieve[1], retrieve[2], case.topk, spec_steps, n, 0)

            jit()
            return "sglang-jit", jit
        except Exception as error:  # the JIT needs nvcc + tvm-ffi; fall back to the Triton twin
            print(f"(sglang JIT build_tree unavailable: {type(error).__name__}; using its Triton twin)")

    def twin():
        retrieve.fill_(-1)
        spec_tree.sgl_build_tree_kernel_triton(parent_list, selected, case.prefix_lens, mask, positions, retrieve[0],
                                               retrieve[1], retrieve[2], case.topk, spec_steps, n)

    return "sglang-triton", twin


def sglang_verify_greedy(case: Case) -> tuple[str, Callable] | None:
    try:
        from sglang.kernels.ops.speculative import spec_tree
    except Exception:
        return None
    torch = case.torch
    n = case.nodes
    predicts = torch.zeros(case.batch * n, dtype=torch.int32, device=case.device)
    accept_index = torch.full((case.batch, case.max_depth + 1), -1, dtype=torch.int32, device=case.device)
    accept_num = torch.zeros(case.batch, dtype=torch.int32, device=case.device)
    target = case.target.reshape(case.batch, n)
    args = (predicts, accept_index, accept_num, case.meta.tokens, case.meta.retrieve_index, case.meta.first_child,
            case.meta.next_sibling, target)
    if case.device == "cuda":
        try:
            from sglang.kernels.ops.speculative.tree import verify_tree_greedy

            def jit():
                verify_tree_greedy(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                                   candidates=case.meta.tokens, retrive_index=case.meta.retrieve_index,
                                   retrive_next_token=case.meta.first_child,
                                   retrive_next_sibling=case.meta.next_sibling, target_predict=target)

            jit()
            return "sglang-jit", jit
        except Exception as error:
            print(f"(sglang JIT verify_tree_greedy unavailable: {type(error).__name__}; using its Triton twin)")
    return "sglang-triton", lambda: spec_tree.verify_tree_greedy_triton(*args)


def flashinfer_segment_packbits(case: Case) -> Callable | None:
    if case.device != "cuda":
        return None  # FlashInfer's packbits builds a CUDA JIT module
    try:
        from flashinfer import segment_packbits
    except Exception:
        return None
    torch = case.torch
    rows = torch.cat(
        [torch.ones(case.batch, case.nodes, int(case.prefix_lens[0]), dtype=torch.bool, device=case.device),
         case.meta.tree_mask.bool()], dim=2,
    ).reshape(-1)
    indptr = torch.arange(case.batch + 1, device=case.device, dtype=torch.int32) * (rows.numel() // case.batch)
    try:
        segment_packbits(rows, indptr, bitorder="little")
    except Exception as error:
        print(f"(flashinfer segment_packbits unavailable: {type(error).__name__})")
        return None
    return lambda: segment_packbits(rows, indptr, bitorder="little")


def measure(function: Callable, repeats: int, device: str) -> dict:
    """``function`` timed ``repeats`` times (on a GPU: captured in a CUDA graph and replayed, when it captures)."""
    import torch

    function()  # compile / warm up
    run, graph = function, False
    if device == "cuda":
        torch.cuda.synchronize()
        try:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                function()
            run, graph = captured.replay, True
        except Exception:  # not capturable (host syncs inside): time eagerly
            pass
    seconds = interleaved_times({"op": run}, repeats, warmup=0, device=device)["op"]
    return summarize([t * 1e6 for t in seconds], graph=graph)


def summarize(times: list[float], graph: bool) -> dict:
    ordered = sorted(times)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median_us": quantile(0.5), "p20_us": quantile(0.2), "p80_us": quantile(0.8), "cuda_graph": graph}


def format_row(row: dict) -> str:
    return (f"{row['op']:>16} {row['provider']:>14} bs={row['batch']:<4} budget={row['budget']:<4} "
            f"median {row['median_us']:10.1f} us  [p20 {row['p20_us']:.1f}, p80 {row['p80_us']:.1f}]"
            + ("" if row["cuda_graph"] else "  (eager)"))


def print_table(rows: list[dict]) -> None:
    """One line per (op, batch, budget) with every provider's median side by side."""
    providers = sorted({row["provider"] for row in rows})
    print("\n" + " | ".join([f"{'op':>16}", "  bs", "budget"] + [f"{p:>14}" for p in providers]))
    keys = sorted({(row["op"], row["batch"], row["budget"]) for row in rows}, key=lambda k: (k[0], k[1], k[2]))
    for op, batch, budget in keys:
        cells = []
        for provider in providers:
            match = [r for r in rows
                     if (r["op"], r["batch"], r["budget"], r["provider"]) == (op, batch, budget, provider)]
            cells.append(f"{match[0]['median_us']:>11.1f} us" if match else f"{'-':>14}")
        print(" | ".join([f"{op:>16}", f"{batch:>4}", f"{budget:>6}"] + cells))


def kernel_environment(device: str) -> dict:
    import triton

    try:
        import sglang

        sglang_version = sglang.__version__
    except Exception:
        sglang_version = None
    return environment(device_name(device), triton=triton.__version__, sglang=sglang_version)


if __name__ == "__main__":
    sys.exit(exit_status(main))
