"""A Llama model folder whose attention splits over more ranks: zero heads appended, the same outputs.

SmolLM2-135M has 9 query heads over 3 KV heads, which SGLang's ``LlamaAttention`` cannot shard over 2 ranks
(``total_num_heads % tp_size == 0``, and KV heads divisible by it or dividing it). ``pad_attention_heads`` appends
KV heads whose key and value projections are zero, and behind them query heads in the same grouping (``group``
query heads a KV head) whose query projection is zero and whose columns of the output projection are zero: an
appended query head attends uniformly over zero values and its output is multiplied by zero, so every layer's
output is the original's. The original heads keep their indices and their KV groups (head ``h`` reads KV head
``h // group`` in both). The padded SmolLM2 (12 query heads, 4 KV heads) splits over 2 or 4 ranks.

It pads the target folder and an exported draft folder alike (any ``*.self_attn.{q,k,v,o}_proj`` tensors); the
other files of the folder are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sglang_spec.errors import SpecError
from sglang_spec.files import atomic_path, write_text_atomic

WEIGHTS = "model.safetensors"


def padded_head_counts(num_attention_heads: int, num_key_value_heads: int, key_value_heads: int) -> int:
    """The query heads of a model padded to ``key_value_heads`` KV heads, keeping its grouping (query heads per
    KV head). ValueError when the model's heads are not grouped evenly or ``key_value_heads`` is fewer."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"{num_attention_heads} query heads do not group evenly over {num_key_value_heads} KV heads")
    if key_value_heads < num_key_value_heads:
        raise ValueError(f"padding to {key_value_heads} KV heads would drop heads (the model has "
                         f"{num_key_value_heads})")
    return key_value_heads * (num_attention_heads // num_key_value_heads)


def pad_projection(name: str, tensor: torch.Tensor, head_dim: int, query_heads: int, key_value_heads: int
                   ) -> torch.Tensor:
    """``tensor`` (one attention projection's weight or bias, named as in the checkpoint) with the appended heads'
    rows (q / k / v: [heads * head_dim, hidden] -> [padded heads * head_dim, hidden]) or columns (o: [hidden,
    heads * head_dim] -> [hidden, padded heads * head_dim]) zero; any other tensor unchanged."""
    stem = name.rsplit(".", 1)[0]
    if stem.endswith("self_attn.o_proj") and name.endswith(".weight"):
        extra = query_heads * head_dim - tensor.shape[1]
        return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], extra)], dim=1)
    for projection, heads in (("q_proj", query_heads), ("k_proj", key_value_heads), ("v_proj", key_value_heads)):
        if stem.endswith(f"self_attn.{projection}"):
            extra = heads * head_dim - tensor.shape[0]
            return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])], dim=0)
    return tensor


def pad_attention_heads(source_dir: str | Path, out_dir: str | Path, key_value_heads: int,
                        skip: tuple[str, ...] = ()) -> Path:
    """Writes ``source_dir`` (a Llama-family folder with one ``model.safetensors``) padded to ``key_value_heads``
    KV heads into ``out_dir`` (its config's head counts updated, every other file copied but those named in
    ``skip``, which are removed from ``out_dir``); returns ``out_dir``."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    config = json.loads((source_dir / "config.json").read_text())
    if config.get("model_type") != "llama" or not (source_dir / WEIGHTS).exists():
        raise SpecError(f"{source_dir}: pad_attention_heads pads a Llama folder with one {WEIGHTS}")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    query_heads = padded_head_counts(config["num_attention_heads"], config["num_key_value_heads"], key_value_heads)
    tensors = {name: pad_projection(name, tensor, head_dim, query_heads, key_value_heads).contiguous()
               for name, tensor in load_file(str(source_dir / WEIGHTS)).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in skip:
        (out_dir / name).unlink(missing_ok=True)
    for path in source_dir.iterdir():
        if path.is_file() and path.name not in (WEIGHTS, "config.json", *skip) and not path.name.startswith("."):
            with atomic_path(out_dir / path.name) as temporary:
                shutil.copy(path, temporary)
    with atomic_path(out_dir / WEIGHTS) as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    padded = {**config, "num_attention_heads": query_heads, "num_key_value_heads": key_value_heads,
              "head_dim": head_dim}
    write_text_atomic(out_dir / "config.json", json.dumps(padded, indent=1) + "\n")
    return out_dir
