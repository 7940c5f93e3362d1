"""The SGLang back-end of ``--speculative-tree-mla-verify`` (``sglang_plugin/mla_tree_backend.py``) on the CPU twin
of FlashInfer, driven as SGLang's model runner drives it (metadata, then a layer's forward) with stand-in pools,
layers and batches: the eager verify, the CUDA-graph path's capture and replays (the same static buffers, each
replay re-planned), both mask layouts and page sizes, against one masked attention over prefix + tree; every
other mode goes to the wrapped back-end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import MLA_HEADS, MLA_LATENT, MLA_ROPE, paged_mla_batch, paged_mla_reference
from optional_packages import require_sglang
from sglang_spec.tree.encode_sglang import TreeMaskMode


class Mode:
    def __init__(self, verify: bool) -> None:
        self.verify = verify

    def is_target_verify(self) -> bool:
        return self.verify


class Pool:
    """An MLA pool of one layer: [slots, 1, L + R]; the verify writes the tree's rows through set_kv_buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.dtype, self.writes = buffer, buffer.dtype, 0

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.buffer

    def set_kv_buffer(self, layer, location, k, v) -> None:
        self.buffer[location.loc.long()] = k.reshape(-1, 1, self.buffer.shape[-1])
        self.writes += 1

    def set_mla_kv_buffer(self, layer, location, k_nope, k_rope) -> None:  # FlashInfer's form: latent, rope apart
        self.buffer[location.loc.long()] = torch.cat([k_nope, k_rope], dim=-1).reshape(-1, 1, self.buffer.shape[-1])
        self.writes += 1


class Base:
    """The wrapped back-end: records what reaches it."""

    prefill_attention_backend_str = decode_attention_backend_str = "intel_amx"
    forward_metadata = None
    verify_mask = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_forward_metadata(self, forward_batch) -> None:
        self.calls.append("init_forward_metadata")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False) -> None:
        self.calls.append("out_graph")

    def init_cuda_graph_state(self, max_bs, max_num_tokens) -> None:
        self.calls.append("init_cuda_graph_state")

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append("forward")
        return "base"


@pytest.fixture(scope="module")
def backend_module():
    require_sglang()
    from sglang_spec.sglang_plugin import mla_tree_backend

    return mla_tree_backend


def make_backend(module, monkeypatch, data, page_size, mask_mode):
    monkeypatch.setattr(module, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1))
    pool = Pool(data["kv_buffer"].clone())
    config = SimpleNamespace(context_len=data["req_to_token"].shape[1], num_attention_heads=MLA_HEADS,
                             kv_lora_rank=MLA_LATENT, qk_rope_head_dim=MLA_ROPE, scaling=data["scale"])
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=data["req_to_token"]),
                             token_to_kv_pool=pool, kv_index_translator=SimpleNamespace(needs_read_translate=False),
                             page_size=page_size, model_config=config, dtype=torch.float32)
    backend = module.MLATreeVerifyBackend(runner, Base())
    backend.mask_mode = mask_mode  # SGLang's choice on a GPU is FULL_MASK; this process is a CPU (QLEN_ONLY)
    return backend, pool


def verify_batch(data, tree_tokens, mask=None):
    batch = len(data["prefixes"])
    prefixes = torch.tensor(data["prefixes"], dtype=torch.int64)
    spec_info = SimpleNamespace(draft_token_num=tree_tokens, custom_mask=data["flat_mask"] if mask is None else mask,
                                tree_topk=2, ragged_verify_layout=None)
    return SimpleNamespace(forward_mode=Mode(True), spec_info=spec_info, batch_size=batch, seq_lens=prefixes,
                           seq_lens_cpu=prefixes.clone(), req_pool_indices=data["rows"],
                           out_cache_loc=data["tree_slots"], out_cache_loc_is_physical=False)


def layer_forward(backend, data, forward_batch, layer_id=0):
    """One layer as DeepSeek's intel_amx form calls it: q [T, H * (L + R)], k [T, 1, L + R] (the tree's rows)."""
    layer = SimpleNamespace(tp_q_head_num=MLA_HEADS, v_head_dim=MLA_LATENT, head_dim=MLA_LATENT + MLA_ROPE,
                            layer_id=layer_id, scaling=data["scale"])
    q = torch.cat([data["q_latent"], data["q_rope"]], dim=-1).reshape(len(data["tree_slots"]), -1)
    k = data["kv_buffer"][data["tree_slots"].long()]
    out = backend.forward(q, k, k[..., :MLA_LATENT], layer, forward_batch)
    return out.view(-1, MLA_HEADS, MLA_LATENT)


