"""``sglang_spec_testbed/split_heads.py``: a Llama folder padded with zero attention heads gives the original's
logits, its head counts split over 2 ranks; a padded head that contributed anything would be seen (negative
control). Through launch_server at ``--tp-size 2``: ``tests/sglang_server/test_planner_matrix.py`` (SmolLM2's
cells on two ranks serve ``smollm2-split`` and answer as the one-rank plain server of the original)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_spec.errors import SpecError
from sglang_spec_testbed.split_heads import WEIGHTS, pad_attention_heads, padded_head_counts


def tiny_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=8, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_zero_heads_leave_the_logits_and_split_over_two_ranks(tmp_path):
    source = tiny_llama(tmp_path / "source")
    padded = pad_attention_heads(source, tmp_path / "padded", key_value_heads=4)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(padded)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)  # 2 query heads a KV head, as before
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = logits(source, ids)
    torch.testing.assert_close(logits(padded, ids), expected, atol=1e-5, rtol=1e-5)
    # negative control: one appended head whose output reaches the residual stream changes the logits
    tensors = load_file(str(padded / WEIGHTS))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name][:, 6 * 8:] = 0.5
    tensors["model.layers.0.self_attn.v_proj.weight"][3 * 8:] = 0.5
    save_file(tensors, str(padded / WEIGHTS), metadata={"format": "pt"})
    assert not torch.allclose(logits(padded, ids), expected, atol=1e-3)


def test_the_original_heads_keep_their_rows_and_groups(tmp_path):
    source = tiny_llama(tmp_path / "source")
    padded = load_file(str(pad_attention_heads(source, tmp_path / "padded", key_value_heads=4) / WEIGHTS))
    original = load_file(str(source / WEIGHTS))
    q = padded["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q[:48], original["model.layers.1.self_attn.q_proj.weight"]) and not q[48:].any()
    o = padded["model.layers.1.self_attn.o_proj.weight"]
    assert o.shape == (48, 64) and torch.equal(o[:, :48], original["model.layers.1.self_attn.o_proj.weight"])
    assert padded["model.layers.1.self_attn.k_proj.weight"].shape == (32, 48)
    assert torch.equal(padded["model.layers.1.mlp.up_proj.weight"], original["model.layers.1.mlp.up_proj.weight"])


def test_uneven_groups_fewer_heads_and_other_models_are_refused(tmp_path):
    assert padded_head_counts(9, 3, 4) == 12
    with pytest.raises(ValueError, match="do not group evenly"):
        padded_head_counts(9, 2, 4)
    with pytest.raises(ValueError, match="would drop heads"):
        padded_head_counts(9, 3, 2)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "deepseek_v3"}')
    with pytest.raises(SpecError, match="pads a Llama folder"):
        pad_attention_heads(tmp_path / "other", tmp_path / "out", 4)
