"""sgl-kernel's ops on SGLang 0.5.23's CUDA server paths, in torch: what a GPU machine without sgl-kernel serves with
(``kernels.install("cuda")``, activated by ``boot_cuda/sitecustomize.py``).

SGLang imports these names at module level on the paths a Llama or DeepSeek NEXTN server takes with the triton,
flashinfer or fa3 attention back-ends (``layers/layernorm.py``, ``layers/activation.py``, ``layers/sampler.py``,
``layers/attention/triton_backend.py``, ``flashattention_backend.py`` / ``merge_state.py``,
``runner_backend_utils/weak_ref_tensor.py``, ``moe_runner/triton_utils/fused_moe.py``), and calls some of them.
Every function here takes and returns tensors on any device, reads nothing back to the host (no ``.item()``, no
``.tolist()``, no data-dependent shapes) and allocates only its outputs, so it can be captured in a CUDA graph.
Signatures follow sgl-kernel's Python wrappers; ``enable_pdl`` is accepted and ignored.

``IMPORTED_ONLY`` names resolve to placeholders that raise when called: SGLang imports them unconditionally on
these paths but calls them only for quantised checkpoints, GGUF or host KV pools, none of which a check serves.
Names not listed are absent (``AttributeError`` / ``ImportError``), so SGLang's probes take their fallbacks:
``sgl_kernel.allreduce`` (custom all-reduce falls back to NCCL) and ``sgl_kernel.flash_attn`` (FA3's compiled
kernels: an fa3 server fails at start with one line naming them).
"""

from __future__ import annotations

import math

import torch

from sglang_spec_testbed.sampling import top_k_renorm_prob, top_p_renorm_prob


# ---------------------------------------------------------------------------------------------- norms
def _rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS(x) over the last dimension, float32, shape (..., 1)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """``out = input / RMS(input) * weight`` per row; input (..., H), weight (H,); computed in float32, written in
    input's dtype into ``out`` (allocated when None), which is returned."""
    x = input.float()
    result = (x * _rms_scale(x, eps) * weight.float()).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place: ``residual += input``, then ``input = rmsnorm(residual) * weight`` (the sum kept in float32 for
    the norm, as sgl-kernel does); both (..., H)."""
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(total * _rms_scale(total, eps) * weight.float())


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                  enable_pdl: bool | None = None) -> torch.Tensor:
    """Gemma's norm: ``input / RMS(input) * (1 + weight)``; otherwise as ``rmsnorm``."""
    x = input.float()
    result = (x * _rms_scale(x, eps) * (1.0 + weight.float())).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: bool | None = None) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * (1 + weight)``."""
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(total * _rms_scale(total, eps) * (1.0 + weight.float()))


# ---------------------------------------------------------------------------------------------- activations
def _act_and_mul(act, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``act(input[..., :d]) * input[..., d:]`` for input (..., 2d), in float32, written in input's dtype."""
    half = input.shape[-1] // 2
    x = input.float()
    result = (act(x[..., :half]) * x[..., half:]).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    return _act_and_mul(torch.nn.functional.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    return _act_and_mul(lambda x: torch.nn.functional.gelu(x, approximate="none"), input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None,
                      enable_pdl: bool | None = None) -> torch.Tensor:
    return _act_and_mul(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), input, out)


# ---------------------------------------------------------------------------------------------- attention
def merge_state_v2(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                   v_merged: torch.Tensor | None = None,
                   s_merged: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention partial results merged by their log-sum-exps (natural log, +inf read as -inf, as SGLang's
    Triton ``merge_state``): v (tokens, heads, dim), s (tokens, heads) float32. Returns (v_merged in v_a's dtype,
    s_merged float32), written into the given buffers when passed."""
    a = torch.where(torch.isposinf(s_a), torch.full_like(s_a, -math.inf), s_a.float())
    b = torch.where(torch.isposinf(s_b), torch.full_like(s_b, -math.inf), s_b.float())
    top = torch.maximum(a, b)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # both empty: weights 0 / 0 as the kernel
    weight_a, weight_b = torch.exp(a - top), torch.exp(b - top)
    total = weight_a + weight_b
    merged = (v_a.float() * (weight_a / total)[..., None] + v_b.float() * (weight_b / total)[..., None])
    lse = torch.log(total) + top
    if v_merged is None:
        v_merged = merged.to(v_a.dtype)
    else:
        v_merged.copy_(merged)
    if s_merged is None:
        s_merged = lse
    else:
        s_merged.copy_(lse)
    return v_merged, s_merged


# ---------------------------------------------------------------------------------------------- MoE
def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float = 1.0) -> None:
    """``output = input.sum(1) * routed_scaling_factor`` for input (tokens, topk, hidden), in float32."""
    output.copy_(input.float().sum(1) * routed_scaling_factor)


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    """``output = input.sum(1)`` for input (tokens, topk, hidden)."""
    output.copy_(input.float().sum(1))


# ---------------------------------------------------------------------------------------------- graphs, devices
def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory (same device, dtype, shape, strides, offset) that does not keep it
    alive: SGLang's breakable prefill graphs hand these out so a graph's outputs do not pin the pool. A non-tensor
    is returned as is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    storage = tensor.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(unowned, tensor.storage_offset(), tensor.size(), tensor.stride())


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch needs sm90+: True on a Hopper or newer current CUDA device, else False."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


STAND_INS = {
    "rmsnorm": rmsnorm, "fused_add_rmsnorm": fused_add_rmsnorm, "gemma_rmsnorm": gemma_rmsnorm,
    "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm, "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul, "merge_state_v2": merge_state_v2, "moe_sum_reduce": moe_sum_reduce,
    "moe_sum": moe_sum, "weak_ref_tensor": weak_ref_tensor, "is_arch_support_pdl": is_arch_support_pdl,
    "top_k_renorm_prob": top_k_renorm_prob, "top_p_renorm_prob": top_p_renorm_prob,
}

# imported at module level on the CUDA server paths, never called there (see the module doc)
IMPORTED_ONLY = frozenset({
    "int8_scaled_mm", "ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8",
    "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
})

# the sub-modules SGLang imports from on these paths; ``allreduce`` and ``flash_attn`` stay absent
SUBMODULES = ("utils", "quantization", "kvcacheio", "elementwise", "sampling", "moe", "attention")
