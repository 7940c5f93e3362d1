"""The CUDA-mode ``sgl_kernel`` stand-in (``sglang_spec_testbed/cuda_kernels.py``) on CPU tensors: each op against a
float64 (or SGLang's own Triton) reference, in place where sgl-kernel writes in place, with no host read or host
data (what a CUDA graph could not capture); the mode's module resolves what SGLang imports and nothing else. The
import of SGLang's CUDA server paths with it: ``bench/gpu_server_preflight.py`` (tests/bench/
test_gpu_server_preflight.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from host_guard import HostAccessGuard
from optional_packages import require_sglang
from paths import TESTS_DIR
from sglang_spec.errors import SpecError
from sglang_spec_testbed import cuda_kernels, kernels

BED = (str(TESTS_DIR.parent / "sglang_spec_testbed") + "/",)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def random(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rms_reference(x, weight, eps, gemma=False):
    x = x.double()
    scale = (1.0 + weight.double()) if gemma else weight.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


class HostGuard(HostAccessGuard):
    """``HostAccessGuard`` over the bed's code, a dtype conversion on the same device allowed (a graph captures
    it); a copy to another device or a tensor made from host data is still flagged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("aten._to_copy") and (kwargs or {}).get("device", args[0].device) == args[0].device:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def no_host_access(function, *args, **kwargs):
    """Runs ``function``; fails on any host read or tensor built from host data inside the bed's code."""
    with HostGuard(host_only=True, roots=BED) as guard:
        result = function(*args, **kwargs)
    assert guard.events == [], guard.events
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_and_its_fused_add_equal_the_reference(dtype, gemma):
    x, weight = random(3, 5, 64, dtype=dtype), random(64, dtype=dtype, seed=1)
    residual = random(3, 5, 64, dtype=dtype, seed=2)
    norm = cuda_kernels.gemma_rmsnorm if gemma else cuda_kernels.rmsnorm
    fused = cuda_kernels.gemma_fused_add_rmsnorm if gemma else cuda_kernels.fused_add_rmsnorm
    expected = rms_reference(x, weight, 1e-6, gemma)
    got = no_host_access(norm, x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, **TOLERANCE[dtype])
    out = torch.empty_like(x)
    assert norm(x, weight, 1e-6, out=out, enable_pdl=True) is out
    torch.testing.assert_close(out, got, rtol=0, atol=0)
    total = x.double() + residual.double()
    inputs, residuals = x.clone(), residual.clone()
    assert no_host_access(fused, inputs, residuals, weight, 1e-6) is None  # in place, as sgl-kernel
    torch.testing.assert_close(residuals.double(), total, **TOLERANCE[dtype])
    torch.testing.assert_close(inputs.double(), rms_reference(total, weight, 1e-6, gemma), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, act", [
    ("silu_and_mul", lambda x: x * torch.sigmoid(x)),
    ("gelu_and_mul", lambda x: 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))),
    ("gelu_tanh_and_mul", lambda x: 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))),
])
def test_activations_and_mul_equal_the_reference(name, act, dtype):
    x = random(4, 2, 2 * 48, dtype=dtype, seed=3)
    expected = act(x[..., :48].double()) * x[..., 48:].double()
    got = no_host_access(getattr(cuda_kernels, name), x)
    assert got.shape == (4, 2, 48) and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **TOLERANCE[dtype])
    out = torch.empty(4, 2, 48, dtype=dtype)
    assert getattr(cuda_kernels, name)(x, out) is out
    torch.testing.assert_close(out, got, rtol=0, atol=0)


