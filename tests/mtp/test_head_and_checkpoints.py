import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_spec.errors import SpecError
from sglang_spec.models.tiny_deepseek import MTP_SHARD, save_tiny_deepseek
from sglang_spec.mtp.checkpoint import (
    deepseek_mtp_state_dict,
    load_deepseek_mtp,
    load_mtp_head,
    read_mtp_header,
    save_mtp_head,
)
from sglang_spec.mtp.head import MTPHead


def test_forward_is_deepseeks_layout_with_the_embedding_first(random_tiny):
    model, head = random_tiny
    tokens = torch.tensor([[5, 9, 11]])
    previous = torch.randn(1, 3, model.config.hidden_size)
    positions = torch.arange(3)[None]
    output = head(tokens, previous, positions, None, None)
    embedded = head.enorm(model.get_input_embeddings()(tokens))
    fused = head.eh_proj(torch.cat([embedded, head.hnorm(previous)], dim=-1))
    block = head.block(fused, position_ids=positions, position_embeddings=head.rotary_emb(fused, positions))
    expected_logits = model.get_output_embeddings()(head.shared_head_norm(block))
    assert torch.allclose(output.logits, expected_logits, atol=1e-5)
    assert torch.allclose(output.hidden, block, atol=1e-6)  # pre-norm feedback by default
    swapped = head.eh_proj(torch.cat([head.hnorm(previous), embedded], dim=-1))
    assert not torch.allclose(fused, swapped)
    # MLA + MoE block like the target's MoE layers; shared embedding and head are not the head's parameters
    assert type(head.block) is type(model.model.layers[-1]) and hasattr(head.block.mlp, "experts")
    assert not any(name.startswith(("embed", "lm_head")) for name in head.state_dict())


def test_round_trip_through_deepseeks_weight_names(random_tiny, tmp_path):
    model, head = random_tiny
    save_tiny_deepseek(tmp_path / "ckpt", model, head)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]
    layer = model.config.num_hidden_layers
    names = [name for name in index if name.startswith(f"model.layers.{layer}.")]
    assert index[f"model.layers.{layer}.eh_proj.weight"] == MTP_SHARD
    assert f"model.layers.{layer}.mlp.experts.3.gate_proj.weight" in names
    assert (f"model.layers.{layer}.shared_head.head.weight" in names
            and f"model.layers.{layer}.embed_tokens.weight" in names)
    loaded = load_deepseek_mtp(tmp_path / "ckpt", model)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    # and back out again: identical DeepSeek tensors
    again = deepseek_mtp_state_dict(loaded, model)
    original = deepseek_mtp_state_dict(head, model)
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in again)


def test_fp8_weights_are_dequantised_with_their_block_scales(random_tiny, tmp_path):
    model, head = random_tiny
    checkpoint = save_tiny_deepseek(tmp_path / "ckpt", model, head)
    layer = model.config.num_hidden_layers
    with safe_open(str(checkpoint / MTP_SHARD), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    name = f"model.layers.{layer}.eh_proj.weight"
    weight = tensors[name]  # [64, 128]: one block row, one block column
    scale = torch.tensor([[0.01]])
    quantised = (weight / 0.01).to(torch.float8_e4m3fn)
    tensors[name] = quantised
    tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(checkpoint / MTP_SHARD))
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name + "_scale_inv"] = MTP_SHARD
    index_path.write_text(json.dumps(index))
    loaded = load_deepseek_mtp(checkpoint, model)
    assert torch.equal(loaded.eh_proj.weight, quantised.float() * 0.01)
    assert torch.allclose(loaded.eh_proj.weight, weight, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


def test_our_format_round_trips_and_carries_its_metadata(random_tiny, tmp_path):
    model, head = random_tiny
    path = save_mtp_head(head, tmp_path / "head.safetensors", metadata={"trained_on": "nothing"})
    header = read_mtp_header(path)
    assert header["target_model_type"] == "deepseek_v3" and header["metadata"] == {"trained_on": "nothing"}
    loaded = load_mtp_head(path, model)
    assert all(torch.equal(tensor, loaded.state_dict()[name]) for name, tensor in head.state_dict().items())


def test_reduced_draft_vocabulary_maps_back_to_target_ids(random_tiny, tmp_path):
    model, _ = random_tiny
    vocab = torch.tensor([7, 3, 100, 42, 9])
    head = MTPHead.for_target(model, draft_vocab=vocab)
    output = head(torch.tensor([[5]]), torch.randn(1, 1, 64), torch.tensor([[0]]), None, None)
    assert output.logits.shape[-1] == 5
    assert head.to_full_vocab(torch.tensor([0, 3])).tolist() == [7, 42]
    loaded = load_mtp_head(save_mtp_head(head, tmp_path / "h.safetensors"), model)
    assert loaded.draft_vocab.tolist() == vocab.tolist() and loaded.draft_vocab_size == 5


def test_bad_heads_and_checkpoints_get_one_clear_line(random_tiny, tmp_path):
    model, head = random_tiny
    with pytest.raises(SpecError, match="has no MTP weights"):
        model.save_pretrained(tmp_path / "plain")
        load_deepseek_mtp(tmp_path / "plain", model)
    other = type(model)(type(model.config)(**{**model.config.to_dict(), "hidden_size": 32, "vocab_size": 100}))
    path = save_mtp_head(MTPHead.for_target(other), tmp_path / "other.safetensors")
    with pytest.raises(SpecError, match="hidden size 32 does not match the target's 64") as error:
        load_mtp_head(path, model)
    assert "\n" not in str(error.value)
    with pytest.raises(SpecError, match="does not exist"):
        load_mtp_head(tmp_path / "missing.safetensors", model)
    not_a_head = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(1)}, str(not_a_head))
    with pytest.raises(SpecError, match="not an sglang_spec MTP head"):
        load_mtp_head(not_a_head, model)
