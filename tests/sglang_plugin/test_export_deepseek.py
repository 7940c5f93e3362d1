"""``export_deepseek_draft``: a head in DeepSeek's own layout (``model.layers.{L}.*``), what SGLang's NEXTN loads.
Exporting the tiny DeepSeek-V3's own MTP layer gives back its checkpoint tensor for tensor, and only a head trained
with the post-norm feedback SGLang's NextN uses is exported. (Served:
tests/sglang_server/test_capture_from_server.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from sglang_spec.errors import SpecError
from sglang_spec.models.loading import load_head_for
from sglang_spec.mtp.checkpoint import save_mtp_head
from sglang_spec.sglang_plugin.export import TOKEN_MAP, export_deepseek_draft


def test_the_checkpoints_own_layer_exports_to_itself(tiny, tmp_path):
    loaded, _ = tiny
    head = load_head_for(loaded, None, feedback="post_norm")
    export = export_deepseek_draft(save_mtp_head(head, tmp_path / "own.safetensors"), loaded.path, tmp_path / "draft")
    assert export.server_args() == ["--speculative-draft-model-path", str(tmp_path / "draft")]
    weight_map = json.loads((loaded.path / "model.safetensors.index.json").read_text())["weight_map"]
    layer = f"model.layers.{loaded.model.config.num_hidden_layers}."
    expected = sorted(name for name in weight_map if name.startswith(layer))
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as exported:
        assert sorted(exported.keys()) == expected
        for name in expected:
            with safe_open(str(loaded.path / weight_map[name]), "pt") as original:
                assert torch.equal(exported.get_tensor(name), original.get_tensor(name).float()), name
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]


def test_a_reduced_vocabulary_becomes_a_token_map_and_pre_norm_is_refused(tiny, tmp_path):
    loaded, _ = tiny
    head = load_head_for(loaded, None, feedback="post_norm")
    head.draft_vocab = torch.arange(100, 164)
    head.refresh_draft_head()
    export = export_deepseek_draft(save_mtp_head(head, tmp_path / "small.safetensors"), loaded.path,
                                   tmp_path / "draft")
    assert export.token_map == tmp_path / "draft" / TOKEN_MAP
    assert torch.load(export.token_map) == list(range(100, 164))
    head.draft_vocab = None
    head.refresh_draft_head()
    assert export_deepseek_draft(save_mtp_head(head, tmp_path / "full.safetensors"), loaded.path,
                                 tmp_path / "draft").token_map is None
    assert not (tmp_path / "draft" / TOKEN_MAP).exists()  # the stale map of the earlier export is gone
    head.feedback = "pre_norm"
    with pytest.raises(SpecError, match="feeds back the post-norm state; train with --feedback post_norm"):
        export_deepseek_draft(save_mtp_head(head, tmp_path / "pre.safetensors"), loaded.path, tmp_path / "d2")
