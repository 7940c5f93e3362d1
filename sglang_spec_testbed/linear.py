"""A stand-in for sgl-kernel's CPU GEMM (``weight_packed_linear``) over float32 weights packed once at load.

SGLang's CPU engine runs its linear layers and the LM head through sgl-kernel's ``weight_packed_linear`` on weights
that ``convert_weight_packed`` re-laid out once after loading (bf16 / fp16 / int8 on AMX CPUs: ``amx_utils``). The
CPU bed serves float32, which SGLang leaves on ``F.linear``; at a decode step's or a tree verify's few rows that
reads the weights at a fraction of this machine's memory speed, so the bed's steps were dominated by GEMMs a real
CPU engine does not run (SmolLM2's linear layers at 1 / 16 rows on one thread: 35 / 69 ms through ``F.linear``,
16 / 31 ms packed; its LM head 9.5 / 24 ms against 4.2 / 8.5 ms). This module gives the bed the same shape of
kernel: ``pack_model`` packs every unquantized linear layer's and the LM head's float32 weight once after the
model loads (``gemm.packed_linear.PackedLinear``, the reference decoder's GEMM: the project's AVX-512 kernel where
it builds, MKL's packed GEMM otherwise), and ``weight_packed_linear`` multiplies by the packed weight.

The weight tensor itself is left as loaded (the pack rides on it as an attribute), because a tied LM head is also
the embedding table and SGLang's draft workers rebind the target's head into the draft model. A weight without a
pack (one built after loading, e.g. a hot-token head) is packed at its first product. Results equal ``F.linear``'s
up to float32 summation order; the AVX-512 kernel sums each row in the same order whatever the row count, so a
token's logits in a tree verify equal its logits in a plain step.

``SGLANG_SPEC_CPU_GEMM`` (read once, at load) picks the backend: ``avx512``, ``mkl`` or ``linear`` (no packing:
SGLang's own ``F.linear`` path, what the bed ran before); unset, the best available.

``SGLANG_SPEC_CPU_DRAFT_WEIGHTS=bfloat16`` (opt-in; unset or ``float32``: as loaded) packs the draft model's own
weights rounded to bfloat16, as SGLang's CPU engine packs a bf16 model: its linear layers at load, and a reduced
draft vocabulary's LM head when SGLang's draft worker makes it (``init_lm_head_after``). A weight the draft shares
with the target (the target's head, without a token map) keeps the target's float32 pack, because the pack rides
on the tensor and the target packs first. The drafter's products then stream half the bytes (SmolLM2's head, its
8,192-token LM head: 0.65 -> 0.36 ms at 8 rows); its rounding can change the proposals, never what the target
accepts, so outputs stay the target's. The target stays float32, the precision the bed checks outputs at.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from sglang_spec.errors import SpecError
from sglang_spec.gemm.packed_linear import BACKENDS, PackedLinear, available_backends
from sglang_spec.sglang_plugin.messages import log

GEMM_ENV = "SGLANG_SPEC_CPU_GEMM"
DRAFT_WEIGHTS_ENV = "SGLANG_SPEC_CPU_DRAFT_WEIGHTS"
DRAFT_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PACK_ATTRIBUTE = "_sglang_spec_packed"  # set on a weight tensor: its PackedLinear


def backend_from_environment(environment=None) -> str:
    """The backend ``SGLANG_SPEC_CPU_GEMM`` names (unset: the best available). A bad or unavailable name is one
    line (``SpecError``); ``activate`` checks it before SGLang starts."""
    environment = os.environ if environment is None else environment
    name = environment.get(GEMM_ENV, "").strip()
    if not name:
        return available_backends()[0]
    if name not in BACKENDS:
        raise SpecError(f"{GEMM_ENV}={name!r} is not a GEMM backend; use one of {', '.join(BACKENDS)} or unset it")
    if name not in available_backends():
        raise SpecError(f"{GEMM_ENV}={name} cannot run on this machine; available: {', '.join(available_backends())}")
    return name


def draft_dtype_from_environment(environment=None) -> torch.dtype:
    """The dtype ``SGLANG_SPEC_CPU_DRAFT_WEIGHTS`` names for the draft model's packs (unset: float32). A bad name
    is one line (``SpecError``); ``activate`` checks it before SGLang starts."""
    environment = os.environ if environment is None else environment
    name = environment.get(DRAFT_WEIGHTS_ENV, "").strip()
    if not name:
        return torch.float32
    if name not in DRAFT_WEIGHT_DTYPES:
        raise SpecError(f"{DRAFT_WEIGHTS_ENV}={name!r} is not a draft weight dtype; use one of "
                        f"{', '.join(DRAFT_WEIGHT_DTYPES)} or unset it")
    return DRAFT_WEIGHT_DTYPES[name]


def packable(weight) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu" \
        and weight.dtype == torch.float32


def pack(weight: torch.Tensor, backend: str | None = None, dtype: torch.dtype = torch.float32) -> PackedLinear:
    """The weight's PackedLinear, made (and its panels packed, the weight rounded to ``dtype``) on first call and
    kept on the tensor: a later call gets the first pack, whatever it asks."""
    packed = getattr(weight, PACK_ATTRIBUTE, None)
    if packed is None:
        packed = PackedLinear(weight, backend, dtype)
        packed.prepare(1)
        setattr(weight, PACK_ATTRIBUTE, packed)
    return packed


def weight_packed_linear(mat1: torch.Tensor, mat2: torch.Tensor, bias, is_vnni: bool) -> torch.Tensor:
    """sgl-kernel's op: mat1 [M, K] @ mat2 [N, K]^T (+ bias [N]) -> [M, N] in mat1's dtype. ``is_vnni`` names
    sgl-kernel's packed layout; here the pack is the one ``pack`` keeps on ``mat2``."""
    del is_vnni
    if not packable(mat2) or mat1.dtype != torch.float32:
        return F.linear(mat1, mat2.to(mat1.dtype), None if bias is None else bias.to(mat1.dtype))
    out = pack(mat2)(mat1.contiguous())
    return out if bias is None else out.add_(bias)


