"""Loading targets and their heads: a model folder loaded for decoding, the heads and profiles shipped for built-in
models, and what ``--mtp`` names (an MTP head file or a DeepSeek checkpoint). Which folder a ``--model`` name
stands for is ``sglang_spec.catalog``'s business (the tiny DeepSeek is built by training, a layer above this one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sglang_spec.errors import SpecError
from sglang_spec.mtp.checkpoint import head_model, load_deepseek_mtp, load_mtp_head, read_mtp_header
from sglang_spec.mtp.head import MTPHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# the shipped heads for built-in models, and their calibrated profiles per sampling temperature (the SmolLM2 code
# head's carry per-source counts for lookup / hybrid trees too)
SHIPPED_HEADS = {
    "smollm2": "smollm2-135m-instruct.safetensors",
    "smollm2-generic": "smollm2-135m-instruct-generic.safetensors",
}
SHIPPED_PROFILES = {
    "smollm2": {0.0: "smollm2-135m-instruct.json", 0.7: "smollm2-135m-instruct-t0.7.json"},
    "smollm2-generic": {0.0: "smollm2-135m-instruct-generic.json", 0.7: "smollm2-135m-instruct-generic-t0.7.json"},
}


class ByteTokenizer:
    """For toy models without a tokenizer (tiny-deepseek): characters U+0000..U+00FF are tokens 2..257 and any other
    token id t is written as the private-use character U+E000 + t, so decode and encode round-trip every token
    sequence (traffic stores text). Other characters are encoded as their UTF-8 bytes."""

    eos_token_id = 1
    _PRIVATE = 0xE000

    def encode(self, text: str) -> list[int]:
        tokens = []
        for char in text:
            code = ord(char)
            if code < 256:
                tokens.append(2 + code)
            elif self._PRIVATE <= code < self._PRIVATE + 0x1000:
                tokens.append(code - self._PRIVATE)
            else:
                tokens.extend(2 + byte for byte in char.encode())
        return tokens

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(token - 2) if 2 <= token < 258 else chr(self._PRIVATE + token) for token in tokens)


@dataclass
class LoadedModel:
    """A target ready for decoding. ``chat``: prompts go through the tokenizer's chat template."""

    name: str
    path: Path
    model: PreTrainedModel
    tokenizer: Any  # a transformers tokenizer, or ByteTokenizer for toy models without one
    eos_token_ids: tuple[int, ...]
    chat: bool = False
    extra: dict = field(default_factory=dict)

    def encode_prompt(self, text: str, chat: bool | None = None) -> list[int]:
        use_chat = self.chat if chat is None else chat
        if use_chat:
            messages = [{"role": "user", "content": text}]
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer.encode(text))

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @property
    def context_length(self) -> int | None:
        """The most positions the target was built for (``max_position_embeddings``), None if it does not say."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None

    def check_lengths(self, prompt_lengths: list[int], max_new_tokens: int, option: str = "--max-new-tokens",
                      names: list[str] | None = None) -> None:
        """Refuses a prompt that fills the context, and ``max_new_tokens`` past the context after the longest
        prompt, in one line each."""
        context = self.context_length
        if context is None or not prompt_lengths:
            return
        longest = max(range(len(prompt_lengths)), key=lambda index: prompt_lengths[index])
        name = names[longest] if names is not None else f"prompt {longest}"
        if prompt_lengths[longest] >= context:
            raise SpecError(f"{name} has {prompt_lengths[longest]} tokens; {self.name}'s context holds {context}, "
                            f"so shorten it to at most {context - 1}")
        room = context - prompt_lengths[longest]
        if max_new_tokens > room:
            raise SpecError(f"{option} {max_new_tokens} runs past {self.name}'s context of {context} tokens after "
                            f"{name} ({prompt_lengths[longest]} tokens); use at most {room}")


def load_model_folder(label: str, path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Loads the transformers model folder ``path`` for decoding (sdpa attention, eval mode, no gradients);
    ``label`` names it in reports and picks its shipped head."""
    # transformers is the optional `models` extra and takes seconds to import: only loading a model pays for it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    # a DeepSeek checkpoint's MTP layer is "unexpected" to transformers (it builds no MTP); we load it ourselves,
    # and loading a local folder takes a second: no report, no progress bar
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as error:
        raise SpecError(f"cannot load model from {path}: {str(error).splitlines()[0]}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
        transformers_logging.enable_progress_bar()
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tokenizer, eos_ids, chat = load_tokenizer(path, model.config)
    return LoadedModel(label, path, model, tokenizer, eos_ids, chat=chat)


def load_tokenizer(path: Path, config: Any) -> tuple[Any, tuple[int, ...], bool]:
    """(tokenizer, end-of-sequence ids, whether prompts go through a chat template) of the model folder ``path``:
    its transformers tokenizer, or ``ByteTokenizer`` for a toy model without one. ``config``: the model config
    (its ``eos_token_id`` when the tokenizer names none)."""
    from transformers import AutoTokenizer

    has_tokenizer = any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else ByteTokenizer()
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    chat = has_tokenizer and bool(getattr(tokenizer, "chat_template", None))
    return tokenizer, eos_ids, chat


def shipped_head_path(model_name: str) -> Path | None:
    file = SHIPPED_HEADS.get(model_name)
    if file is None:
        return None
    resource = resources.files("sglang_spec.data").joinpath("heads", file)
    return Path(str(resource)) if resource.is_file() else None


def shipped_profile_path(model_name: str, temperature: float = 0.0) -> Path | None:
    """The shipped profile calibrated at the temperature closest to ``temperature``."""
    return _nearest_shipped_file(SHIPPED_PROFILES.get(model_name), temperature)


def _nearest_shipped_file(files: dict[float, str] | None, temperature: float) -> Path | None:
    """The file in data/profiles/ calibrated at the temperature closest to ``temperature`` (None: none shipped)."""
    if not files:
        return None
    file = files[min(files, key=lambda calibrated: abs(calibrated - temperature))]
    resource = resources.files("sglang_spec.data").joinpath("profiles", file)
    return Path(str(resource)) if resource.is_file() else None


def load_head_for(
    loaded: LoadedModel, mtp: str | Path | None, feedback: str = "pre_norm", allow_model_mismatch: bool = False
) -> MTPHead:
    """``--mtp``: an sglang_spec head file, or a DeepSeek checkpoint folder (its MTP layer). Without it: the
    model's own MTP layer (DeepSeek checkpoints) or the head shipped for a built-in model. A head file whose
    training metadata names another model is refused unless ``allow_model_mismatch``."""
    if mtp is not None:
        path = Path(mtp)
        if not path.exists():
            raise SpecError(f"MTP head {path} does not exist")
        if path.is_dir() and (path / "config.json").exists():
            return load_deepseek_mtp(path, loaded.model, feedback=feedback)
        trained_for = head_model(read_mtp_header(path))
        if trained_for is not None and trained_for != loaded.name and not allow_model_mismatch:
            raise SpecError(f"{path} was trained for {trained_for!r}, not {loaded.name!r}; pass "
                            f"--allow-model-mismatch to use it anyway")
        return load_mtp_head(path, loaded.model)
    if getattr(loaded.model.config, "num_nextn_predict_layers", 0):
        return load_deepseek_mtp(loaded.path, loaded.model, feedback=feedback)
    shipped = shipped_head_path(loaded.name)
    if shipped is not None:
        return load_mtp_head(shipped, loaded.model)
    raise SpecError(
        f"no MTP head for {loaded.name}: pass --mtp PATH (train one with `sglang-spec train`)"
    )
