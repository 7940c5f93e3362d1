"""A target without its weights: what training a head from captured hidden states needs of the target, and no more.

The MTP head shares the target's input embedding and output head and takes its decoder-layer type from the
target's architecture; it never runs the target's layers. ``load_target_shell`` builds the transformers model on
PyTorch's ``meta`` device (shapes only, no memory: DeepSeek-R1's 671B parameters cost nothing) and loads just the
embedding and output head (``model.embed_tokens.weight``, ``lm_head.weight``; tied models have only the first)
from the checkpoint's safetensors, through ``model.safetensors.index.json`` when the checkpoint is sharded. At
R1 scale that is 2 x 129,280 x 7,168 bfloat16 values, 3.7 GB, instead of the whole checkpoint.

The result is a ``LoadedModel`` (tokenizer included) whose ``model`` is that shell: ``MTPHead.for_target``,
``load_head_for`` and the trainer take it as they take a loaded target. Running ``shell.model`` itself fails
(meta tensors), which is the point.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from sglang_spec.errors import SpecError
from sglang_spec.files import read_json
from sglang_spec.models.loading import LoadedModel, load_tokenizer

EMBEDDING = "model.embed_tokens.weight"
OUTPUT_HEAD = "lm_head.weight"


def _shard_of(folder: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """The safetensors file holding each of ``names`` that the checkpoint has."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, "checkpoint index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise SpecError(f"{index}: 'weight_map' must map tensor names to shard file names")
        return {name: folder / str(weight_map[name]) for name in names if name in weight_map}
    single = folder / "model.safetensors"
    if not single.exists():
        raise SpecError(f"{folder}: no model.safetensors.index.json or model.safetensors found")
    try:
        with safe_open(str(single), "pt") as handle:
            present = set(handle.keys())
    except SafetensorError as error:
        raise SpecError(f"{single} is not a readable safetensors file ({str(error).splitlines()[0]})") from None
    return {name: single for name in names if name in present}


def _read_tensor(path: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        with safe_open(str(path), "pt") as handle:
            return handle.get_tensor(name).to(dtype)
    except (SafetensorError, OSError) as error:
        raise SpecError(f"cannot read {name} from {path} ({str(error).splitlines()[0]})") from None


def load_target_shell(label: str, folder: Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> LoadedModel:
    """The target in ``folder`` as a meta-device model with its real (frozen) embedding and output head, on
    ``device`` (where a head built for it trains)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise SpecError(f"cannot read the model config in {folder}: {str(error).splitlines()[0]}") from None
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    files = _shard_of(folder, (EMBEDDING, OUTPUT_HEAD))
    if EMBEDDING not in files:
        raise SpecError(f"{folder}: the checkpoint has no {EMBEDDING}; the head needs the target's embedding")
    embedding = nn.Parameter(_read_tensor(files[EMBEDDING], EMBEDDING, dtype).to(device), requires_grad=False)
    tied = getattr(config, "tie_word_embeddings", False) or OUTPUT_HEAD not in files
    if not tied:
        output = nn.Parameter(_read_tensor(files[OUTPUT_HEAD], OUTPUT_HEAD, dtype).to(device),
                              requires_grad=False)
    else:
        output = embedding
    expected = (config.vocab_size, config.hidden_size)
    for name, weight in ((EMBEDDING, embedding), (OUTPUT_HEAD, output)):
        if tuple(weight.shape) != expected:
            raise SpecError(f"{folder}: {name} has shape {tuple(weight.shape)}, the config says {expected}")
    shell.get_input_embeddings().weight = embedding
    shell.get_output_embeddings().weight = output
    shell.eval()
    tokenizer, eos_ids, chat = load_tokenizer(folder, config)
    return LoadedModel(label, folder, shell, tokenizer, eos_ids, chat=chat, extra={"shell": True})


def read_model_config(folder: Path) -> dict:
    """The model folder's config.json as a dict (model type, hidden size, vocabulary) without transformers."""
    data = read_json(folder / "config.json", "model config")
    if not isinstance(data, dict):
        raise SpecError(f"{folder / 'config.json'} is not a JSON object")
    for key in ("hidden_size", "vocab_size"):
        if not isinstance(data.get(key), int):
            raise SpecError(f"{folder / 'config.json'}: {key!r} must be an integer")
    return data

