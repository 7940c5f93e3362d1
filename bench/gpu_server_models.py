"""The models the server groups serve on a lent GPU machine, built there from seeds: weights never travel, only
SmolLM2's tokenizer does (``bench/gpu_server_payload.py``).

    python bench/gpu_server_models.py --out DIR --tokenizer TOKENIZER_DIR          # every model, full size
    python bench/gpu_server_models.py --out DIR --tokenizer TOKENIZER_DIR --tiny   # the same code at toy widths

``MODELS`` (name -> what it is), each a folder of ``DIR`` that ``served_model`` turns into launch arguments:

* ``smollm2-random``: SmolLM2-135M's architecture and tokenizer (Llama, 30 layers of 576, 9 heads / 3 KV heads,
  vocabulary 49,152, tied embeddings) with seeded random weights, and a seeded random MTP head exported as its
  SGLang draft (``sglang_plugin/export.py``). Drafts are almost never accepted: the shapes, graphs and timings of
  SmolLM2, not acceptance.
* ``smollm2-random-k8``: the same architecture (``K8_OVERRIDES``: untied, wider initial weights), its output
  head zero except ``ACTIVE`` rows, four random directions and their negatives: for any hidden state the best of a
  pair is positive, so greedy decoding picks one of the eight tokens and a random head's draft (over the same
  head) is right about one time in four. What the identity checks serve: trees are accepted, so the accepted
  paths, commits and bonus tokens are exercised.
  Under a grammar the masked-in inactive tokens tie at logit 0 and both paths take the lowest id.
* ``tiny-deepseek-random``: the tiny DeepSeek-V3 (MLA, MoE, one NEXTN layer: ``models/tiny_deepseek.py``) with
  seeded random weights and a ``DEEPSEEK_VOCAB``-token vocabulary (a random MTP layer is accepted often), no
  tokenizer: requests carry token ids.

``--tiny`` keeps the vocabulary and tokenizer but shrinks the SmolLM2 variants to 2 layers of 64 (the dry run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "unk_token_id": 0, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 576, "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 8192,
    "mlp_bias": False, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "vocab_size": 49152, "dtype": "float32",
}
TINY_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}
# untied (the head is rewritten); initializer range 0.2: the layers' outputs outweigh the token embedding, so greedy
# answers vary with the context instead of repeating one token (0.02 repeats " and")
K8_OVERRIDES = {"tie_word_embeddings": False, "initializer_range": 0.2}
ACTIVE = 8  # output tokens of the k8 variant: ACTIVE // 2 directions and their negatives
ACTIVE_TEXT = (" the", " a", " of", " and", " to", " in", " is", " it")  # which tokens (readable answers)
DEEPSEEK_VOCAB = 16
MODELS = ("smollm2-random", "smollm2-random-k8", "tiny-deepseek-random")
SEED = 0
READY = ".built"  # written last into a model folder: what it was built with


def _random_llama(config: dict, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    return model


def active_head(model, token_ids: list[int], seed: int) -> None:
    """Zeroes ``model``'s (untied) output head but for ``token_ids``: directions r_i on the first half, -r_i on
    the second half, so one of each pair scores >= 0 for any hidden state."""
    import torch

    weight = model.lm_head.weight
    half = len(token_ids) // 2
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(half, weight.shape[1], generator=generator) * 0.1
    with torch.no_grad():
        weight.zero_()
        weight[token_ids[:half]] = directions.to(weight.dtype)
        weight[token_ids[half:2 * half]] = -directions.to(weight.dtype)


def active_token_ids(tokenizer_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in ACTIVE_TEXT]
    if any(len(one) != 1 for one in ids) or len({one[0] for one in ids}) != ACTIVE:
        raise ValueError(f"ACTIVE_TEXT must be {ACTIVE} distinct single tokens of this tokenizer, got {ids}")
    return [one[0] for one in ids]


def build_smollm2(out: Path, tokenizer_dir: Path, k8: bool, tiny: bool) -> Path:
    """A SmolLM2-architecture target in ``out`` with its draft in ``out``-sglang-draft (module doc)."""
    from sglang_spec.mtp.checkpoint import save_mtp_head
    from sglang_spec.mtp.head import MTPHead
    from sglang_spec.sglang_plugin.export import export_llama_draft

    config = {**SMOLLM2_CONFIG, **(TINY_WIDTHS if tiny else {}), **(K8_OVERRIDES if k8 else {})}
    model = _random_llama(config, SEED + k8)
    if k8:
        active_head(model, active_token_ids(tokenizer_dir), SEED + 10)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # the tokenizer's files only: ``tokenizer_dir`` may be a whole model folder (the dry run's SmolLM2), whose
    # config and weights would replace the ones just saved
    from gpu_server_payload import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(SEED + 20)
        head = MTPHead.for_target(model)
    head_path = out.parent / f"{out.name}-head.safetensors"
    save_mtp_head(head, head_path, metadata={"random": True})
    export_llama_draft(head_path, out, draft_dir(out))
    return out


def build_tiny_deepseek(out: Path) -> Path:
    from sglang_spec.models.tiny_deepseek import random_tiny_deepseek, save_tiny_deepseek

    model, head = random_tiny_deepseek(vocab_size=DEEPSEEK_VOCAB)
    return save_tiny_deepseek(out, model, head)


def draft_dir(target: Path) -> Path:
    return target.parent / f"{target.name}-sglang-draft"


def build(out: Path, tokenizer_dir: Path, tiny: bool = False, names: tuple[str, ...] = MODELS) -> dict[str, Path]:
    """Each of ``names`` built into ``out`` unless a folder built the same way is there; returns their folders."""
    built = {}
    for name in names:
        folder = out / name
        stamp = json.dumps({"tiny": tiny, "seed": SEED})
        if (folder / READY).exists() and (folder / READY).read_text() == stamp:
            built[name] = folder
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if name == "tiny-deepseek-random":
            build_tiny_deepseek(folder)
        else:
            build_smollm2(folder, tokenizer_dir, k8=name.endswith("k8"), tiny=tiny)
        (folder / READY).write_text(stamp)
        built[name] = folder
    return built


def served_model(name: str, root: Path):
    """``name``'s folder under ``root`` as the bed's ``CpuModel`` (target, draft arguments, profile, model
    arguments), which ``gpu_server_checks.launch_arguments`` turns into launch_server's arguments."""
    from sglang_spec.errors import SpecError
    from sglang_spec.models.loading import shipped_profile_path
    from sglang_spec_testbed.server import CpuModel

    if name not in MODELS:
        raise SpecError(f"unknown GPU model {name!r}; choose one of {', '.join(MODELS)}")
    folder = root / name
    if not (folder / READY).exists():
        raise SpecError(f"{folder} is not built: run python bench/gpu_server_models.py --out {root} (the "
                        "server_preflight check does)")
    profile = shipped_profile_path("smollm2")  # a prior over ranks for sequoia / hybrid; any profile serves
    if name == "tiny-deepseek-random":
        return CpuModel(name, folder, (), profile, model_args=("--skip-tokenizer-init",))
    draft = draft_dir(folder)
    return CpuModel(name, folder, ("--speculative-draft-model-path", str(draft)), profile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the model folders")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with SmolLM2's tokenizer files")
    parser.add_argument("--tiny", action="store_true", help="toy widths (the dry run)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    args = parser.parse_args(argv)
    names = tuple(name.strip() for name in args.models.split(",") if name.strip())
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        print(f"error: --models {args.models!r}: choose among {', '.join(MODELS)}", file=sys.stderr)
        return 2
    if not (args.tokenizer / "tokenizer.json").exists():
        print(f"error: --tokenizer {args.tokenizer} has no tokenizer.json", file=sys.stderr)
        return 2
    for name, folder in build(args.out, args.tokenizer, args.tiny, names).items():
        size = sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())
        print(f"{name}: {folder} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
