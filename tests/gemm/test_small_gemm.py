"""The AVX-512 small-GEMM kernel computes its reference (F.linear, plus the residual) at every row count and shape
a decode step, a verify or an odd weight can give it, and refuses bad input in one line."""

import os

import pytest
import torch

from sglang_spec.gemm.small_gemm import (
    PANEL_COLUMNS, SmallGemmUnavailable, load_small_gemm, pack_weight, small_gemm, small_gemm_available,
    small_gemm_reference,
)

needs_kernel = pytest.mark.skipif(not small_gemm_available(), reason="no AVX-512 CPU or no C++ compiler here")


def test_the_kernel_is_here_where_it_is_required() -> None:
    """scripts/test.sh requires the kernel (the CI machine has AVX-512 and g++): a build failure fails, not skips."""
    if os.environ.get("SGLANG_SPEC_REQUIRE_SMALL_GEMM") != "1":
        pytest.skip("SGLANG_SPEC_REQUIRE_SMALL_GEMM is not set")
    load_small_gemm()  # raises SmallGemmUnavailable with the reason


def test_pack_weight_puts_32_columns_side_by_side_and_pads_with_zeros() -> None:
    weight = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    panels = pack_weight(weight)
    assert panels.shape == (3, 3, PANEL_COLUMNS) and panels.is_contiguous()
    for out in range(70):
        block, column = divmod(out, PANEL_COLUMNS)
        assert torch.equal(panels[block, :, column], weight[out])
    assert not panels[2, :, 70 - 64 :].any()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11, 12, 13, 16, 17, 24, 25, 33, 64, 65])
@pytest.mark.parametrize("out_features,in_features", [(96, 40), (70, 33), (1, 5), (31, 1), (576, 576)])
def test_matches_the_reference(rows: int, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    panels = pack_weight(weight)
    tolerance = 2e-6 * in_features**0.5  # float32 sums of in_features unit-scale products, in another order
    torch.testing.assert_close(small_gemm(x, panels, out_features), small_gemm_reference(x, weight),
                               rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(small_gemm(x, panels, out_features, residual),
                               small_gemm_reference(x, weight, residual), rtol=tolerance, atol=tolerance)


def test_bfloat16_panels_hold_the_rounded_weight_and_other_dtypes_are_refused() -> None:
    weight = torch.randn(70, 3)
    panels = pack_weight(weight, torch.bfloat16)
    assert panels.dtype == torch.bfloat16 and panels.shape == (3, 3, PANEL_COLUMNS)
    assert torch.equal(panels[0, :, 5], weight[5].to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        pack_weight(weight, torch.float16)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 13, 17])
@pytest.mark.parametrize("out_features,in_features", [(96, 40), (70, 33), (576, 576)])
def test_bfloat16_panels_compute_the_rounded_weights_product(rows: int, out_features: int, in_features: int) -> None:
    """The kernel widens bfloat16 panels in registers and sums in float32: the reference's product with the weight
    rounded, to float32 summation order; not the unrounded weight's (the rounding is real)."""
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    panels = pack_weight(weight, torch.bfloat16)
    tolerance = 2e-6 * in_features**0.5
    got = small_gemm(x, panels, out_features)
    torch.testing.assert_close(got, small_gemm_reference(x, weight, dtype=torch.bfloat16), rtol=tolerance,
                               atol=tolerance)
    torch.testing.assert_close(small_gemm(x, panels, out_features, residual),
                               small_gemm_reference(x, weight, residual, dtype=torch.bfloat16), rtol=tolerance,
                               atol=tolerance)
    assert not torch.allclose(got, small_gemm_reference(x, weight), rtol=tolerance, atol=tolerance)
    assert torch.equal(small_gemm(x[:1], panels, out_features)[0], got[0])  # a row alone: the same bits


@needs_kernel
def test_a_row_comes_out_the_same_whatever_rides_along() -> None:
    """Each output is one FMA chain over k, whatever the row tiling: a node's logits in a 17-row verify are
    bit-identical to the same row run alone (F.linear gives no such promise)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 96, generator=generator)
    x = torch.randn(40, 96, generator=generator)
    panels = pack_weight(weight)
    together = small_gemm(x, panels, 200)
    for rows in (1, 5, 17, 40):
        assert torch.equal(small_gemm(x[:rows], panels, 200), together[:rows])
    assert torch.equal(small_gemm(x[7:8], panels, 200)[0], together[7])


@needs_kernel
def test_strided_input_zero_rows_and_a_wrong_answer_is_caught() -> None:
    weight = torch.randn(64, 48)
    panels = pack_weight(weight)
    x = torch.randn(48, 10).t()  # not contiguous
    torch.testing.assert_close(small_gemm(x, panels, 64), small_gemm_reference(x, weight), rtol=1e-5, atol=1e-5)
    assert small_gemm(torch.empty(0, 48), panels, 64).shape == (0, 64)
    # the comparison above can fail: a weight changed after packing is not what the panels hold
    changed = weight.clone()
    changed[5, 7] += 1.0
    assert not torch.allclose(small_gemm(x, panels, 64), small_gemm_reference(x, changed), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bad_input_is_refused_in_one_line() -> None:
    panels = pack_weight(torch.randn(64, 48))
    cases = [
        (torch.randn(4, 47), panels, 64, None, "columns"),
        (torch.randn(4, 48, dtype=torch.float64), panels, 64, None, "float32"),
        (torch.randn(4, 48), panels, 65, None, "out_features"),
        (torch.randn(4, 48), panels, 64, torch.randn(4, 63), "residual"),
        (torch.randn(4, 48), panels[:, :, :16], 64, None, "pack_weight"),
        (torch.randn(4, 48), panels.half(), 64, None, "float32 or bfloat16"),
    ]
    for x, packed, out_features, residual, word in cases:
        with pytest.raises(RuntimeError, match=word) as raised:
            load_small_gemm().small_gemm(x, packed, out_features, residual)
        assert "small_gemm:" in str(raised.value).splitlines()[0]


def test_unavailable_is_an_error_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_spec.gemm import small_gemm as module

    module._build.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    try:
        with pytest.raises(SmallGemmUnavailable, match="AVX2, not AVX512"):
            load_small_gemm()
        assert not small_gemm_available()
    finally:
        module._build.cache_clear()


@needs_kernel
def test_a_stale_build_lock_is_one_line_not_a_wait_without_end(tmp_path, monkeypatch) -> None:
    """torch waits on its build lock for ever; one older than any build is named in one line and callers fall back."""
    from sglang_spec.gemm import small_gemm as module

    lock = tmp_path / "sglang_spec_small_gemm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    module._build.cache_clear()
    try:
        stale = lock.stat().st_mtime - module.STALE_LOCK_SECONDS - 1
        os.utime(lock, (stale, stale))
        with pytest.raises(SmallGemmUnavailable, match="lock is older than .* delete it"):
            module.load_small_gemm()
        assert not module.small_gemm_available()
    finally:
        monkeypatch.undo()
        module._build.cache_clear()
    assert module.small_gemm_available()  # the real build directory again