def test_merge_state_equals_sglangs_triton_merge():
    require_sglang()
    from sglang.kernels.ops.attention.merge_state import merge_state_triton

    tokens, heads, dim = 5, 3, 16
    v_a, v_b = random(tokens, heads, dim, seed=4), random(tokens, heads, dim, seed=5)
    s_a, s_b = random(tokens, heads, seed=6) * 3, random(tokens, heads, seed=7) * 3
    s_a[0, 0] = float("inf")  # an empty prefix (SGLang marks it +inf): the suffix alone
    s_b[1, 2] = float("-inf")
    expected_v, expected_s = merge_state_triton(v_a, s_a, v_b, s_b, None, torch.empty(tokens, heads))
    got_v, got_s = no_host_access(cuda_kernels.merge_state_v2, v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got_v, expected_v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_s, expected_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_v[0, 0], v_b[0, 0], rtol=0, atol=1e-7)
    into_v, into_s = torch.empty_like(v_a), torch.empty(tokens, heads)
    assert cuda_kernels.merge_state_v2(v_a, s_a, v_b, s_b, into_v, into_s) == (into_v, into_s)
    torch.testing.assert_close(into_v, got_v, rtol=0, atol=0)


def test_moe_sums_reduce_over_the_topk_dimension():
    x = random(6, 4, 32, seed=8)
    out = torch.empty(6, 32)
    no_host_access(cuda_kernels.moe_sum_reduce, x, out, 2.5)
    torch.testing.assert_close(out.double(), x.double().sum(1) * 2.5, rtol=1e-6, atol=1e-6)
    no_host_access(cuda_kernels.moe_sum, x, out)
    torch.testing.assert_close(out.double(), x.double().sum(1), rtol=1e-6, atol=1e-6)


def test_renorms_keep_the_top_k_or_top_p_mass_and_renormalise():
    probs = torch.softmax(random(4, 50, seed=9) * 2, -1)
    top_k = torch.tensor([1, 5, 50, 7])
    kept = no_host_access(cuda_kernels.top_k_renorm_prob, probs, top_k)
    for row, k in enumerate(top_k.tolist()):
        expected = set(torch.topk(probs[row], k).indices.tolist())
        assert set(torch.nonzero(kept[row]).flatten().tolist()) == expected
    torch.testing.assert_close(kept.sum(-1), torch.ones(4))
    top_p = torch.tensor([0.0, 0.3, 0.9, 1.0])
    nucleus = no_host_access(cuda_kernels.top_p_renorm_prob, probs, top_p)
    for row, p in enumerate(top_p.tolist()):
        ordered = torch.sort(probs[row], descending=True)
        before = torch.cumsum(ordered.values, 0) - ordered.values
        expected = {int(i) for i, mass in zip(ordered.indices, before) if mass < p} | {int(ordered.indices[0])}
        assert set(torch.nonzero(nucleus[row]).flatten().tolist()) == expected
    torch.testing.assert_close(nucleus.sum(-1), torch.ones(4))


def test_weak_ref_tensor_aliases_without_owning():
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, 2:5]
    storage_uses = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    alias = no_host_access(cuda_kernels.weak_ref_tensor, view)
    assert (alias.data_ptr(), alias.shape, alias.stride(), alias.storage_offset()) == (
        view.data_ptr(), view.shape, view.stride(), view.storage_offset())
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) == storage_uses  # a view would add one
    view[0, 0] = -1.0
    assert alias[0, 0] == -1.0
    assert cuda_kernels.weak_ref_tensor(3) == 3
    assert cuda_kernels.is_arch_support_pdl() is False  # no CUDA device here


