"""Small gaps in SGLang's own CPU code paths that the project's models need filled (applied as HookRegistry hooks by
``sglang_spec.sglang_plugin.register`` when the CPU harness is active; never on a GPU host).

* ``get_rope_cpu`` handles only DeepSeek's yarn scaling and asserts on a model with plain RoPE (our tiny
  DeepSeek-V3 has none); plain RoPE goes to SGLang's generic ``get_rope``, which runs in torch on any device.
* DeepSeek's ``set_embed_and_head`` (the NEXTN draft sharing the target's embedding and head) ends with
  ``torch.cuda.synchronize()``, which raises without CUDA; on the CPU the same rebinding needs no sync.
* EAGLE verify commits the argmax on a CPU whatever the temperature (``_verify_uses_greedy`` lists ``is_cpu``)
  because SGLang's sampling-verify kernels are CUDA-only; with the stand-ins of ``sampling`` installed as the
  module's kernels (``ATTRIBUTES``: those names are ``None`` off CUDA, so they are set directly rather than
  hooked), sampled requests take SGLang's real sampling path.
* SGLang's CPU engine multiplies by weights it packed at load (``weight_packed_linear``), for bf16 and the like:
  ``linear`` packs the bed's float32 weights after ``ModelRunner.load_model`` and sends the linear layers' products
  to its stand-in of that op (the draft's own weights rounded to bfloat16 with ``SGLANG_SPEC_CPU_DRAFT_WEIGHTS``,
  its token map's LM head once SGLang's draft worker has made it), and packs them again after SGLang updates a
  runner's weights in place (``update_weights_from_*``: a hot-swapped draft head).
* SGLang's dummy forward (warm-up, autotune; ``--speculative-tree-auto`` times it at start-up) asks the attention
  backend for the dummy batch's sequence length through the CUDA-graph name; the CPU backend answers only to its
  CPU-graph name, with the same value.
* Trees (topk > 1) at page size > 1: SGLang lays each beam's draft slots out on its own pages (``prepare_for_draft``,
  the prefix's partial tail page copied into every branch) and reads them back with its GPU backends (flashinfer,
  fa3, triton); it refuses the combination on any other backend, ``intel_amx`` included, because sgl-kernel's CPU
  draft metadata op assumes page size 1. The bed's stand-in of that op reads the paged layout when the draft
  backend binds it to the page size (``amx_draft_backend_init_after``), so the refusal, the last statement of
  ``_handle_eagle_family``, is let through for ``intel_amx`` only (``handle_eagle_family_cpu``).

* With ``SGLANG_SPEC_CPU_OVERLAP=1`` (tests), a speculative server keeps SGLang's overlap scheduler, which SGLang
  turns off for every speculative server on a CPU (``speculative_hook._disable_overlap_schedule_for_cpu``; its EAGLE
  v2 worker runs the loop here unchanged, greedy output identical): the loop a GPU server runs by default, where a
  step's result is processed after the next step is launched (``committed`` completes what the plugin reads). Under
  that loop a step's result is copied to the host for processing (``async_d2h``): on a GPU the copy is a snapshot
  taken in stream order, before the next step runs; SGLang's CPU path returns the tensor itself, so a result kept
  in a buffer the next step reuses (the fused accept's) would be read after that step overwrote it. The bed's
  copy is a snapshot too (``async_d2h_snapshot``).

The tree-mask layout's hooks (the backend's binding; with ``SGLANG_SPEC_CPU_TREE_MASK``, SGLang's choice of
layout) are in ``tree_mask`` and registered beside these.
"""

from __future__ import annotations

import functools
import importlib
import os

from sglang_spec_testbed import sampling
from sglang_spec_testbed.linear import (  # noqa: F401 (HOOKS)
    init_lm_head_after, linear_apply_around, load_model_after, weights_updated_after)
from sglang_spec.sglang_plugin.messages import log

_WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
HOOKS = (
    ("sglang.srt.model_executor.model_runner.ModelRunner.load_model", "load_model_after", "AFTER"),
    (f"{_WEIGHT_UPDATER}.update_weights_from_disk", "weights_updated_after", "AFTER"),
    (f"{_WEIGHT_UPDATER}.update_weights_from_tensor", "weights_updated_after", "AFTER"),
    (f"{_WEIGHT_UPDATER}.load_weights_from_distributed", "weights_updated_after", "AFTER"),
    ("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply", "linear_apply_around", "AROUND"),
    ("sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head", "init_lm_head_after", "AFTER"),
    ("sglang.srt.layers.rotary_embedding.factory.get_rope_cpu", "get_rope_cpu_around", "AROUND"),
    ("sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head", "set_embed_and_head_cpu", "REPLACE"),
    ("sglang.srt.speculative.eagle_utils._verify_uses_greedy", "verify_uses_greedy_cpu", "REPLACE"),
    ("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.get_cuda_graph_seq_len_fill_value",
     "seq_len_fill_value_cpu", "REPLACE"),
    ("sglang.srt.arg_groups.speculative_hook._handle_eagle_family", "handle_eagle_family_cpu", "AROUND"),
    ("sglang.srt.layers.attention.intel_amx_backend.IntelAMXMultiStepDraftBackend.__init__",
     "amx_draft_backend_init_after", "AFTER"),
)
# SGLANG_SPEC_CPU_OVERLAP=1: speculative servers keep SGLang's overlap scheduler (hooks(overlap=True))
OVERLAP_ENV = "SGLANG_SPEC_CPU_OVERLAP"
OVERLAP_HOOKS = (("sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu",
                  "keep_overlap_schedule_cpu", "REPLACE"),
                 ("sglang.srt.utils.common.async_d2h", "async_d2h_snapshot", "AROUND"))
