"""An sglang_spec MTP head on a Llama-family target as an SGLang draft model (DeepSeek's NextN layout).

The head computes, at position i with the target's final (post-norm) hidden state h_i and the next token t:

    x  = eh_proj([enorm(Emb(t)) ; hnorm(h_i)])
    h' = LlamaDecoderLayer(x)                     one layer, its own KV cache (SGLang's draft pool)
    logits = lm_head(shared_head_norm(h'))        target's embedding and head, shared by SGLang

exactly as ``sglang_spec.mtp.head.MTPHead`` does, and feeds back h' (``pre_norm``, how the shipped heads were
trained) or shared_head_norm(h') (``post_norm``, SGLang's DeepSeek NextN) as the next step's hidden state, per the
``sglang_spec_feedback`` entry of the draft config. A reduced draft vocabulary is SGLang's token map
(``--speculative-token-map``), which slices the shared head the same way.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.llama import LlamaAttention, LlamaMLP
from sglang.srt.utils import add_prefix

FEEDBACK_KEY = "sglang_spec_feedback"


class _HeadLayer(nn.Module):
    """One Llama decoder layer that keeps its own residual (SGLang's stage boundaries are for full models)."""

    def __init__(self, config, quant_config, prefix: str) -> None:
        super().__init__()
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        self.self_attn = LlamaAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            layer_id=0,
            rope_theta=rope_parameters.get("rope_theta", getattr(config, "rope_theta", 10000)),
            rope_scaling=rope_parameters or getattr(config, "rope_scaling", None),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=quant_config,
            prefix=add_prefix("self_attn", prefix),
            bias=getattr(config, "attention_bias", False),
            reduce_results=True,
        )
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config,
                            prefix=add_prefix("mlp", prefix), reduce_results=True)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        attended = self.self_attn(positions=positions, hidden_states=self.input_layernorm(hidden),
                                  forward_batch=forward_batch)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLMNextN(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.feedback = getattr(config, FEEDBACK_KEY, "pre_norm")
        if self.feedback not in ("pre_norm", "post_norm"):
            raise ValueError(f"{FEEDBACK_KEY} must be pre_norm or post_norm, got {self.feedback!r}")
        model = nn.Module()
        model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                    prefix=add_prefix("model.embed_tokens", prefix))
        model.enorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        model.hnorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # SGLang's linear layer, unquantized as DeepSeek's NextN keeps it (on a GPU F.linear, as nn.Linear was),
        # so a CPU engine runs it on its packed GEMM with the head's other layers (nn.Linear on the bed: ~1 ms of
        # a 53 ms extraction step at one request, over the draft extend and the head's rounds)
        model.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, bias=False, quant_config=None,
                                         prefix=add_prefix("model.eh_proj", prefix))
        model.decoder = _HeadLayer(config, quant_config, add_prefix("model.decoder", prefix))
        model.shared_head_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      prefix=add_prefix("lm_head", prefix))
        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None, **unused):
        model = self.model
        embedded = model.embed_tokens(input_ids) if input_embeds is None else input_embeds
        previous = forward_batch.spec_info.hidden_states  # [T, d]: target states, or this head's fed-back ones
        fused, _ = model.eh_proj(torch.cat([model.enorm(embedded), model.hnorm(previous)], dim=-1))
        hidden = model.decoder(positions, fused, forward_batch)
        normed = model.shared_head_norm(hidden)
        before_norm = hidden if self.feedback == "pre_norm" else None
        return self.logits_processor(input_ids, normed, self.lm_head, forward_batch,
                                     hidden_states_before_norm=before_norm)

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names as ``export.export_llama_draft`` writes them: ``model.{enorm,hnorm,eh_proj,shared_head_norm}``
        and ``model.decoder.*`` with Hugging Face Llama layer names (q/k/v and gate/up are stacked here)."""
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        attention, mlp = [], []
        for name, tensor in weights:
            if name.startswith("model.decoder.self_attn."):
                attention.append((name[len("model.decoder.self_attn."):], tensor))
            elif name.startswith("model.decoder.mlp."):
                mlp.append((name[len("model.decoder.mlp."):], tensor))
            elif name in params:
                params[name].data.copy_(tensor.to(params[name].dtype))
                loaded.add(name)
        loaded |= {"model.decoder.self_attn." + n for n in self.model.decoder.self_attn.load_weights(attention)}
        loaded |= {"model.decoder.mlp." + n for n in self.model.decoder.mlp.load_weights(mlp)}
        return loaded


EntryClass = [LlamaForCausalLMNextN]
