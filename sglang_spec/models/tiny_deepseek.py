"""Tiny DeepSeek-V3-shaped models (MLA + MoE + one MTP layer), built from a config in code.

* ``build_tiny_deepseek``: random weights (seeded).
* ``tiny_deepseek_dir``: the model behind ``--model tiny-deepseek``: the same architecture trained for a few
  seconds on a seeded toy language, with its MTP layer distilled from it, built once and cached. A random model
  is a chaotic function that no one-layer head can predict; the toy-trained one gives real acceptance rates.

Checkpoints are written like DeepSeek-V3/R1's: the main model in one shard, the MTP layer under
``model.layers.{num_hidden_layers}.*`` in another, and a ``model.safetensors.index.json`` mapping both, so the MTP
loader is exercised exactly as on the real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_DEEPSEEK_CONFIG = dict(
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


def tiny_deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{**TINY_DEEPSEEK_CONFIG, **overrides})
    config._attn_implementation = "sdpa"
    return config


def build_tiny_deepseek(seed: int = 0, **overrides):
    """A DeepseekV3ForCausalLM with seeded random weights, float32, eval mode."""
    from transformers import DeepseekV3ForCausalLM

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
CACHE_NAME = "tiny-deepseek-v3-toy"
_COMPLETE = ".complete"


def save_tiny_deepseek(path: str | Path, model, head) -> Path:
    """Writes ``model`` and its MTP ``head`` as a DeepSeek-style sharded checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sglang_spec.mtp.checkpoint import deepseek_mtp_state_dict

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
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def train_tiny_deepseek(seed: int = 0, target_steps: int = 400, head_steps: int = 300, progress: bool = True):
    """Trains the tiny model on the toy language, then distils its MTP head (unrolled 3 steps) on the model's own
    greedy and sampled continuations plus toy text. Returns (model, head). About half a minute on 2 CPU cores."""
    from tqdm import tqdm

    from sglang_spec.decode.decoder import GenerationConfig, generate_plain
    from sglang_spec.models.toy_language import ToyLanguage
    from sglang_spec.mtp.head import MTPHead
    from sglang_spec.sampling import SamplingParams
    from sglang_spec.train.distill import teacher_batch, unrolled_loss

    language = ToyLanguage(TINY_DEEPSEEK_CONFIG["vocab_size"], seed=123 + seed)
    bar = tqdm(total=target_steps + head_steps, desc="building tiny-deepseek (once)", disable=not progress)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_tiny_deepseek(seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(target_steps):
            batch = language.sample(32, 48)
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bar.update()
            bar.set_postfix(target_loss=f"{loss.item():.3f}")
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        head = MTPHead.for_target(model)
        prompts = [language.sample(1, 4 + index % 8)[0].tolist() for index in range(64)]
        sequences = language.sample(64, 56).tolist()
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
            output = generate_plain(model, prompts, GenerationConfig(max_new_tokens=48, sampling=sampling, seed=seed))
            sequences += [prompt + request.tokens for prompt, request in zip(prompts, output.requests)]
        optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
        for _ in range(head_steps):
            rows = torch.randint(len(sequences), (16,))
            loss, metrics = unrolled_loss(head, teacher_batch(model, head, [sequences[row] for row in rows]), unroll=3)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bar.update()
            bar.set_postfix(head_top1=f"{metrics.top1[0]:.2f}")
    bar.close()
    head.eval()
    for parameter in head.parameters():
        parameter.requires_grad_(False)
    return model, head


def tiny_deepseek_dir(cache: Path | None = None, progress: bool = True) -> Path:
    """The toy-trained tiny DeepSeek-V3 checkpoint (with its MTP layer), built and cached on first use."""
    import shutil
    import tempfile

    from sglang_spec.models.cache_dir import cache_root

    target = (cache or cache_root()) / CACHE_NAME
    if (target / _COMPLETE).exists():
        complete_checkpoint_config(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    model, head = train_tiny_deepseek(progress=progress)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-deepseek-"))
    save_tiny_deepseek(scratch, model, head)
    (scratch / _COMPLETE).write_text("toy-trained tiny DeepSeek-V3 with a distilled MTP layer\n")
    if target.exists():
        shutil.rmtree(target)
    scratch.rename(target)
    return target
