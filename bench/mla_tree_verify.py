"""MLA tree verify on FlashInfer (``--speculative-tree-mla-verify flashinfer``), its attention alone, on a GPU:
the cascade with the real FlashInfer (paged MLA decode over each prefix, ``merge_state``) and the compiled tree
kernel, at DeepSeek-V3's widths (128 heads, latent 512 + rope 64, bf16).

* equality: random trees after random prefixes (SGLang's GPU mask layout, FULL_MASK), page sizes 1 and 64, 1..64
  tree tokens, against one masked attention over prefix + tree in float32, against the CPU twin of FlashInfer
  (same inputs, on the CPU: the twin the CPU tests rely on is faithful), and against SGLang's Triton MLA tree
  verify kernel (``extend_attention_fwd`` with the tree mask, what ``--attention-backend triton`` runs) when
  sglang is installed;
* CUDA graph: the cascade captured at one batch shape (graph wrapper, static buffers), replayed on two new batches
  after re-planning them in place, each equal to an eager run on that batch;
* time: one layer's verify attention for 1 / 8 / 16 / 32 / 64 tree tokens a request against one decode step (the
  same FlashInfer MLA decode with one query a request), at batch 1 and 8 after 2,048 cached tokens (CUDA-graph
  replays, median of 50), and SGLang's Triton tree verify at the same shapes when sglang is installed.

    python bench/mla_tree_verify.py --out FILE          # CUDA GPU with flashinfer: about a minute
    python bench/mla_tree_verify.py --out FILE --tiny   # any machine: the CPU twin, interpreted kernel, tiny widths

Exit 0 when every comparison is within tolerance, 1 otherwise, 3 when this machine cannot run it (no flashinfer on
a GPU run). Written by ``scripts/gpu_check.sh`` (group ``mla``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from harness import environment

from sglang_spec.attention.cascade import mla_tree_attention_reference
from sglang_spec.decode.autotune import interleaved_medians
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_json_atomic
from sglang_spec.kernels.mla_tree_attention import mla_tree_attention, mla_tree_attention_reference as tree_reference
from sglang_spec.sglang_plugin.mla_cascade import (
    MLAShape,
    flashinfer_package_namespace,
    mla_tree_verify_attention,
    paged_views,
    plan_prefix_wrapper,
    plan_tree_verify,
)
from sglang_spec.tree.batch import with_prefix
from sglang_spec.tree.encode_sglang import TreeMaskMode
from sglang_spec.tree.token_tree import TokenTree

CANNOT_RUN_HERE = 3
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # largest |difference| of an output element


@dataclass(frozen=True)
class Setting:
    """heads, latent, rope: MLA widths; dtype; batch; prefix: cached tokens a request (equality draws 1..prefix);
    tree_sizes; page_sizes; graphs: whether CUDA graphs are tried; repeats: timing replays."""

    heads: int
    latent: int
    rope: int
    dtype: torch.dtype
    batch: int
    prefix: int
    tree_sizes: tuple[int, ...]
    page_sizes: tuple[int, ...]
    timing_batches: tuple[int, ...]
    repeats: int


DEEPSEEK = Setting(128, 512, 64, torch.bfloat16, 4, 2048, (1, 8, 16, 32, 64), (1, 64), (1, 8), 50)
TINY = Setting(4, 32, 8, torch.float32, 2, 40, (1, 4, 8), (1, 4), (1,), 2)


def random_ancestor_mask(rng: np.random.Generator, nodes: int) -> torch.Tensor:
    parents = [-1] + [int(rng.integers(0, node)) for node in range(1, nodes)]
    return TokenTree.from_parents(parents, tokens=list(range(nodes))).ancestor_mask()


def paged_batch(rng: np.random.Generator, setting: Setting, tree_tokens: int, page_size: int, device: str,
                prefixes: list[int] | None = None) -> dict:
    """A paged pool with ``batch`` requests (pages drawn at random), their trees' rows at positions
    prefix .. prefix + n, queries, and SGLang's FULL_MASK tree mask."""
    batch = setting.batch if prefixes is None else len(prefixes)
    prefixes = prefixes or [int(p) for p in rng.integers(1, setting.prefix + 1, size=batch)]
    pages_of = [-(-(p + tree_tokens) // page_size) for p in prefixes]
    num_pages = sum(pages_of) + 1
    context = max(pages_of) * page_size
    req_to_token = torch.zeros(batch, context, dtype=torch.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for row, (prefix, count) in enumerate(zip(prefixes, pages_of)):
        pages = torch.tensor([free.pop() for _ in range(count)])
        positions = torch.arange(prefix + tree_tokens)
        req_to_token[row, : prefix + tree_tokens] = pages[positions // page_size] * page_size + positions % page_size
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 30)))

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(setting.dtype)

    masks = [random_ancestor_mask(rng, tree_tokens) for _ in range(batch)]
    tokens = batch * tree_tokens
    data = dict(
        prefixes=prefixes, masks=masks, rows=torch.arange(batch), req_to_token=req_to_token,
        kv_buffer=normal(num_pages * page_size, 1, setting.latent + setting.rope),
        flat_mask=torch.cat([with_prefix(mask, p).reshape(-1) for mask, p in zip(masks, prefixes)]),
        tree_slots=torch.cat([req_to_token[row, p:p + tree_tokens] for row, p in enumerate(prefixes)]),
        q_latent=normal(tokens, setting.heads, setting.latent), q_rope=normal(tokens, setting.heads, setting.rope),
        scale=(setting.latent + setting.rope) ** -0.5, tree_tokens=tree_tokens, page_size=page_size,
    )
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in data.items()}


