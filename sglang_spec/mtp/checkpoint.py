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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import atomic_write, check_input_file, parse_json, read_json
from sglang_spec.mtp.head import FEEDBACK_MODES, MTPHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FORMAT = "sglang_spec.mtp/1"
HEADER_KEY = "sglang_spec_mtp"
FP8_BLOCK = 128


def save_mtp_head(
    head: MTPHead, path: str | Path, metadata: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Writes the head to ``path`` (a ``.safetensors`` file) atomically; floating tensors in ``dtype`` when given
    (bfloat16 halves a shipped head; loading casts back to the target's dtype). A head with a NaN or infinite
    weight is refused: it could only ever draft garbage. ``state``: the head's full state dict when its own holds
    shards (a head trained under FSDP2, ``train/distributed.py``); default ``head.state_dict()``."""
    path = Path(path)
    state = head.state_dict() if state is None else state
    _check_finite(state, f"the head for {path}")
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
        for name, tensor in state.items()
    }
    _check_finite(tensors, f"the head for {path}")  # a cast to float16 can overflow
    data = save(tensors, metadata={HEADER_KEY: json.dumps(header)})
    with atomic_write(path, "wb") as handle:
        handle.write(data)
    return path


def _check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SpecError(f"{what}: weight {name} has NaN or infinite values; the training diverged "
                            f"(lower the learning rate)")


def _read_safetensors(
    path: Path, names: list[str] | None = None
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file (``names`` None: all tensors, [] none), or one line saying why
    it cannot be read (truncated, not safetensors, unreadable)."""
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
            wanted = list(handle.keys()) if names is None else names
            tensors = {name: handle.get_tensor(name) for name in wanted}
    except SafetensorError as error:
        raise SpecError(f"{path} is not a readable safetensors file ({str(error).splitlines()[0]})") from None
    except OSError as error:
        raise SpecError(f"cannot read {path}: {error.strerror or error}") from None
    return metadata, tensors


# head tensor name -> the name SGLang's Llama-family draft model loads (``sglang_plugin/draft_models/llama_nextn.py``;
# the decoder layer keeps Hugging Face names under model.decoder.)
LLAMA_DRAFT_RENAMES = {"enorm.weight": "model.enorm.weight", "hnorm.weight": "model.hnorm.weight",
                       "eh_proj.weight": "model.eh_proj.weight",
                       "shared_head_norm.weight": "model.shared_head_norm.weight"}


def llama_draft_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The head file's tensors under the names SGLang's Llama-family draft model loads (float32), and its reduced
    draft vocabulary (None: the full vocabulary). The shared embedding and output head are not among them."""
    path = _head_file(path)
    _, stored = _read_safetensors(path)
    _check_finite(stored, str(path))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.startswith("block."):
            tensors["model.decoder." + name[len("block."):]] = tensor.float()
        elif name in LLAMA_DRAFT_RENAMES:
            tensors[LLAMA_DRAFT_RENAMES[name]] = tensor.float()
    return tensors, stored.get("draft_vocab")


# header fields and the types they must have
_HEADER_FIELDS = {"format": str, "target_model_type": str, "hidden_size": int, "vocab_size": int, "feedback": str}


def read_mtp_header(path: str | Path) -> dict[str, Any]:
    path = _head_file(path)
    metadata, _ = _read_safetensors(path, [])
    raw = metadata.get(HEADER_KEY)
    if raw is None:
        raise SpecError(f"{path} is not an sglang_spec MTP head (no {HEADER_KEY!r} header); for a DeepSeek checkpoint "
                        f"pass its folder")
    try:
        header = parse_json(raw)
    except ValueError as error:
        raise SpecError(f"{path}: the {HEADER_KEY!r} header is {error}") from None
    if not isinstance(header, dict):
        raise SpecError(f"{path}: the {HEADER_KEY!r} header must be a JSON object")
    for name, kind in _HEADER_FIELDS.items():
        value = header.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise SpecError(f"{path}: the head header's {name!r} must be a {kind.__name__}, got {brief(value)}")
    if header["feedback"] not in FEEDBACK_MODES:
        raise SpecError(f"{path}: unknown feedback mode {brief(header['feedback'])} "
                        f"(one of {', '.join(FEEDBACK_MODES)})")
    if not isinstance(header.get("metadata", {}), dict):
        raise SpecError(f"{path}: the head header's 'metadata' must be an object")
    return header


def head_model(header: dict[str, Any]) -> str | None:
    """The model a head was trained for, as its training metadata names it (None when it does not)."""
    model = (header.get("metadata") or {}).get("model")
    return model if isinstance(model, str) and model else None


def load_mtp_head(path: str | Path, target: PreTrainedModel) -> MTPHead:
    """Loads a head saved by ``save_mtp_head`` and attaches it to ``target``, checking that they fit."""
    path = _head_file(path)
    header = read_mtp_header(path)
    config = target.config
    if header.get("format") != FORMAT:
        raise SpecError(f"{path}: unknown head format {brief(header.get('format'))} (expected {FORMAT})")
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
    _, tensors = _read_safetensors(path)
    draft_vocab = tensors.get("draft_vocab")
    if draft_vocab is not None:
        _check_draft_vocab(draft_vocab, config.vocab_size, path)
    _check_finite(tensors, str(path))
    head = MTPHead.for_target(target, feedback=header["feedback"], draft_vocab=draft_vocab)
    _load_state(head, tensors, str(path))
    head.refresh_draft_head()
    return head


def _check_draft_vocab(draft_vocab: torch.Tensor, vocab_size: int, path: Path) -> None:
    """The reduced draft vocabulary: distinct target token ids, one dimension."""
    if draft_vocab.dim() != 1 or draft_vocab.numel() == 0 or draft_vocab.is_floating_point() \
            or draft_vocab.dtype == torch.bool:
        raise SpecError(f"{path}: draft_vocab must be a non-empty 1-D integer tensor, got {draft_vocab.dtype} "
                        f"{tuple(draft_vocab.shape)}")
    ids = draft_vocab.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise SpecError(f"{path}: draft_vocab must hold distinct token ids in [0, {vocab_size})")


def _head_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            raise SpecError(f"{path}: expected one .safetensors MTP head file in the folder, found {len(candidates)}")
        return candidates[0]
    if not path.exists():
        raise SpecError(f"MTP head {path} does not exist")
    return check_input_file(path, "MTP head")


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
                f"{source}: {name} has shape {tuple(tensor.shape)}, "
                f"the target's head needs {tuple(expected[name].shape)}"
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
        raise SpecError(f"{checkpoint}: the model config has num_nextn_predict_layers = 0 (no MTP layer); "
                        "pass --mtp PATH")
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
        weight_map = read_json(index, "checkpoint index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SpecError(f"{index}: 'weight_map' must map tensor names to shard file names")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if name.startswith(prefix):
                shards.setdefault(shard, []).append(name)
    elif (checkpoint / "model.safetensors").exists():
        try:
            with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
                shards = {"model.safetensors": [name for name in handle.keys() if name.startswith(prefix)]}
        except SafetensorError as error:
            raise SpecError(f"{checkpoint / 'model.safetensors'} is not a readable safetensors file "
                            f"({str(error).splitlines()[0]})") from None
    else:
        raise SpecError(f"{checkpoint}: no model.safetensors.index.json or model.safetensors found")
    result = {}
    for shard, names in shards.items():
        if Path(shard).name != shard or not (checkpoint / shard).is_file():
            raise SpecError(f"{checkpoint}: shard {shard!r} named by the index is missing")
        _, tensors = _read_safetensors(checkpoint / shard, names)
        result.update({name[len(prefix) :]: tensor for name, tensor in tensors.items()})
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