# SGLang's refusal of trees at page size > 1 off its GPU backends (speculative_hook._handle_eagle_family)
PAGED_TREE_REFUSAL = "speculative_eagle_topk > 1 with page_size > 1 is only supported on"
# module attribute -> stand-in (module ``sglang_spec_testbed.sampling``)
ATTRIBUTES = {
    "sglang.srt.speculative.eagle_utils": ("tree_speculative_sampling_target_only", "top_k_renorm_prob",
                                           "top_p_renorm_prob"),
}


def hooks(overlap: bool) -> tuple[tuple[str, str, str], ...]:
    """The bed's hooks; ``overlap`` (``OVERLAP_ENV``): also those of the overlap scheduler (kept on; results
    copied to the host as a GPU copies them)."""
    return HOOKS + (OVERLAP_HOOKS if overlap else ())


def overlap_from_environment() -> bool:
    return os.environ.get(OVERLAP_ENV) == "1"


def keep_overlap_schedule_cpu(server_args) -> None:
    """In place of SGLang's ``_disable_overlap_schedule_for_cpu``: the overlap scheduler stays as the user set it."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if not resolving_view(server_args).disable_overlap_schedule:
        log(f"CPU bed: the speculative server keeps SGLang's overlap scheduler ({OVERLAP_ENV}=1)")


def async_d2h_snapshot(original, tensor):
    """A step's result copied to the host for the overlap loop's processing: a snapshot, as a GPU's copy is."""
    return tensor.clone() if tensor.device.type == "cpu" else original(tensor)


def install_attributes() -> None:
    """Sets the sampling stand-ins on the modules that hold ``None`` for them off CUDA. A HookRegistry hook
    cannot do it: its patch propagation rebinds every module attribute equal to the original, here ``None``."""
    for module_name, names in ATTRIBUTES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, getattr(sampling, name))


def get_rope_cpu_around(original, head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                        dtype=None, partial_rotary_factor=1.0, device=None):
    if rope_scaling is None:
        from sglang.srt.layers.rotary_embedding.factory import get_rope

        return get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, dtype, partial_rotary_factor)
    return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                    partial_rotary_factor, device)


def set_embed_and_head_cpu(model, embed, head) -> None:
    del model.model.embed_tokens.weight
    del model.lm_head.weight
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head


def verify_uses_greedy_cpu(*, is_all_greedy, is_cpu, is_hip, is_xpu, use_rejection_sampling) -> bool:
    """SGLang's predicate without the ``is_cpu`` clause: the CPU bed has sampling-verify stand-ins."""
    return is_all_greedy or is_xpu or (is_hip and not use_rejection_sampling)


def seq_len_fill_value_cpu(backend) -> int:
    return backend.get_cpu_graph_seq_len_fill_value()


def handle_eagle_family_cpu(original, server_args) -> None:
    """SGLang's EAGLE-family resolution, with its refusal of trees at page size > 1 let through for ``intel_amx``
    (the bed reads the paged draft layout: ``amx_draft_backend_init_after``). The refusal is the function's last
    statement (checked by the tests), so letting it through skips nothing else; any other error stands."""
    try:
        original(server_args)
    except ValueError as error:
        if not (str(error).startswith(PAGED_TREE_REFUSAL) and "'intel_amx'" in str(error)):
            raise


def amx_draft_backend_init_after(result, backend, model_runner, *args, **kwargs):
    """After ``IntelAMXMultiStepDraftBackend.__init__``: the draft metadata op it holds (the bed's
    ``ops.build_draft_decode_metadata_cpu``) reads the beams' draft slots in the layout SGLang assigns at the
    server's page size."""
    page_size = int(getattr(model_runner, "page_size", 1) or 1)
    backend.build_draft_decode_metadata = functools.partial(backend.build_draft_decode_metadata, page_size=page_size)
    if page_size > 1 and backend.topk > 1:
        log(f"CPU bed: draft decode reads SGLang's paged draft layout (page size {page_size}, {backend.topk} beams "
            f"on their own pages)")
    return result