def cascade(flashinfer, data: dict, setting: Setting, tree_attention=mla_tree_attention, wrapper=None):
    prefix_lens = torch.tensor(data["prefixes"], dtype=torch.int32, device=data["req_to_token"].device)
    plan = plan_tree_verify(data["req_to_token"], data["rows"], prefix_lens, prefix_lens.cpu(), data["tree_tokens"],
                            data["page_size"], TreeMaskMode.FULL_MASK)
    if wrapper is None:
        workspace = torch.empty(128 * 1024 * 1024 if prefix_lens.is_cuda else 4096, dtype=torch.uint8,
                                device=prefix_lens.device)
        wrapper = flashinfer.BatchMLAPagedAttentionWrapper(workspace)
    shape = MLAShape(setting.heads, setting.latent, setting.rope, data["scale"], setting.dtype, setting.dtype)
    plan_prefix_wrapper(flashinfer, wrapper, plan, shape)
    return mla_tree_verify_attention(flashinfer, wrapper, plan, data["q_latent"], data["q_rope"], data["kv_buffer"],
                                     data["tree_slots"], data["flat_mask"], data["scale"],
                                     tree_attention=tree_attention)


def reference(data: dict, setting: Setting) -> torch.Tensor:
    """One masked attention over prefix + tree per request, float32."""
    rows = data["kv_buffer"][:, 0].float()
    n, outs = data["tree_tokens"], []
    for b, prefix in enumerate(data["prefixes"]):
        queries = slice(b * n, (b + 1) * n)
        prefix_rows = rows[data["req_to_token"][b, :prefix].long()]
        tree_rows = rows[data["req_to_token"][b, prefix:prefix + n].long()]
        outs.append(mla_tree_attention_reference(
            data["q_latent"][queries].float(), data["q_rope"][queries].float(), prefix_rows[:, :setting.latent],
            prefix_rows[:, setting.latent:], tree_rows[:, :setting.latent], tree_rows[:, setting.latent:],
            data["masks"][b].to(rows.device), data["scale"]).out)
    return torch.cat(outs)


def sglang_triton(data: dict, setting: Setting):
    """SGLang's Triton extend attention as its triton back-end runs an MLA tree verify (absorbed: q [T, H, L + R],
    one latent KV head, FULL_MASK tree mask, prefix by token slots), as a function of no arguments with its inputs
    built (so a graph can capture the call alone); None without sglang or at a page size > 1."""
    if importlib.util.find_spec("sglang") is None or data["page_size"] != 1:
        return None
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    device, n = data["q_latent"].device, data["tree_tokens"]
    batch = len(data["prefixes"])
    prefixes = torch.tensor(data["prefixes"], device=device)
    qo_indptr = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(prefixes, 0)
    kv_indices = torch.cat([data["req_to_token"][b, :p] for b, p in enumerate(data["prefixes"])]).to(torch.int64)
    mask_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    mask_indptr[1:] = torch.cumsum(n * (prefixes + n), 0)
    q = torch.cat([data["q_latent"], data["q_rope"]], dim=-1).contiguous()
    k = data["kv_buffer"][data["tree_slots"].long()].contiguous()
    v = k[..., :setting.latent].contiguous()
    v_buffer = data["kv_buffer"][..., :setting.latent]
    mask = data["flat_mask"].to(torch.uint8)
    out = torch.empty_like(data["q_latent"])

    def run() -> torch.Tensor:
        extend_attention_fwd(q, k, v, out, data["kv_buffer"], v_buffer, qo_indptr, kv_indptr, kv_indices, mask, False,
                             mask_indptr, n, 1.0, 1.0, sm_scale=data["scale"])
        return out

    return run


