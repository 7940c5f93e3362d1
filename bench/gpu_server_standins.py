"""The CUDA-mode ``sgl_kernel`` stand-ins (``sglang_spec_testbed/cuda_kernels.py``) checked on a device: each op
SGLang calls against a float64 reference and, on a GPU, captured in a CUDA graph and replayed on new inputs against
eager runs (what SGLang's decode graphs do with them). ``standin_gaps`` returns one line per failure; the server
preflight (``bench/gpu_server_preflight.py``) runs it, on the CPU in the dry run. The exact CPU tests are
``tests/sglang_plugin/test_cuda_standins.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sglang_spec_testbed import cuda_kernels as ops

ROWS, HIDDEN = 6, 64


@dataclass(frozen=True)
class Case:
    """``inputs(generator, device)`` -> tensors; ``run(*inputs)`` -> the outputs (in-place ops: on clones);
    ``reference(*inputs)`` -> the float64 outputs; ``tolerance``: absolute, float32."""

    name: str
    inputs: Callable[[torch.Generator, torch.device], tuple[torch.Tensor, ...]]
    run: Callable[..., tuple[torch.Tensor, ...]]
    reference: Callable[..., tuple[torch.Tensor, ...]]
    tolerance: float = 1e-4


def _randn(generator, device, *shape):
    return torch.randn(*shape, generator=generator).to(device)


def _rms(x, weight, gemma=False):
    x = x.double()
    scale = (1 + weight.double()) if gemma else weight.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


def _fused(op, gemma):
    def run(x, residual, weight):
        x, residual = x.clone(), residual.clone()
        op(x, residual, weight, 1e-6)
        return x, residual

    def reference(x, residual, weight):
        total = x.double() + residual.double()
        return _rms(total, weight, gemma), total

    return run, reference


def _merge_reference(v_a, s_a, v_b, s_b):
    top = torch.maximum(s_a, s_b).double()
    weight_a, weight_b = torch.exp(s_a.double() - top), torch.exp(s_b.double() - top)
    total = weight_a + weight_b
    return ((v_a.double() * weight_a[..., None] + v_b.double() * weight_b[..., None]) / total[..., None],
            torch.log(total) + top)


def _moe_sum_reduce(x):
    out = torch.empty(x.shape[0], x.shape[2], device=x.device)
    ops.moe_sum_reduce(x, out, 2.5)
    return (out,)


def _top_k_kept(probs, top_k):
    return ((ops.top_k_renorm_prob(probs, top_k) > 0).double(),)


def _top_k_reference(probs, top_k):
    pivot = torch.sort(probs.double(), -1, descending=True).values.gather(1, (top_k.long() - 1)[:, None])
    return ((probs.double() >= pivot).double(),)


CASES = (
    Case("rmsnorm", lambda g, d: (_randn(g, d, ROWS, HIDDEN), _randn(g, d, HIDDEN)),
         lambda x, w: (ops.rmsnorm(x, w, 1e-6),), lambda x, w: (_rms(x, w),)),
    Case("gemma_rmsnorm", lambda g, d: (_randn(g, d, ROWS, HIDDEN), _randn(g, d, HIDDEN)),
         lambda x, w: (ops.gemma_rmsnorm(x, w, 1e-6),), lambda x, w: (_rms(x, w, True),)),
    Case("fused_add_rmsnorm",
         lambda g, d: (_randn(g, d, ROWS, HIDDEN), _randn(g, d, ROWS, HIDDEN), _randn(g, d, HIDDEN)),
         *_fused(ops.fused_add_rmsnorm, False)),
    Case("gemma_fused_add_rmsnorm",
         lambda g, d: (_randn(g, d, ROWS, HIDDEN), _randn(g, d, ROWS, HIDDEN), _randn(g, d, HIDDEN)),
         *_fused(ops.gemma_fused_add_rmsnorm, True)),
    Case("silu_and_mul", lambda g, d: (_randn(g, d, ROWS, 2 * HIDDEN),), lambda x: (ops.silu_and_mul(x),),
         lambda x: (torch.nn.functional.silu(x[:, :HIDDEN].double()) * x[:, HIDDEN:].double(),)),
    Case("gelu_and_mul", lambda g, d: (_randn(g, d, ROWS, 2 * HIDDEN),), lambda x: (ops.gelu_and_mul(x),),
         lambda x: (torch.nn.functional.gelu(x[:, :HIDDEN].double()) * x[:, HIDDEN:].double(),)),
    Case("gelu_tanh_and_mul", lambda g, d: (_randn(g, d, ROWS, 2 * HIDDEN),), lambda x: (ops.gelu_tanh_and_mul(x),),
         lambda x: (torch.nn.functional.gelu(x[:, :HIDDEN].double(), approximate="tanh") * x[:, HIDDEN:].double(),)),
    Case("merge_state_v2", lambda g, d: (_randn(g, d, ROWS, 4, HIDDEN), _randn(g, d, ROWS, 4),
                                         _randn(g, d, ROWS, 4, HIDDEN), _randn(g, d, ROWS, 4)),
         lambda *x: ops.merge_state_v2(*x), _merge_reference),
    Case("moe_sum_reduce", lambda g, d: (_randn(g, d, ROWS, 4, HIDDEN),), _moe_sum_reduce,
         lambda x: (x.double().sum(1) * 2.5,)),
    Case("top_k_renorm_prob", lambda g, d: (torch.softmax(_randn(g, d, ROWS, 100), -1),
                                            torch.randint(1, 100, (ROWS,), generator=g).to(d)),
         _top_k_kept, _top_k_reference, tolerance=0.0),
)


def _compare(name: str, got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], tolerance: float,
             what: str) -> str | None:
    for index, (one, other) in enumerate(zip(got, expected)):
        error = (one.double() - other.double().to(one.device)).abs().max().item()
        if not error <= tolerance:  # NaN fails too
            return f"stand-in {name}: output {index} differs from {what} by {error:.3g} (tolerance {tolerance:g})"
    return None


def standin_gaps(device: torch.device, graphs: bool) -> list[str]:
    """One line per stand-in that differs from its reference on ``device``, or (``graphs``) whose CUDA-graph
    replay on new inputs differs from an eager run on them, or that cannot be captured."""
    gaps = []
    generator = torch.Generator().manual_seed(0)
    for case in CASES:
        inputs = case.inputs(generator, device)
        try:
            gap = _compare(case.name, case.run(*inputs), case.reference(*inputs), case.tolerance, "the reference")
            if gap is None and graphs:
                gap = _graph_gap(case, inputs, case.inputs(generator, device))
        except Exception as error:  # noqa: BLE001 - each failure in one line
            gap = f"stand-in {case.name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        if gap:
            gaps.append(gap)
    alias_gap = _weak_ref_gap(device)
    return gaps + ([alias_gap] if alias_gap else [])


def _graph_gap(case: Case, inputs: tuple[torch.Tensor, ...], fresh: tuple[torch.Tensor, ...]) -> str | None:
    static = tuple(tensor.clone() for tensor in inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        case.run(*static)  # warm-up outside the capture, as SGLang's graph runner does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = case.run(*static)
    for target, source in zip(static, fresh):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    return _compare(case.name, outputs, case.run(*fresh), 0.0, "an eager run after a CUDA-graph replay")


def _weak_ref_gap(device: torch.device) -> str | None:
    base = torch.arange(24.0, device=device).reshape(4, 6)
    view = base[1:, 2:5]
    alias = ops.weak_ref_tensor(view)
    if (alias.data_ptr(), alias.shape, alias.stride()) != (view.data_ptr(), view.shape, view.stride()):
        return "stand-in weak_ref_tensor: the alias does not cover the tensor's memory"
    view.fill_(-1.0)
    if not bool((alias == -1.0).all()):
        return "stand-in weak_ref_tensor: a write through the tensor is not seen through the alias"
    return None
