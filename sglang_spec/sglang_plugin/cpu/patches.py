"""Small gaps in SGLang's own CPU code paths that the project's models need filled (applied as HookRegistry hooks by
``sglang_spec.sglang_plugin.register`` when the CPU harness is active; never on a GPU host).

* ``get_rope_cpu`` handles only DeepSeek's yarn scaling and asserts on a model with plain RoPE (our tiny
  DeepSeek-V3 has none); plain RoPE goes to SGLang's generic ``get_rope``, which runs in torch on any device.
* DeepSeek's ``set_embed_and_head`` (the NEXTN draft sharing the target's embedding and head) ends with
  ``torch.cuda.synchronize()``, which raises without CUDA; on the CPU the same rebinding needs no sync.
"""

from __future__ import annotations

HOOKS = (
    ("sglang.srt.layers.rotary_embedding.factory.get_rope_cpu", "get_rope_cpu_around", "AROUND"),
    ("sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head", "set_embed_and_head_cpu", "REPLACE"),
)


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