@pytest.fixture
def cuda_mode(monkeypatch):
    """The CUDA-mode module installed for one test; sys.modules and torch.ops restored after."""
    for name in [name for name in sys.modules if name == "sgl_kernel" or name.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(torch.ops, "sgl_kernel", raising=False)  # a CPU-mode namespace of another test: gone
    kernels.install("cuda")
    yield
    for name in [name for name in sys.modules if name == "sgl_kernel" or name.startswith("sgl_kernel.")]:
        del sys.modules[name]


def test_cuda_mode_resolves_what_sglang_imports_and_nothing_else(cuda_mode):
    import importlib.util

    import sgl_kernel

    for name in cuda_kernels.STAND_INS:
        assert getattr(sgl_kernel, name) is cuda_kernels.STAND_INS[name]
    from sgl_kernel.utils import is_arch_support_pdl  # noqa: F401
    from sgl_kernel.kvcacheio import transfer_kv_direct
    from sgl_kernel.quantization import ggml_dequantize  # noqa: F401

    with pytest.raises(NotImplementedError, match="no CUDA stand-in .* a GPU machine without sgl-kernel"):
        transfer_kv_direct()
    with pytest.raises(ImportError):
        from sgl_kernel import allreduce  # noqa: F401  custom all-reduce must take its fallback
    with pytest.raises(ImportError):
        import sgl_kernel.flash_attn  # noqa: F401  FA3's compiled kernels: not stood in
    with pytest.raises(ImportError):
        from sgl_kernel import fused_qk_rope_with_cos_sin_cache_inplace  # noqa: F401  a probe sees it absent
    assert importlib.util.find_spec("sgl_kernel") is not None
    # torch.ops.sgl_kernel answers nothing: SGLang's AMX probe says no, and register_fake_if_exists registers no
    # fake for an op torch does not have (it raised "operator sgl_kernel::int8_scaled_mm does not exist")
    for name in ("convert_weight_packed", "int8_scaled_mm", "rmsnorm"):
        assert not hasattr(torch.ops.sgl_kernel, name)


def test_an_unknown_mode_is_one_line():
    with pytest.raises(SpecError, match="mode 'rocm': choose one of cpu, cuda"):
        kernels.install("rocm")


def _real_source(module: str):
    """The installed SGLang's source of ``module`` (which cannot import here: it needs nvidia-cutlass-dsl)."""
    import ast
    import importlib.util

    require_sglang()
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return ast.parse(open(spec.origin).read())


def test_the_dual_gemm_standin_has_the_names_dual_gemm_imports_and_the_real_enum():
    import ast

    from sglang_spec_testbed import cuda_host

    standin = cuda_host.dual_gemm_standin()
    layer = _real_source("sglang.srt.layers.dual_gemm")
    imported = {alias.name for node in ast.walk(layer) if isinstance(node, ast.ImportFrom)
                and node.module == cuda_host.DUAL_GEMM_MODULE for alias in node.names}
    assert imported and all(hasattr(standin, name) for name in imported), imported
    real = _real_source(cuda_host.DUAL_GEMM_MODULE)
    enum_class = next(node for node in real.body if isinstance(node, ast.ClassDef) and node.name == "DualGemmQuantMode")
    members = {target.id: node.value.value for node in enum_class.body if isinstance(node, ast.Assign)
               for target in node.targets}
    assert members == {mode.name: mode.value for mode in cuda_host.DualGemmQuantMode}
    limit = next(node.value.value for node in real.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", "") == "MAX_DUAL_GEMM_DECODE_TOKENS")
    assert standin.MAX_DUAL_GEMM_DECODE_TOKENS == limit
    assert not standin.can_use_dual_gemm(4, 4096, 11008, cuda_host.DualGemmQuantMode.UNQUANT)
    with pytest.raises(RuntimeError, match="SM100"):
        standin.dual_gemm_swiglu(torch.zeros(1, 8), torch.zeros(16, 8))


def test_the_cute_dsl_standins_go_in_only_where_cutlass_is_absent_and_let_dual_gemm_build(monkeypatch):
    import importlib.util

    from sglang_spec_testbed import cuda_host

    require_sglang()
    real_find_spec = importlib.util.find_spec
    for cutlass_present in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, present=cutlass_present:
                            (object() if present else None) if name == "cutlass" else real_find_spec(name, *args))
        monkeypatch.delitem(sys.modules, cuda_host.DUAL_GEMM_MODULE, raising=False)
        cuda_host.install_cute_dsl_standins()
        assert (cuda_host.DUAL_GEMM_MODULE in sys.modules) is (not cutlass_present)
    # layers/dual_gemm.py's own import, as a Llama MLP runs it on CUDA: the stand-in answers, no dual GEMM chosen
    from sglang.kernels.ops.gemm.cutedsl_dual_gemm import (MAX_DUAL_GEMM_DECODE_TOKENS, DualGemmQuantMode,
                                                           can_use_dual_gemm)

    assert not can_use_dual_gemm(MAX_DUAL_GEMM_DECODE_TOKENS, 576, 1536, DualGemmQuantMode.UNQUANT)
    monkeypatch.delitem(sys.modules, cuda_host.DUAL_GEMM_MODULE)
