"""MTP head weights: our own safetensors format, and DeepSeek-V3/R1's checkpoint layout.

Our format is one ``.safetensors`` file: the head's state dict (block, enorm, hnorm, eh_proj, shared_head_norm,
optional draft_vocab) plus a JSON header entry ``sglang_spec_mtp`` with the target's model type, hidden size,
vocabulary size, feedback mode and free-form training metadata. The shared embedding and output head are not
stored: they come from the target.

DeepSeek's layout keeps the MTP layer as ``model.layers.{num_hidden_layers}.*`` in the sharded checkpoint
(``model.safetensors.index.json``): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head``,
``embed_tokens`` and the decoder layer, whose routed experts are stored one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) where transformers fuses them (``gate_up_proj``, ``down_proj``).
FP8 weights come with ``weight_scale_inv`` (one scale per 128 x 128 block) and are dequantised on load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_spec.errors import SpecError
from sglang_spec.mtp.head import MTPHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FORMAT = "sglang_spec.mtp/1"
HEADER_KEY = "sglang_spec_mtp"
FP8_BLOCK = 128


def save_mtp_head(
    head: MTPHead, path: str | Path, metadata: dict[str, Any] | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Writes the head to ``path`` (a ``.safetensors`` file); floating tensors in ``dtype`` when given (bfloat16
    halves a shipped head; loading casts back to the target's dtype)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "format": FORMAT,
        "target_model_type": head.config.model_type,
        "hidden_size": head.config.hidden_size,
        "vocab_size": head.vocab_size,
        "feedback": head.feedback,
        "draft_vocab_size": head.draft_vocab_size,
        "metadata": metadata or {},
    }
    tensors = {
        name: (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).detach().contiguous()
        for name, tensor in head.state_dict().items()
    }
    save_file(tensors, str(path), metadata={HEADER_KEY: json.dumps(header)})
    return path


def read_mtp_header(path: str | Path) -> dict[str, Any]:
    path = _head_file(path)
    with safe_open(str(path), "pt") as handle:
        raw = (handle.metadata() or {}).get(HEADER_KEY)
    if raw is None:
        raise SpecError(f"{path} is not an sglang_spec MTP head (no {HEADER_KEY!r} header); for a DeepSeek checkpoint "
                        f"pass its folder")
    return json.loads(raw)


def load_mtp_head(path: str | Path, target: PreTrainedModel) -> MTPHead:
    """Loads a head saved by ``save_mtp_head`` and attaches it to ``target``, checking that they fit."""
    path = _head_file(path)
    header = read_mtp_header(path)
    config = target.config
    if header.get("format") != FORMAT:
        raise SpecError(f"{path}: unknown head format {header.get('format')!r} (expected {FORMAT})")
    if header["hidden_size"] != config.hidden_size:
        raise SpecError(
            f"{path}: the head's hidden size {header['hidden_size']} does not match the target's {config.hidden_size}"
        )
    if header["vocab_size"] != config.vocab_size:
        raise SpecError(
            f"{path}: the head's vocabulary ({header['vocab_size']}) does not match the target's ({config.vocab_size})"
        )
    if header["target_model_type"] != config.model_type:
        raise SpecError(
            f"{path}: the head was built for a {header['target_model_type']} target, not {config.model_type}"
        )
    with safe_open(str(path), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    head = MTPHead.for_target(target, feedback=header["feedback"], draft_vocab=tensors.get("draft_vocab"))
    _load_state(head, tensors, str(path))
    head.refresh_draft_head()
    return head


def _head_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            raise SpecError(f"{path}: expected one .safetensors MTP head file in the folder, found {len(candidates)}")
        return candidates[0]
    if not path.exists():
        raise SpecError(f"MTP head {path} does not exist")
    return path


def _load_state(head: MTPHead, tensors: dict[str, torch.Tensor], source: str) -> None:
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise SpecError(
            f"{source}: MTP weights do not fit this target's head (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise SpecError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the target's head needs {tuple(expected[name].shape)}"
            )
    head.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in tensors.items()})


# ---- DeepSeek-V3/R1 layout -------------------------------------------------------------------------------------

_FUSED_EXPERTS = re.compile(r"^block\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def deepseek_mtp_state_dict(head: MTPHead, target: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The head under DeepSeek's names, ``model.layers.{num_hidden_layers}.*`` (embedding and output head copied
    from the target, as in the released checkpoints)."""
    prefix = f"model.layers.{target.config.num_hidden_layers}."
    result = {
        prefix + "enorm.weight": head.enorm.weight,
        prefix + "hnorm.weight": head.hnorm.weight,
        prefix + "eh_proj.weight": head.eh_proj.weight,
        prefix + "shared_head.norm.weight": head.shared_head_norm.weight,
        prefix + "shared_head.head.weight": target.get_output_embeddings().weight,
        prefix + "embed_tokens.weight": target.get_input_embeddings().weight,
    }
    for name, tensor in head.block.state_dict().items():
        fused = _FUSED_EXPERTS.match("block." + name)
        if fused is None:
            result[prefix + name] = tensor
        elif fused.group(1) == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                result[f"{prefix}mlp.experts.{expert}.gate_proj.weight"] = gate[expert]
                result[f"{prefix}mlp.experts.{expert}.up_proj.weight"] = up[expert]
        else:
            for expert in range(tensor.shape[0]):
                result[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = tensor[expert]
    return {name: tensor.detach().clone() for name, tensor in result.items()}


def load_deepseek_mtp(checkpoint: str | Path, target: PreTrainedModel, feedback: str = "pre_norm") -> MTPHead:
    """Reads ``model.layers.{num_hidden_layers}.*`` from a DeepSeek-V3/R1 checkpoint folder (sharded through
    ``model.safetensors.index.json`` or a single ``model.safetensors``) into an MTP head for ``target``."""
    checkpoint = Path(checkpoint)
    layer = target.config.num_hidden_layers
    if getattr(target.config, "num_nextn_predict_layers", 0) in (0, None):
        raise SpecError(f"{checkpoint}: the model config has num_nextn_predict_layers = 0 (no MTP layer); pass --mtp PATH")
    raw = _read_prefixed(checkpoint, f"model.layers.{layer}.")
    if not raw:
        raise SpecError(
            f"{checkpoint} has no MTP weights (model.layers.{layer}.*); pass --mtp PATH to a trained MTP head"
        )
    tensors = _dequantize_fp8(raw)
    head = MTPHead.for_target(target, feedback=feedback)
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    direct = {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "shared_head_norm.weight",
    }
    for name, tensor in tensors.items():
        if name in direct:
            state[direct[name]] = tensor
        elif name in ("shared_head.head.weight", "embed_tokens.weight"):
            _check_shared(name, tensor, target, checkpoint)
        elif (match := _PER_EXPERT.match(name)) is not None:
            experts[(int(match.group(1)), match.group(2))] = tensor
        else:
            state["block." + name] = tensor
    if experts:
        count = 1 + max(expert for expert, _ in experts)
        try:
            state["block.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([experts[(e, "gate_proj")], experts[(e, "up_proj")]], dim=0) for e in range(count)]
            )
            state["block.mlp.experts.down_proj"] = torch.stack([experts[(e, "down_proj")] for e in range(count)])
        except KeyError as error:
            raise SpecError(f"{checkpoint}: MTP expert weights are incomplete (missing {error.args[0]})") from None
    _load_state(head, state, str(checkpoint))
    return head


def _read_prefixed(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if name.startswith(prefix):
                shards.setdefault(shard, []).append(name)
    elif (checkpoint / "model.safetensors").exists():
        with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
            shards = {"model.safetensors": [name for name in handle.keys() if name.startswith(prefix)]}
    else:
        raise SpecError(f"{checkpoint}: no model.safetensors.index.json or model.safetensors found")
    result = {}
    for shard, names in shards.items():
        if not (checkpoint / shard).exists():
            raise SpecError(f"{checkpoint}: shard {shard} named by the index is missing")
        with safe_open(str(checkpoint / shard), "pt") as handle:
            for name in names:
                result[name[len(prefix) :]] = handle.get_tensor(name)
    return result


def _dequantize_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 weights times their per-128x128-block inverse scales, in float32; scale entries are dropped."""
    result = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if scale is not None:
            rows, columns = tensor.shape
            expanded = scale.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :columns]
            tensor = tensor.float() * expanded
        result[name] = tensor
    return result


def _check_shared(name: str, tensor: torch.Tensor, target: PreTrainedModel, checkpoint: Path) -> None:
    own = (target.get_output_embeddings() if name.startswith("shared_head") else target.get_input_embeddings()).weight
    if tensor.shape != own.shape:
        raise SpecError(
            f"{checkpoint}: MTP {name} has shape {tuple(tensor.shape)} but the target's is {tuple(own.shape)}; "
            f"the MTP layer belongs to another model"
        )