def equality(flashinfer, setting: Setting, device: str, rng: np.random.Generator) -> list[dict]:
    rows = []
    twin = twin_namespace()
    for page_size in setting.page_sizes:
        for n in setting.tree_sizes:
            data = paged_batch(rng, setting, n, page_size, device)
            ours = cascade(flashinfer, data, setting).float()
            row = dict(page_size=page_size, tree_tokens=n, batch=setting.batch,
                       vs_reference=float((ours - reference(data, setting)).abs().max()))
            on_cpu = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in data.items()}
            for key in ("q_latent", "q_rope", "kv_buffer"):
                on_cpu[key] = on_cpu[key].float()
            cpu_setting = Setting(**{**setting.__dict__, "dtype": torch.float32})
            row["vs_cpu_twin"] = float((ours.cpu() - cascade(twin, on_cpu, cpu_setting, tree_reference)).abs().max())
            triton = sglang_triton(data, setting)
            if triton is not None:
                row["vs_sglang_triton"] = float((ours - triton().float()).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def twin_namespace():
    from sglang_spec.attention import flashinfer_mla

    return flashinfer_mla.namespace()


def graph_replays(flashinfer, setting: Setting, rng: np.random.Generator) -> dict:
    """The cascade captured once (graph wrapper on static buffers), replayed on two new batches after re-planning
    them in place: each replay against an eager run on its batch."""
    n, page_size, batch = 16, 1, setting.batch
    prefixes = [setting.prefix] * batch  # capacity: replays use at most these many pages
    first = paged_batch(rng, setting, n, page_size, "cuda", prefixes)
    static = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in first.items()}
    max_pages = -(-(setting.prefix + n) // page_size)
    buffers = dict(qo_indptr=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                   kv_indptr=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                   kv_indices=torch.zeros(batch * max_pages, dtype=torch.int32, device="cuda"),
                   kv_len_arr=torch.zeros(batch, dtype=torch.int32, device="cuda"))
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, **buffers)
    shape = MLAShape(setting.heads, setting.latent, setting.rope, static["scale"], setting.dtype, setting.dtype)
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32, device="cuda")
    static_prefix = prefix_lens.clone()

    def replan() -> object:
        plan = plan_tree_verify(static["req_to_token"], static["rows"], static_prefix, static_prefix.cpu(), n,
                                page_size, TreeMaskMode.FULL_MASK, kv_indices_out=buffers["kv_indices"],
                                max_pages=max_pages)
        plan_prefix_wrapper(flashinfer, wrapper, plan, shape)
        return plan

    plan = replan()

    def run() -> torch.Tensor:
        return mla_tree_verify_attention(flashinfer, wrapper, plan, static["q_latent"], static["q_rope"],
                                         static["kv_buffer"], static["tree_slots"], static["flat_mask"],
                                         static["scale"])

    run()  # compile the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    errors = []
    for _ in range(2):
        # same shapes (the FULL_MASK's size depends on the prefixes, so they stay), new pages, rows, trees, queries
        replay = paged_batch(rng, setting, n, page_size, "cuda", prefixes)
        for key in ("req_to_token", "kv_buffer", "flat_mask", "tree_slots", "q_latent", "q_rope"):
            static[key].copy_(replay[key])
        replan()
        graph.replay()
        eager = cascade(flashinfer, replay, setting)
        errors.append(float((out.float() - eager.float()).abs().max()))
    return {"tree_tokens": n, "batch": batch, "replay_vs_eager": errors}


def captured(function) -> object:
    """``function`` run once (compiling what it launches), then captured in a CUDA graph: its replay."""
    function()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    return graph.replay


