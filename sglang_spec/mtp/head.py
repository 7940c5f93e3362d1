"""DeepSeek-V3's multi-token-prediction (MTP) module, for any transformers decoder-only target.

At position i the head combines the target's hidden state h_i (post final norm) with the embedding of the next
token t_{i+1} and predicts t_{i+2}:

    x   = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])      (embedding first, as in every released port)
    h'  = Block(x)                                         (one decoder layer of the target's own type:
                                                            MLA + MoE for DeepSeek-V3, a Llama layer for Llama)
    P   = softmax(Head(shared_head_norm(h')))              (the target's embedding and output head, shared)

Drafting recursively feeds h' (``feedback="pre_norm"``, vLLM) or shared_head_norm(h') (``"post_norm"``, SGLang)
back in as the next step's hidden state. The head's block keeps its own KV cache (one layer).

A head may draft over a reduced vocabulary (``draft_vocab``: the token ids it can propose, most frequent first);
verification always uses the target's full vocabulary, so output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglang_spec.gemm.packed_linear import PackedLinear
from sglang_spec.errors import SpecError

if TYPE_CHECKING:
    from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

FEEDBACK_MODES = ("pre_norm", "post_norm")


@dataclass(frozen=True, eq=False)
class MTPStepOutput:
    """hidden: [B, T, d] the state fed back to the next draft step; logits: [B, T, V_draft]."""

    hidden: torch.Tensor
    logits: torch.Tensor


def _target_classes(target: PreTrainedModel) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of a transformers causal LM."""
    base = getattr(target, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(base, "norm") or not hasattr(base, "rotary_emb"):
        raise SpecError(
            f"{type(target).__name__} is not a supported target: the MTP head needs a decoder-only model with "
            f"model.layers, model.norm and model.rotary_emb (Llama, Qwen, Mistral, DeepSeek-V3 families)"
        )
    return type(layers[0]), type(base.norm), type(base.rotary_emb)


class MTPHead(nn.Module):
    """One MTP module. Build with ``MTPHead.for_target(target)``; the target's embedding and output head are
    shared (not parameters of the head, not in its state dict)."""

    draft_vocab: torch.Tensor | None  # [V_draft] int64 buffer, or None for the full vocabulary
    _embed: nn.Module | None  # the target's input embedding (shared, not a submodule)
    _full_head_weight: torch.Tensor  # [V, d] the target's output head weight (shared)
    _head_weight: torch.Tensor  # [V_draft, d] its rows for the draft vocabulary
    _head_linear: PackedLinear  # x @ _head_weight.T at drafting's few rows (gemm/packed_linear.py)

    def __init__(
        self,
        config: PretrainedConfig,
        layer_class: type,
        norm_class: type,
        rotary_class: type,
        feedback: str = "pre_norm",
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if feedback not in FEEDBACK_MODES:
            raise SpecError(f"feedback must be one of {FEEDBACK_MODES}, got {feedback!r}")
        hidden = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.config = config
        self.feedback = feedback
        self.enorm = norm_class(hidden, eps=eps)
        self.hnorm = norm_class(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # layer_idx = num_hidden_layers picks the layer type DeepSeek uses for its MTP layer (MoE);
        # the head's own cache holds this one layer, so its attention reads and writes cache layer 0
        self.block = layer_class(config, layer_idx=config.num_hidden_layers)
        self.block.self_attn.layer_idx = 0
        self.shared_head_norm = norm_class(hidden, eps=eps)
        self.rotary_emb = rotary_class(config=config)
        self.register_buffer("draft_vocab", None if draft_vocab is None else draft_vocab.to(torch.int64).clone())
        object.__setattr__(self, "_embed", None)

    @classmethod
    def for_target(
        cls, target: PreTrainedModel, feedback: str = "pre_norm", draft_vocab: torch.Tensor | None = None
    ) -> MTPHead:
        layer_class, norm_class, rotary_class = _target_classes(target)
        head = cls(target.config, layer_class, norm_class, rotary_class, feedback=feedback, draft_vocab=draft_vocab)
        # transformers initialises a layer's weights in PreTrainedModel.post_init (fused experts start as
        # torch.empty), so borrow the target's initialiser for every module of the head
        init_weights = getattr(target, "_init_weights", None)
        if init_weights is not None:
            head.apply(init_weights)
        # the embedding, not any parameter: a target shell (models/target_shell.py) has only it and the output
        # head off the meta device
        parameter = target.get_input_embeddings().weight
        head.to(device=parameter.device, dtype=parameter.dtype)
        return head.attach(target)

    def attach(self, target: PreTrainedModel) -> MTPHead:
        """Shares the target's input embedding and output head (kept outside this module's parameters)."""
        embed, output = target.get_input_embeddings(), target.get_output_embeddings()
        if embed.weight.shape[1] != self.config.hidden_size:
            raise SpecError(
                f"MTP head hidden size {self.config.hidden_size} does not match the target's "
                f"{embed.weight.shape[1]}; use a head trained for this target"
            )
        if output.weight.shape[0] != embed.weight.shape[0]:
            raise SpecError("the target's embedding and output head disagree on the vocabulary size")
        if self.draft_vocab is not None and int(self.draft_vocab.max()) >= output.weight.shape[0]:
            raise SpecError("the head's draft vocabulary names tokens outside the target's vocabulary")
        object.__setattr__(self, "_embed", embed)
        self.refresh_draft_head(output.weight)
        return self

    def refresh_draft_head(self, full_head_weight: torch.Tensor | None = None) -> None:
        """Caches the (possibly reduced) output head weight; call again after changing ``draft_vocab``.
        full_head_weight: [V, d] the target's output head weight (default: the one attached)."""
        weight = (full_head_weight if full_head_weight is not None else self._full_head_weight).detach()
        object.__setattr__(self, "_full_head_weight", weight)
        reduced = weight if self.draft_vocab is None else weight.index_select(0, self.draft_vocab.to(weight.device))
        object.__setattr__(self, "_head_weight", reduced)
        # drafting runs the output head on 1-k rows: the small-row GEMM of the target's verify (training: F.linear)
        object.__setattr__(self, "_head_linear", PackedLinear(reduced))

    @property
    def vocab_size(self) -> int:
        """Size of the full (target) vocabulary."""
        return int(self._full_head_weight.shape[0])

    @property
    def draft_vocab_size(self) -> int:
        return int(self._head_weight.shape[0])

    def to_full_vocab(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Maps indices of the draft vocabulary to target token ids."""
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def forward(
        self,
        input_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: DynamicCache | None,
    ) -> MTPStepOutput:
        """input_ids: [B, T] next tokens; previous_hidden: [B, T, d]; position_ids: [B, T]; attention_mask:
        [B, 1, T, S + T] in the target's attention format, or None for plain causal attention over the cache."""
        if self._embed is None:
            raise SpecError("the MTP head is not attached to a target; build it with MTPHead.for_target(target)")
        embedded = self.enorm(self._embed(input_ids))
        fused = self.eh_proj(torch.cat([embedded, self.hnorm(previous_hidden)], dim=-1))
        position_embeddings = self.rotary_emb(fused, position_ids)
        hidden = self.block(
            fused,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=past_key_values is not None,
            position_embeddings=position_embeddings,
        )
        if isinstance(hidden, tuple):  # older transformers layers return (hidden, ...)
            hidden = hidden[0]
        normed = self.shared_head_norm(hidden)
        if torch.is_grad_enabled() and normed.requires_grad:
            logits = nn.functional.linear(normed, self._head_weight)
        else:
            logits = self._head_linear(normed.reshape(-1, normed.shape[-1])).reshape(*normed.shape[:-1], -1)
        return MTPStepOutput(hidden=hidden if self.feedback == "pre_norm" else normed, logits=logits)