def _unquantized_linear_layers(model: torch.nn.Module):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
            yield module


def pack_model(model: torch.nn.Module, backend: str, dtype: torch.dtype = torch.float32) -> int:
    """Packs the float32 CPU weights of ``model``'s unquantized linear layers and of its LM head (whose
    product SGLang sends to ``weight_packed_linear`` once the head is marked, as its CPU engine marks packed
    heads), rounded to ``dtype``; returns the number of weights packed. ``linear``: nothing packed."""
    if backend == "linear":
        return 0
    count = 0
    for layer in _unquantized_linear_layers(model):
        if packable(getattr(layer, "weight", None)):
            pack(layer.weight, backend, dtype)
            count += 1
    head = getattr(model, "lm_head", None)
    if head is not None and packable(getattr(head, "weight", None)):
        pack(head.weight, backend, dtype)
        head.use_intel_amx_backend = True
        count += 1
    return count


def linear_apply_around(original, method, layer, x, bias=None):
    """SGLang's ``UnquantizedLinearMethod.apply``: a packed weight goes through ``weight_packed_linear`` (its
    CPU engine's branch for packed layers; the layer's ``use_intel_amx_backend`` flag is left alone because
    DeepSeek's MoE reads it to pick fused CPU kernels the bed does not stand in)."""
    weight = layer.weight
    if getattr(weight, PACK_ATTRIBUTE, None) is None:
        return original(method, layer, x, bias)
    shape = x.shape
    out = weight_packed_linear(x.reshape(-1, shape[-1]), weight, bias, True)
    return out.view(*shape[:-1], out.shape[-1])


def load_model_after(result, model_runner):
    """After ``ModelRunner.load_model``: packs the loaded model (target and draft alike; the draft's in the dtype
    of ``SGLANG_SPEC_CPU_DRAFT_WEIGHTS``), says so in one line."""
    backend = backend_from_environment()
    draft = bool(getattr(model_runner, "is_draft_worker", False))
    dtype = draft_dtype_from_environment() if draft else torch.float32
    count = pack_model(model_runner.model, backend, dtype)
    role = "draft" if draft else "target"
    rounded = "" if dtype == torch.float32 else f", rounded to {str(dtype).removeprefix('torch.')}"
    log(f"CPU bed: {count} float32 weights of the {role} model packed for the {backend} GEMM{rounded}" if count else
        f"CPU bed: the {role} model's linear layers run F.linear ({GEMM_ENV}={backend})")
    return result


def init_lm_head_after(result, worker):
    """After SGLang's ``EagleDraftWorker.init_lm_head``: a head made for the draft alone (a token map's reduced
    vocabulary: a new tensor, not packed yet) is packed in the draft's dtype now rather than float32 at its first
    product; the target's own head, when shared, already has its pack and keeps it."""
    dtype = draft_dtype_from_environment()
    backend = backend_from_environment()
    head = getattr(getattr(worker.draft_runner, "model", None), "lm_head", None)
    weight = getattr(head, "weight", None)
    if dtype != torch.float32 and backend != "linear" and packable(weight) \
            and getattr(weight, PACK_ATTRIBUTE, None) is None:
        pack(weight, backend, dtype)
        log(f"CPU bed: the draft's own LM head ({weight.shape[0]} tokens) packed for the {backend} GEMM, rounded "
            f"to {str(dtype).removeprefix('torch.')}")
    return result


def repack_model(model: torch.nn.Module) -> int:
    """Packs again every weight of ``model`` that carries a pack, from the values it holds now, each in its pack's
    dtype and backend; returns the number repacked. A weight SGLang updated in place keeps its tensor, so the pack
    riding on it would go on multiplying by the old values."""
    weights = [layer.weight for layer in _unquantized_linear_layers(model)]
    head = getattr(model, "lm_head", None)
    if head is not None:
        weights.append(getattr(head, "weight", None))
    count = 0
    for weight in weights:
        packed = getattr(weight, PACK_ATTRIBUTE, None)
        if packed is None:
            continue
        delattr(weight, PACK_ATTRIBUTE)
        pack(weight, packed.backend, packed.dtype)
        count += 1
    return count


def weights_updated_after(result, updater, *args, **kwargs):
    """After one of SGLang's in-place weight updates of a model runner (``WeightUpdater.update_weights_from_disk``,
    ``update_weights_from_tensor``, ``load_weights_from_distributed``: each returns (success, message)): the runner's
    packs made again from the new values, as SGLang's CPU engine packs again after a load."""
    success = result[0] if isinstance(result, tuple) and result else False
    if success:
        count = repack_model(updater.get_model())
        if count:
            role = "draft" if getattr(updater.get_model_runner(), "is_draft_worker", False) else "target"
            log(f"CPU bed: {count} weights of the {role} model packed again after a weight update")
    return result


STAND_INS = {"weight_packed_linear": weight_packed_linear}