def timings(flashinfer, setting: Setting, rng: np.random.Generator) -> list[dict]:
    """One layer's verify attention (the cascade, planned once as for every layer after the first; SGLang's Triton
    tree verify) for each tree size against one decode step's (FlashInfer's MLA decode, one query a request), after
    ``setting.prefix`` cached tokens: CUDA-graph replays timed in interleaved rounds (the project's one timer)."""
    rows = []
    for batch in setting.timing_batches:
        prefixes = [setting.prefix] * batch
        decode = paged_batch(rng, setting, 1, 1, "cuda", prefixes)
        for n in setting.tree_sizes:
            data = paged_batch(rng, setting, n, 1, "cuda", prefixes)
            plan_start = time.perf_counter()
            cascade(flashinfer, data, setting)
            torch.cuda.synchronize()
            eager_seconds = time.perf_counter() - plan_start
            functions = {"decode_step": captured(lambda: decode_only(flashinfer, decode, setting)),
                         "verify": captured(lambda: cascade_run_only(flashinfer, data, setting))}
            triton = sglang_triton(data, setting)
            if triton is not None:
                functions["sglang_triton"] = captured(triton)
            medians = interleaved_medians(functions, setting.repeats, warmup=3, device="cuda")
            row = dict(batch=batch, tree_tokens=n, context=setting.prefix, eager_first_call_us=eager_seconds * 1e6,
                       **{f"{key}_us": seconds * 1e6 for key, seconds in medians.items()})
            row["verify_over_decode"] = medians["verify"] / medians["decode_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


_PLANNED: dict[int, tuple] = {}


def _planned(flashinfer, data: dict, setting: Setting) -> tuple:
    """The wrapper planned once for ``data`` (timing replays the run only, as every layer after the first does)."""
    key = id(data)
    if key not in _PLANNED:
        prefix_lens = torch.tensor(data["prefixes"], dtype=torch.int32, device="cuda")
        plan = plan_tree_verify(data["req_to_token"], data["rows"], prefix_lens, prefix_lens.cpu(),
                                data["tree_tokens"], 1, TreeMaskMode.FULL_MASK)
        wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(128 * 1024 * 1024, dtype=torch.uint8,
                                                                       device="cuda"))
        plan_prefix_wrapper(flashinfer, wrapper, plan, MLAShape(setting.heads, setting.latent, setting.rope,
                                                                data["scale"], setting.dtype, setting.dtype))
        _PLANNED[key] = (plan, wrapper)
    return _PLANNED[key]


def cascade_run_only(flashinfer, data: dict, setting: Setting) -> torch.Tensor:
    plan, wrapper = _planned(flashinfer, data, setting)
    return mla_tree_verify_attention(flashinfer, wrapper, plan, data["q_latent"], data["q_rope"], data["kv_buffer"],
                                     data["tree_slots"], data["flat_mask"], data["scale"])


def decode_only(flashinfer, data: dict, setting: Setting) -> torch.Tensor:
    """A plain decode step's attention: FlashInfer's MLA decode, one query a request over its cached rows (the
    cascade's prefix half for a one-token tree, without the tree half and the merge)."""
    plan, wrapper = _planned(flashinfer, data, setting)
    ckv, kpe = paged_views(data["kv_buffer"], setting.latent, 1)
    return wrapper.run(query=(data["q_latent"], data["q_rope"]), kv_cache=(ckv, kpe), return_lse=True)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU: the CPU twin of FlashInfer, tiny widths")
    args = parser.parse_args(argv)
    check_output_path(args.out, force=True, option="--out")
    rng = np.random.default_rng(0)
    if args.tiny:
        setting, device, flashinfer = TINY, "cpu", twin_namespace()
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --tiny on a CPU", flush=True)
            return CANNOT_RUN_HERE
        if importlib.util.find_spec("flashinfer") is None:
            print("flashinfer is not installed (pip install flashinfer-python): nothing to check", flush=True)
            return CANNOT_RUN_HERE
        setting, device, flashinfer = DEEPSEEK, "cuda", flashinfer_package_namespace()
    result: dict = {"environment": environment(), "setting": {k: str(v) for k, v in setting.__dict__.items()}}
    result["equality"] = equality(flashinfer, setting, device, rng)
    tolerance = TOLERANCE[setting.dtype]
    worst = {key: max((row[key] for row in result["equality"] if key in row), default=None)
             for key in ("vs_reference", "vs_cpu_twin", "vs_sglang_triton")}
    passed = all(value is None or value <= tolerance for value in worst.values())
    if device == "cuda":
        result["graph"] = graph_replays(flashinfer, setting, rng)
        passed = passed and max(result["graph"]["replay_vs_eager"]) <= tolerance
        result["timings"] = timings(flashinfer, setting, rng)
        largest = max(result["timings"], key=lambda row: (row["batch"], row["tree_tokens"]))
        timing = (f"; verify / decode step at batch {largest['batch']}: "
                  + ", ".join(f"n={row['tree_tokens']} {row['verify_over_decode']:.2f}x" for row in result["timings"]
                              if row["batch"] == largest["batch"]))
        graph = f"; graph replays vs eager {max(result['graph']['replay_vs_eager']):.1e}"
    else:
        timing, graph = " (CPU twin: no graphs, no timing)", ""
    result["detail"] = (f"{'within' if passed else 'BEYOND'} {tolerance:g}: max |diff| vs float32 reference "
                        f"{worst['vs_reference']:.1e}, vs CPU twin {worst['vs_cpu_twin']:.1e}, vs SGLang triton "
                        f"{'n/a' if worst['vs_sglang_triton'] is None else format(worst['vs_sglang_triton'], '.1e')}"
                        f"{graph}{timing}")
    result["passed"] = passed
    write_json_atomic(args.out, result)
    print(result["detail"], flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(exit_status(main))
