"""Tiny DeepSeek-V3-shaped models (MLA + MoE + one MTP layer), built from a config in code.

* ``build_tiny_deepseek``: random weights (seeded).
* ``save_tiny_deepseek``: a model and its MTP head as a DeepSeek-style checkpoint.

The model behind ``--model tiny-deepseek`` is this architecture trained on a toy language
(``sglang_spec.train.build_tiny_deepseek``).

Checkpoints are written like DeepSeek-V3/R1's: the main model in one shard, the MTP layer under
``model.layers.{num_hidden_layers}.*`` in another, and a ``model.safetensors.index.json`` mapping both, so the MTP
loader is exercised exactly as on the real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_spec.files import write_text_atomic
from sglang_spec.mtp.checkpoint import deepseek_mtp_state_dict
from sglang_spec.mtp.head import MTPHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TINY_DEEPSEEK_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
    num_nextn_predict_layers=1,
    initializer_range=0.02,
    eos_token_id=1,
    bos_token_id=0,
)


def tiny_deepseek_config(**overrides: Any) -> Any:
    """transformers' DeepseekV3Config with TINY_DEEPSEEK_CONFIG, then ``overrides``."""
    # transformers is the optional `models` extra and takes seconds to import: only building a model pays for it
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{**TINY_DEEPSEEK_CONFIG, **overrides})
    config._attn_implementation = "sdpa"
    return config


def build_tiny_deepseek(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A DeepseekV3ForCausalLM with seeded random weights, float32, eval mode."""
    from transformers import DeepseekV3ForCausalLM  # optional and heavy, as in tiny_deepseek_config

    config = tiny_deepseek_config(**overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
    return model.to(torch.float32).eval()


# fields every released DeepSeek-V3/R1 config.json carries that transformers' DeepseekV3Config does not define
# (its MoE always routes this way); SGLang's DeepSeek model reads them
CHECKPOINT_CONFIG_FIELDS = {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}

MAIN_SHARD = "model-00001-of-00002.safetensors"
MTP_SHARD = "model-00002-of-00002.safetensors"


def random_tiny_deepseek(device: str | torch.device = "cpu",
                         vocab_size: int | None = None) -> tuple[PreTrainedModel, MTPHead]:
    """The tiny DeepSeek-V3 with seeded random weights (initializer range 0.2: clear argmaxes) and a seeded random
    MTP head; ``vocab_size`` replaces the config's vocabulary. Greedy identity holds for any weights, so nothing
    is trained: what the benchmarks' greedy-identity runs and the tests' ``random_tiny`` fixture decode with."""
    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    model = build_tiny_deepseek(seed=3, initializer_range=0.2, **overrides).to(device)
    with torch.random.fork_rng():
        torch.manual_seed(4)
        head = MTPHead.for_target(model)
    return model, head


def save_tiny_deepseek(path: str | Path, model: PreTrainedModel, head: MTPHead) -> Path:
    """Writes ``model`` and its MTP ``head`` as a DeepSeek-style sharded checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    (path / "model.safetensors").rename(path / MAIN_SHARD)
    with safe_open(str(path / MAIN_SHARD), "pt") as handle:
        weight_map = {name: MAIN_SHARD for name in handle.keys()}
    mtp_tensors = deepseek_mtp_state_dict(head, model)
    save_file({name: tensor.contiguous() for name, tensor in mtp_tensors.items()}, str(path / MTP_SHARD))
    weight_map.update({name: MTP_SHARD for name in mtp_tensors})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    complete_checkpoint_config(path)
    return path


def complete_checkpoint_config(path: Path) -> None:
    """Adds CHECKPOINT_CONFIG_FIELDS to a saved config.json that lacks them (checkpoints cached before they were
    written get them on first use)."""
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    if all(config.get(name) == value for name, value in CHECKPOINT_CONFIG_FIELDS.items()):
        return
    config.update(CHECKPOINT_CONFIG_FIELDS)
    write_text_atomic(config_path, json.dumps(config, indent=2) + "\n")  # never a half-written cached model
