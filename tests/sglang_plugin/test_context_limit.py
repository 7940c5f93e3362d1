"""A tree server at the end of its context: what it reserves (``TreeServerOptions.reserved_context``) and the
req_to_token rows it builds (``hooks.startup.req_to_token_headroom_around``).

SGLang sizes a request's req_to_token row to the context plus budget + 5 slots, and maps twice max(W * D, budget
+ 1) slots past the request's tokens every decode step: with the plugin's widths (specexec 15/4/4: W = 15, a
120-slot reserve) a request within ~110 positions of the context's end ran its row over (on this CPU the
scheduler died; a GPU kernel writes into the next row). Through the server: tests/sglang_server/
test_parity_under_load.py (the near-limit request, every policy).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_spec.sglang_plugin.hooks import startup as hooks
from sglang_spec.sglang_plugin.options import from_values
from sglang_spec.sglang_plugin.state import OPTIONS_ATTRIBUTE as ATTRIBUTE

pytestmark = pytest.mark.sglang


def options(policy: str = "specexec", depth: int = 4):
    return from_values({"speculative_tree_policy": policy, "speculative_tree_budget": 15,
                        "speculative_tree_depth": depth, "speculative_tree_topk": 4})


def test_nothing_is_reserved_where_the_positions_hold_the_tree():
    tree = options(depth=4)
    assert tree.reserved_context(512, 8192, sglang_reserved=60) == 0
    assert tree.reserved_context(8188, 8192, sglang_reserved=60) == 0  # the deepest node at 8188 + 4 - 1
    # a server at the model's full context: the tree's positions past it have no rotary entry
    assert tree.reserved_context(8192, 8192, sglang_reserved=60) == 60
    assert tree.reserved_context(512, None, sglang_reserved=60) == 60


def test_the_tokenizer_manager_of_a_tree_server_reserves_what_the_options_say():
    config = SimpleNamespace(max_position_embeddings=8192)
    manager = SimpleNamespace(server_args=SimpleNamespace(**{ATTRIBUTE: options()}), context_len=512,
                              model_config=SimpleNamespace(hf_text_config=config), num_reserved_tokens=60)
    hooks.tokenizer_manager_init_after(None, manager)
    assert manager.num_reserved_tokens == 0
    plain = SimpleNamespace(server_args=SimpleNamespace(), context_len=512,
                            model_config=SimpleNamespace(hf_text_config=config), num_reserved_tokens=60)
    hooks.tokenizer_manager_init_after(None, plain)
    assert plain.num_reserved_tokens == 60  # a server without tree options keeps SGLang's


def test_a_tree_servers_rows_hold_a_decode_steps_reserve(sglang_with_plugin, monkeypatch):
    from sglang.srt.mem_cache import allocation_sizing

    monkeypatch.setattr(allocation_sizing, "get_alloc_reserve_per_decode", lambda: 120)
    sglangs = lambda: 20  # noqa: E731 - SGLang's headroom for budget 15: budget + 5

    def build(configurator):
        return hooks.req_to_token_headroom_around(sglangs)

    tree = SimpleNamespace(server_args=SimpleNamespace(**{ATTRIBUTE: options()}))
    assert hooks.build_req_to_token_pool_around(build, tree) == 120
    assert hooks.build_req_to_token_pool_around(build, SimpleNamespace(server_args=SimpleNamespace())) == 20
    assert hooks.req_to_token_headroom_around(sglangs) == 20  # outside a tree server's pool build


def test_the_hooks_reach_sglangs_callers(sglang_with_plugin):
    """The headroom function is imported by name into the pool builder: the patch must reach that binding."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.mem_cache import allocation_sizing, kv_cache_configurator

    def hook_of(function):
        import inspect

        return inspect.getclosurevars(function).nonlocals.get("hook")

    assert hook_of(allocation_sizing.get_req_to_token_extra_context_len) is hooks.req_to_token_headroom_around
    assert kv_cache_configurator.get_req_to_token_extra_context_len is \
        allocation_sizing.get_req_to_token_extra_context_len
    assert hook_of(kv_cache_configurator.KVCacheConfigurator._build_req_to_token_pool) is \
        hooks.build_req_to_token_pool_around
    wrappers, layer = [], TokenizerManager.__init__  # another concern (adapt) hooks it too: each wrapper in turn
    while layer is not None:
        wrappers.append(hook_of(layer))
        layer = getattr(layer, "__wrapped__", None)
    assert hooks.tokenizer_manager_init_after in wrappers
