"""PackedLinear computes F.linear's product on every backend (the AVX-512 kernel, MKL packs, F.linear)."""

import pytest
import torch
import torch.nn.functional as F

from sglang_spec.gemm.packed_linear import (
    BACKENDS, MAX_SMALL_ROWS, PACK_BUCKETS, PackedLinear, available_backends, best_backend,
    mkl_packing_available,
)
from sglang_spec.gemm.small_gemm import small_gemm_available

needs_mkl = pytest.mark.skipif(not mkl_packing_available(), reason="this PyTorch has no MKL packed GEMM")
AVAILABLE = {"avx512": small_gemm_available(), "mkl": mkl_packing_available(), "linear": True}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 16, 17, 33, 64, 65, 200])
def test_matches_linear_at_every_row_count(backend: str, rows: int) -> None:
    if not AVAILABLE[backend]:
        pytest.skip(f"the {backend} backend is not available here")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    x = torch.randn(rows, 40, generator=generator)
    residual = torch.randn(rows, 96, generator=generator)
    linear = PackedLinear(weight, backend)
    assert linear.backend == backend
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear.add_to(residual, x), residual + F.linear(x, weight), rtol=1e-5, atol=1e-5)
    if backend == "mkl":
        used = [bucket for bucket in PACK_BUCKETS if rows <= bucket]
        # 4-64 rows ran on the pack of the smallest bucket that holds them; other counts made no pack
        assert set(linear._packs) == ({used[0]} if 4 <= rows <= 64 else set())
    assert (linear._panels is not None) == (backend == "avx512" and rows <= MAX_SMALL_ROWS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 8, 17, 200])
def test_a_bfloat16_pack_multiplies_by_the_rounded_weight_on_every_backend(backend: str, rows: int) -> None:
    if not AVAILABLE[backend]:
        pytest.skip(f"the {backend} backend is not available here")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    x = torch.randn(rows, 40, generator=generator)
    rounded = weight.to(torch.bfloat16).float()
    linear = PackedLinear(weight, backend, torch.bfloat16)
    assert linear.backend == backend and torch.equal(linear.weight, rounded)
    torch.testing.assert_close(linear(x), F.linear(x, rounded), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    if linear._panels is not None:
        assert linear._panels.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        PackedLinear(weight, backend, torch.float16)


def test_the_default_is_the_best_backend_here_and_a_wrong_name_is_refused() -> None:
    assert PackedLinear(torch.randn(8, 4)).backend == best_backend()
    assert best_backend() == next(backend for backend in BACKENDS if AVAILABLE[backend])
    assert available_backends() == tuple(backend for backend in BACKENDS if AVAILABLE[backend])
    with pytest.raises(ValueError, match="unknown GEMM backend 'blas'; choose one of avx512, mkl, linear"):
        PackedLinear(torch.randn(8, 4), "blas")


@needs_mkl
def test_padding_rows_do_not_leak_into_the_result() -> None:
    weight = torch.randn(32, 16)
    linear = PackedLinear(weight, "mkl")
    x = torch.randn(5, 16)
    alone = linear(x)  # padded to 8 rows
    assert alone.shape == (5, 32)
    torch.testing.assert_close(alone, linear(torch.cat([x, torch.randn(3, 16)]))[:5], rtol=1e-6, atol=1e-6)


def test_other_dtypes_and_the_linear_backend_run_linear() -> None:
    weight = torch.randn(24, 8, dtype=torch.float64)
    x = torch.randn(16, 8, dtype=torch.float64)
    linear = PackedLinear(weight)
    assert linear.backend == "linear" and not linear.packing
    assert torch.equal(linear(x), F.linear(x, weight))
    off = PackedLinear(weight.float(), "linear")
    assert torch.equal(off(x.float()), F.linear(x.float(), weight.float())) and not off._packs and off._panels is None


@needs_mkl
def test_prepare_adds_the_exact_row_count_and_makes_every_pack_up_to_it() -> None:
    weight = torch.randn(16, 8)
    linear = PackedLinear(weight, "mkl")
    linear.prepare(3)
    assert not linear._packs
    linear.prepare(17)  # a 16-node tree and its root: a bucket of its own, not padded to 32
    assert set(linear._packs) == {4, 8, 16, 17}
    assert linear._bucket(17) == 17 and linear._bucket(18) == 32 and linear._bucket(16) == 16
    x = torch.randn(17, 8)
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    linear.prepare(500)  # past the largest exact bucket: every bucket there is
    assert set(linear._packs) == set(PACK_BUCKETS) | {17}
