"""The CPU bed's stand-in for sgl-kernel's packed GEMM (``sglang_spec_testbed/linear.py``): the product equals
``F.linear``'s, the pack is made once and rides on the weight, a token's row does not depend on the rows beside it (a
tree verify's logits equal a plain step's), SGLang's linear layers and LM head are routed to it, and a bad backend name
is one line. Through the real server: tests/sglang_server/test_smollm2_through_launch_server.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optional_packages import require_sglang
from sglang_spec.errors import SpecError
from sglang_spec.gemm.packed_linear import available_backends
from sglang_spec_testbed import linear


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 65, 300])
def test_weight_packed_linear_equals_f_linear_and_packs_once(backend, rows):
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(100, 48, generator=generator), torch.randn(100, generator=generator)
    x = torch.randn(rows, 48, generator=generator)
    packed = linear.pack(weight, backend)
    assert packed.backend == backend and linear.pack(weight) is packed  # kept on the tensor, made once
    torch.testing.assert_close(linear.weight_packed_linear(x, weight, None, True), F.linear(x, weight),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear.weight_packed_linear(x, weight, bias, True), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)


def test_an_unpacked_weight_is_packed_at_its_first_product_and_other_dtypes_run_f_linear():
    weight, x = torch.randn(40, 32), torch.randn(3, 32)
    assert getattr(weight, linear.PACK_ATTRIBUTE, None) is None
    torch.testing.assert_close(linear.weight_packed_linear(x, weight, None, True), F.linear(x, weight))
    assert getattr(weight, linear.PACK_ATTRIBUTE, None) is not None
    half = weight.to(torch.bfloat16)
    out = linear.weight_packed_linear(x.to(torch.bfloat16), half, None, True)
    assert out.dtype == torch.bfloat16 and getattr(half, linear.PACK_ATTRIBUTE, None) is None


@pytest.mark.skipif("avx512" not in available_backends(), reason="the AVX-512 kernel does not build here")
def test_a_row_is_the_same_whatever_rows_share_its_product():
    """Greedy identity between a tree verify (many rows) and a plain step (one) needs each row's logits to be the
    same bits at every row count: the AVX-512 kernel sums every row in one order. (F.linear does not promise it.)"""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(576, 576, generator=generator), torch.randn(17, 576, generator=generator)
    packed = linear.pack(weight, "avx512")
    together = packed(x)
    for row in range(17):
        assert torch.equal(packed(x[row:row + 1])[0], together[row])


def test_the_backend_comes_from_the_environment_and_a_bad_name_is_one_line():
    assert linear.backend_from_environment({}) == available_backends()[0]
    assert linear.backend_from_environment({linear.GEMM_ENV: "linear"}) == "linear"
    with pytest.raises(SpecError, match="SGLANG_SPEC_CPU_GEMM='blas' is not a GEMM backend; use one of"):
        linear.backend_from_environment({linear.GEMM_ENV: "blas"})


def test_the_draft_weight_dtype_comes_from_the_environment_and_a_bad_name_is_one_line():
    assert linear.draft_dtype_from_environment({}) == torch.float32
    assert linear.draft_dtype_from_environment({linear.DRAFT_WEIGHTS_ENV: "bfloat16"}) == torch.bfloat16
    assert linear.draft_dtype_from_environment({linear.DRAFT_WEIGHTS_ENV: " float32 "}) == torch.float32
    with pytest.raises(SpecError, match="SGLANG_SPEC_CPU_DRAFT_WEIGHTS='fp8' is not a draft weight dtype; use one"):
        linear.draft_dtype_from_environment({linear.DRAFT_WEIGHTS_ENV: "fp8"})


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)


def _tiny_model():
    require_sglang()
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    class Layer(torch.nn.Module):
        def __init__(self, rows: int, columns: int) -> None:
            super().__init__()
            self.quant_method = UnquantizedLinearMethod()
            self.weight = torch.nn.Parameter(torch.randn(rows, columns), requires_grad=False)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer(48, 32), Layer(32, 48)])
    model.other = torch.nn.Linear(32, 32)  # not an SGLang linear layer: left alone
    model.lm_head = _Head()
    return model


def test_pack_model_packs_sglangs_linear_layers_and_marks_the_head():
    model = _tiny_model()
    assert linear.pack_model(model, "linear") == 0 and not hasattr(model.lm_head, "use_intel_amx_backend")
    assert linear.pack_model(model, available_backends()[0]) == 3
    assert all(getattr(layer.weight, linear.PACK_ATTRIBUTE, None) is not None for layer in model.layers)
    assert getattr(model.other.weight, linear.PACK_ATTRIBUTE, None) is None
    assert model.lm_head.use_intel_amx_backend is True  # SGLang's logits processor then calls weight_packed_linear


def test_a_draft_packs_its_own_weights_rounded_and_leaves_the_targets_shared_head_alone(monkeypatch):
    """``load_model_after`` packs a draft model in the environment's dtype and a target in float32;
    ``init_lm_head_after`` packs the draft's own (token-map) head in it, and leaves a head that the target packed."""
    monkeypatch.setenv(linear.DRAFT_WEIGHTS_ENV, "bfloat16")
    backend = available_backends()[0]
    monkeypatch.setenv(linear.GEMM_ENV, backend)
    target, draft = _tiny_model(), _tiny_model()

    class Runner:
        def __init__(self, model, is_draft_worker: bool) -> None:
            self.model, self.is_draft_worker = model, is_draft_worker

    linear.load_model_after(None, Runner(target, False))
    linear.load_model_after(None, Runner(draft, True))
    dtype = {True: torch.bfloat16, False: torch.float32}
    for model, is_draft in ((target, False), (draft, True)):
        for weight in (model.layers[0].weight, model.layers[1].weight, model.lm_head.weight):
            assert getattr(weight, linear.PACK_ATTRIBUTE).dtype == dtype[is_draft]
    worker = type("Worker", (), {})()
    worker.draft_runner = Runner(draft, True)
    draft.lm_head.weight = target.lm_head.weight  # shared: the target's float32 pack stays
    linear.init_lm_head_after(None, worker)
    assert getattr(draft.lm_head.weight, linear.PACK_ATTRIBUTE).dtype == torch.float32
    draft.lm_head.weight = torch.nn.Parameter(target.lm_head.weight[:16].clone(), requires_grad=False)  # token map
    linear.init_lm_head_after(None, worker)
    assert getattr(draft.lm_head.weight, linear.PACK_ATTRIBUTE).dtype == torch.bfloat16
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear.weight_packed_linear(x, draft.lm_head.weight, None, True),
                               F.linear(x, draft.lm_head.weight.to(torch.bfloat16).float()), rtol=1e-5, atol=1e-5)


def test_the_linear_method_routes_packed_weights_to_the_stand_in_and_others_to_sglang():
    model = _tiny_model()
    calls = []

    def original(method, layer, x, bias=None):
        calls.append(layer)
        return F.linear(x, layer.weight, bias)

    layer, method = model.layers[0], model.layers[0].quant_method
    x = torch.randn(2, 5, 32)
    want = F.linear(x, layer.weight)
    torch.testing.assert_close(linear.linear_apply_around(original, method, layer, x), want)
    assert calls == [layer]  # not packed yet: SGLang's own apply
    linear.pack_model(model, available_backends()[0])
    out = linear.linear_apply_around(original, method, layer, x)
    assert out.shape == (2, 5, 48) and calls == [layer]  # packed: the stand-in, shape kept
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
