"""Exports an sglang_spec MTP head as an SGLang draft-model folder (no sglang import: it only writes files).

``export_llama_draft`` writes what ``models.llama_nextn.LlamaForCausalLMNextN`` loads: the target's config with
the draft architecture and the head's feedback mode, the head's tensors under SGLang's names, the target's
tokenizer files, and, for a head with a reduced draft vocabulary, the token map SGLang takes as
``--speculative-token-map``. Nothing is approximated: SGLang then drafts with the reference decoder's arithmetic.

``export_deepseek_draft`` writes DeepSeek-V3/R1's own layout, what SGLang's ``DeepseekV3ForCausalLMNextN`` loads
for NEXTN: the target's config and one safetensors file holding the MTP layer as ``model.layers.{L}.*``
(L = num_hidden_layers; routed experts one by one, the embedding and output head copied from the target as in
the released checkpoints), plus the token map for a reduced draft vocabulary. Only the target's embedding and
output head are read (``models/target_shell.py``). SGLang's NextN feeds back the post-norm state, so only a head
trained with ``--feedback post_norm`` drafts there as it was trained.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_spec.errors import SpecError
from sglang_spec.files import atomic_path, write_text_atomic
from sglang_spec.models.target_shell import load_target_shell
from sglang_spec.mtp.checkpoint import (deepseek_mtp_state_dict, llama_draft_state_dict, load_mtp_head,
                                       read_mtp_header)

ARCHITECTURE = "LlamaForCausalLMNextN"
FEEDBACK_KEY = "sglang_spec_feedback"
TOKEN_MAP = "draft_vocab.pt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja")


@dataclass(frozen=True)
class DraftExport:
    """draft_dir: pass as ``--speculative-draft-model-path``; token_map: ``--speculative-token-map`` (None when
    the head drafts over the full vocabulary)."""

    draft_dir: Path
    token_map: Path | None

    def server_args(self) -> list[str]:
        arguments = ["--speculative-draft-model-path", str(self.draft_dir)]
        if self.token_map is not None:
            arguments += ["--speculative-token-map", str(self.token_map)]
        return arguments


def export_llama_draft(head_path: str | Path, target_dir: str | Path, out_dir: str | Path) -> DraftExport:
    """Writes the draft folder for the head file ``head_path`` trained for the Llama-family target in
    ``target_dir``. Re-exporting over an existing export replaces it."""
    head_path, target_dir, out_dir = Path(head_path), Path(target_dir), Path(out_dir)
    header = read_mtp_header(head_path)
    config = json.loads((target_dir / "config.json").read_text())
    if config.get("model_type") != "llama" or header.get("target_model_type") != "llama":
        raise SpecError(
            f"export_llama_draft serves Llama-family heads; {head_path.name} is for "
            f"{header.get('target_model_type')!r} and the target is {config.get('model_type')!r}"
        )
    if header["hidden_size"] != config["hidden_size"] or header["vocab_size"] != config["vocab_size"]:
        raise SpecError(f"{head_path.name} was trained for another target (hidden size / vocabulary differ)")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, draft_vocab = llama_draft_state_dict(head_path)
    # the draft shares the target's embedding and head (SGLang binds them); its own head is untied
    draft_config = {**config, "architectures": [ARCHITECTURE], "num_hidden_layers": 1, "tie_word_embeddings": False,
                    "torch_dtype": "float32", FEEDBACK_KEY: header["feedback"]}
    # each file replaced atomically (a server may be loading this folder while a second export rewrites it)
    with atomic_path(out_dir / "model.safetensors") as temporary:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(temporary))
    for name in _TOKENIZER_FILES:
        if (target_dir / name).exists():
            with atomic_path(out_dir / name) as temporary:
                shutil.copy(target_dir / name, temporary)
    token_map = None
    if draft_vocab is not None:
        token_map = out_dir / TOKEN_MAP
        with atomic_path(token_map) as temporary:
            torch.save(draft_vocab.to(torch.int64).tolist(), temporary)
    elif (out_dir / TOKEN_MAP).exists():
        (out_dir / TOKEN_MAP).unlink()
    write_text_atomic(out_dir / "config.json", json.dumps(draft_config, indent=1) + "\n")
    return DraftExport(out_dir, token_map)


def _write_token_map(out_dir: Path, draft_vocab: torch.Tensor | None) -> Path | None:
    """The reduced draft vocabulary as SGLang's token map (a list of target token ids), or none (a stale one from
    an earlier export removed)."""
    token_map = out_dir / TOKEN_MAP
    if draft_vocab is None:
        token_map.unlink(missing_ok=True)
        return None
    with atomic_path(token_map) as temporary:
        torch.save(draft_vocab.to(torch.int64).tolist(), temporary)
    return token_map


def export_deepseek_draft(head_path: str | Path, target_dir: str | Path, out_dir: str | Path) -> DraftExport:
    """Writes the NEXTN draft folder for the head file ``head_path`` trained for the DeepSeek-V3 target in
    ``target_dir`` (serve with ``DraftExport.server_args()``). Re-exporting over an existing export replaces it."""
    head_path, target_dir, out_dir = Path(head_path), Path(target_dir), Path(out_dir)
    header = read_mtp_header(head_path)
    config = json.loads((target_dir / "config.json").read_text())
    if config.get("model_type") != "deepseek_v3" or header.get("target_model_type") != "deepseek_v3":
        raise SpecError(f"export_deepseek_draft serves DeepSeek-V3 heads; {head_path.name} is for "
                        f"{header.get('target_model_type')!r} and the target is {config.get('model_type')!r}")
    if header["feedback"] != "post_norm":
        raise SpecError(f"{head_path.name} was trained with --feedback {header['feedback']}, but SGLang's DeepSeek "
                        f"NextN feeds back the post-norm state; train with --feedback post_norm")
    shell = load_target_shell(target_dir.name, target_dir)
    head = load_mtp_head(head_path, shell.model)
    tensors = deepseek_mtp_state_dict(head, shell.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.safetensors") as temporary:
        save_file({name: tensor.float().contiguous() for name, tensor in tensors.items()}, str(temporary))
    (out_dir / "model.safetensors.index.json").unlink(missing_ok=True)  # one file: no index
    for name in _TOKENIZER_FILES:
        if (target_dir / name).exists():
            with atomic_path(out_dir / name) as temporary:
                shutil.copy(target_dir / name, temporary)
    token_map = _write_token_map(out_dir, head.draft_vocab)
    write_text_atomic(out_dir / "config.json", json.dumps({**config, "torch_dtype": "float32"}, indent=1) + "\n")
    return DraftExport(out_dir, token_map)