@pytest.mark.parametrize("mask_mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
@pytest.mark.parametrize("page_size", [1, 16])
def test_eager_verify_equals_full_masked_attention(backend_module, monkeypatch, mask_mode, page_size):
    data = paged_mla_batch(10 + page_size, 3, 5, page_size, mask_mode)
    tree_rows = data["kv_buffer"][data["tree_slots"].long()].clone()
    data["kv_buffer"][data["tree_slots"].long()] = 0.0  # the verify's own KV write must put them there
    backend, pool = make_backend(backend_module, monkeypatch, data, page_size, mask_mode)
    forward_batch = verify_batch(data, 5)
    backend.init_forward_metadata(forward_batch)
    data["kv_buffer"][data["tree_slots"].long()] = tree_rows
    out = layer_forward(backend, data, forward_batch)
    assert pool.writes == 1 and backend.base.calls == []
    assert torch.allclose(out, paged_mla_reference(data, 5), atol=1e-5, rtol=1e-4)
    assert backend.verify_forwards == 1
    again = layer_forward(backend, data, forward_batch, layer_id=1)  # a second layer: the same plan, not a new one
    assert torch.equal(again, out) and backend.wrapper.plans == 1 and backend.verify_forwards == 1


def test_the_flashinfer_form_of_the_call(backend_module, monkeypatch):
    """On a GPU DeepSeek calls FlashInfer's back-end with q_nope [T, H * L] and q_rope [T, H * R] apart, and the new
    latent rows as k [T, 1, L] + k_rope [T, 1, R] (set_mla_kv_buffer): the same attention."""
    mode = TreeMaskMode.FULL_MASK
    data = paged_mla_batch(60, 2, 5, 4, mode)
    tree_rows = data["kv_buffer"][data["tree_slots"].long()].clone()
    data["kv_buffer"][data["tree_slots"].long()] = 0.0
    backend, pool = make_backend(backend_module, monkeypatch, data, 4, mode)
    forward_batch = verify_batch(data, 5)
    backend.init_forward_metadata(forward_batch)
    layer = SimpleNamespace(tp_q_head_num=MLA_HEADS, v_head_dim=MLA_LATENT, head_dim=MLA_LATENT + MLA_ROPE,
                            layer_id=0, scaling=data["scale"])
    out = backend.forward(data["q_latent"].reshape(len(tree_rows), -1), tree_rows[..., :MLA_LATENT],
                          tree_rows[..., :MLA_LATENT], layer, forward_batch,
                          q_rope=data["q_rope"].reshape(len(tree_rows), -1), k_rope=tree_rows[..., MLA_LATENT:])
    data["kv_buffer"][data["tree_slots"].long()] = tree_rows
    assert pool.writes == 1
    assert torch.allclose(out.view(-1, MLA_HEADS, MLA_LATENT), paged_mla_reference(data, 5), atol=1e-5, rtol=1e-4)


def test_graph_capture_then_replays_reuse_the_static_buffers(backend_module, monkeypatch):
    """Capture at batch size 2, then two replays with other prefixes and trees: every tensor the captured kernels
    read keeps its address, and each replay's result is that replay's attention."""
    mode, tree_tokens, page_size = TreeMaskMode.FULL_MASK, 4, 4
    data = paged_mla_batch(20, 2, tree_tokens, page_size, mode)
    backend, _ = make_backend(backend_module, monkeypatch, data, page_size, mode)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    backend.init_forward_metadata_out_graph(verify_batch(data, tree_tokens), in_capture=True)
    captured = backend.verify_state
    addresses = [tensor.data_ptr() for tensor in (captured.plan.qo_indptr, captured.plan.kv_indptr,
                                                  captured.plan.kv_indices, captured.plan.kv_lens, captured.tree_mask,
                                                  captured.plan.mask_layout.start)]
    for seed in (21, 22):
        replay = paged_mla_batch(seed, 2, tree_tokens, page_size, mode)
        backend.req_to_token_pool.req_to_token.copy_(replay["req_to_token"])
        backend.token_to_kv_pool.buffer = replay["kv_buffer"].clone()
        backend.init_forward_metadata_out_graph(verify_batch(replay, tree_tokens))
        state = backend.verify_state
        assert [tensor.data_ptr() for tensor in (state.plan.qo_indptr, state.plan.kv_indptr, state.plan.kv_indices,
                                                 state.plan.kv_lens, state.tree_mask,
                                                 state.plan.mask_layout.start)] == addresses
        out = layer_forward(backend, replay, verify_batch(replay, tree_tokens))
        assert torch.allclose(out, paged_mla_reference(replay, tree_tokens), atol=1e-5, rtol=1e-4)
    assert state.wrapper is captured.wrapper and state.wrapper.plans == 3
    assert backend.base.calls == ["init_cuda_graph_state"]


def test_a_replay_padded_past_the_live_requests(backend_module, monkeypatch):
    """SGLang replays a graph captured for 3 requests with 2 live ones: the padding request has prefix length 1
    (the fill value), row 0 of the tables and no tree mask; the live requests' outputs are still theirs."""
    mode, tree_tokens = TreeMaskMode.FULL_MASK, 4
    live = paged_mla_batch(50, 2, tree_tokens, 1, mode)
    backend, _ = make_backend(backend_module, monkeypatch, live, 1, mode)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    padded = dict(live, prefixes=live["prefixes"] + [1], rows=torch.cat([live["rows"], live["rows"][:1] * 0]),
                  tree_slots=torch.cat([live["tree_slots"], torch.zeros(tree_tokens, dtype=torch.int32)]),
                  q_latent=torch.cat([live["q_latent"], torch.zeros(tree_tokens, MLA_HEADS, MLA_LATENT)]),
                  q_rope=torch.cat([live["q_rope"], torch.zeros(tree_tokens, MLA_HEADS, MLA_ROPE)]))
    backend.init_forward_metadata_out_graph(verify_batch(padded, tree_tokens), in_capture=True)
    backend.init_forward_metadata_out_graph(verify_batch(padded, tree_tokens))  # the mask covers 2 requests only
    out = layer_forward(backend, padded, verify_batch(padded, tree_tokens))
    expected = paged_mla_reference(live, tree_tokens)
    assert torch.allclose(out[: 2 * tree_tokens], expected, atol=1e-5, rtol=1e-4)


def test_a_wrong_mask_through_the_backend_is_noticed(backend_module, monkeypatch):
    mode = TreeMaskMode.QLEN_ONLY
    data = paged_mla_batch(30, 2, 6, 1, mode)
    backend, _ = make_backend(backend_module, monkeypatch, data, 1, mode)
    wrong = torch.ones_like(data["flat_mask"])  # every tree token sees every other one: not a tree mask
    forward_batch = verify_batch(data, 6, mask=wrong)
    backend.init_forward_metadata(forward_batch)
    out = layer_forward(backend, data, forward_batch)
    assert not torch.allclose(out, paged_mla_reference(data, 6), atol=1e-3)


def test_other_modes_go_to_the_wrapped_backend(backend_module, monkeypatch):
    data = paged_mla_batch(40, 1, 3, 1, TreeMaskMode.QLEN_ONLY)
    backend, _ = make_backend(backend_module, monkeypatch, data, 1, TreeMaskMode.QLEN_ONLY)
    decode = SimpleNamespace(forward_mode=Mode(False))
    backend.init_forward_metadata(decode)
    backend.init_forward_metadata_out_graph(decode)
    assert backend.forward(None, None, None, None, decode) == "base"
    assert backend.base.calls == ["init_forward_metadata", "out_graph", "forward"]
    assert backend.prefill_attention_backend_str == "intel_amx"  # the model dispatches on the base's name


def test_only_the_targets_backend_of_a_cascade_server_is_wrapped(backend_module):
    from sglang_spec.sglang_plugin.state import OPTIONS_ATTRIBUTE as ATTRIBUTE
    from sglang_spec.sglang_plugin.options import TreeServerOptions

    base = object()
    options = TreeServerOptions("eagle", 6, 3, 2, 2, mla_verify="flashinfer")
    draft = SimpleNamespace(server_args=SimpleNamespace(**{ATTRIBUTE: options}), is_draft_worker=True)
    assert backend_module.build_backend_after(base, model_runner=draft) is base
    plain = SimpleNamespace(server_args=SimpleNamespace(**{ATTRIBUTE: TreeServerOptions("eagle", 6, 3, 2, 2)}),
                            is_draft_worker=False)
    assert backend_module.build_backend_after(base, model_runner=plain) is base


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
@pytest.mark.parametrize("lengths", [[3, 2], [4, 3]])
def test_a_ragged_verify_replays_its_tiers_graph(backend_module, monkeypatch, mode, lengths):
    """SGLang's ragged verify graphs: a tier of 8 tokens captured over 4 request slots, then replayed by 2 live
    requests verifying the first 3 and 2 (or 4 and 3) of their 4 tree tokens (the runner's padding: 2 pad slots at
    the fill prefix sharing the 3 (or 1) tokens left: a slot may get none). Each real token's output is the dense
    verify's (its ancestors come first); a second tier with the same slot count keeps its own buffers. A layout
    without host lengths is refused (the plan would read them from the device)."""
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout, build_capture_verify_lens

    from sglang_spec.sglang_plugin.ragged_verify import FORWARD_ATTRIBUTE, RaggedVerify, compact_mask

    width, page_size, tiers = 4, 4, [4, 8, 16]
    live = paged_mla_batch(60, 2, width, page_size, mode)
    backend, _ = make_backend(backend_module, monkeypatch, live, page_size, mode)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)

    def slots_batch(layout, ragged=None, mask=None, slots=4):  # the runner's view: 4 request slots
        batch = verify_batch(dict(live, prefixes=live["prefixes"] + [1] * (slots - 2)), width, mask=mask)
        batch.batch_size = slots
        batch.req_pool_indices = torch.cat([live["rows"], torch.zeros(slots - 2, dtype=live["rows"].dtype)])
        batch.spec_info.ragged_verify_layout = layout
        if ragged is not None:
            setattr(batch.spec_info, FORWARD_ATTRIBUTE, ragged)
        return batch

    for tier in (8, 16):  # captures: every cell of the capture mask attends (no live requests yet)
        capture = RaggedVerifyLayout.from_verify_lens(
            verify_lens_cpu=build_capture_verify_lens(num_tokens=tier, num_slots=4, num_draft_tokens=width),
            device="cpu", grid=tiers)
        backend.init_forward_metadata_out_graph(slots_batch(capture), in_capture=True)
    assert set(backend.graph_buffers) == {("ragged", 8), ("ragged", 16)}

    ragged = RaggedVerify.of(lengths, width, "cpu")
    cut = compact_mask(live["flat_mask"], mode, live["prefixes"], width, lengths)
    layout = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lengths, device="cpu", grid=tiers,
                                                 graph_num_tokens_floor=8)
    replay = slots_batch(layout, ragged, cut)
    rows = ragged.rows
    pad = 8 - ragged.total
    replay.out_cache_loc = torch.cat([live["tree_slots"][rows], torch.zeros(pad, dtype=torch.int32)])
    backend.init_forward_metadata_out_graph(replay)
    assert backend.verify_state.wrapper is backend.graph_buffers[("ragged", 8)].wrapper
    assert backend.verify_state.plan.qo_indptr.tolist()[:3] == [0, lengths[0], sum(lengths)]
    padded = dict(live, tree_slots=replay.out_cache_loc,
                  q_latent=torch.cat([live["q_latent"][rows], torch.zeros(pad, MLA_HEADS, MLA_LATENT)]),
                  q_rope=torch.cat([live["q_rope"][rows], torch.zeros(pad, MLA_HEADS, MLA_ROPE)]))
    out = layer_forward(backend, padded, replay)
    assert torch.allclose(out[:ragged.total], paged_mla_reference(live, width)[rows], atol=1e-5, rtol=1e-4)

    unstaged = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lengths, device="cpu", grid=tiers)
    unstaged = type(unstaged)(**{**{f: getattr(unstaged, f) for f in unstaged.__struct_fields__},
                                 "verify_lens_cpu": None})
    with pytest.raises(ValueError, match="without host lengths"):
        backend.init_forward_metadata_out_graph(slots_batch(unstaged, ragged, cut))
