"""The plugin as SGLang loads it: discovery, hooks in place, options parsed and checked by SGLang's own parser."""

import argparse
import inspect
import re
import shlex
from pathlib import Path

import pytest

from sglang_spec.sglang_plugin import UnsupportedSGLangVersion, check_sglang_version
from sglang_spec.sglang_plugin.hooks import draft as draft_hooks
from sglang_spec.sglang_plugin.hooks import startup as hooks

pytestmark = pytest.mark.sglang


def hook_of(function):
    """The sglang_spec hook a HookRegistry wrapper calls (None when the function is not wrapped by us)."""
    closure = inspect.getclosurevars(function).nonlocals
    return closure.get("hook")


def test_load_plugins_discovers_the_entry_point_and_applies_our_hooks(sglang_with_plugin):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative import eagle_worker_v2, spec_utils

    assert any("sglang_spec" in (source.plugin_name or "") for hooks_ in HookRegistry._hooks.values()
               for _, _, source in hooks_ if source is not None)
    assert hook_of(spec_utils.select_top_k_tokens) is draft_hooks.select_top_k_tokens_around
    assert hook_of(eagle_worker_v2.EagleDraftWorker.draft_forward) is draft_hooks.draft_forward_around
    # stale `from ... import` bindings are patched too: the worker module calls our select
    assert eagle_worker_v2.select_top_k_tokens is spec_utils.select_top_k_tokens
    assert hook_of(ServerArgs.add_cli_args) is hooks.add_cli_args_after


def test_unsupported_sglang_versions_are_refused_with_a_clear_message():
    assert check_sglang_version("0.5.23") == "0.5.23"
    with pytest.raises(UnsupportedSGLangVersion, match="supports sglang 0.5.23, found 0.4.9"):
        check_sglang_version("0.4.9")


def parse(argv):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))


def test_sglangs_parser_accepts_the_tree_options(sglang_with_plugin, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text('{"rank_acceptance": [0.6, 0.2, 0.1]}')
    server_args = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "sequoia",
                         "--speculative-tree-budget", "12", "--speculative-tree-depth", "5",
                         "--speculative-tree-topk", "3", "--speculative-acceptance-profile", str(profile)])
    options = server_args._sglang_spec_tree
    assert (options.policy, options.budget, options.depth, options.topk) == ("sequoia", 12, 5, 3)
    assert (server_args.speculative_num_steps, server_args.speculative_eagle_topk,
            server_args.speculative_num_draft_tokens) == (5, 3, 13)
    chain = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "chain",
                   "--speculative-tree-depth", "3"])
    assert (chain.speculative_eagle_topk, chain.speculative_num_draft_tokens) == (1, 4)
    untouched = parse(["--speculative-algorithm", "NEXTN"])
    assert not hasattr(untouched, "_sglang_spec_tree") and untouched.speculative_num_steps is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-tree-policy", "sequoia"], "the sequoia policy needs an acceptance profile"),
        (["--speculative-tree-budget", "8"], "--speculative-tree-budget needs --speculative-tree-policy"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-budget", "40", "--speculative-tree-depth", "2",
          "--speculative-tree-topk", "3"], "only 12 candidate slots"),
        (["--speculative-tree-policy", "chain", "--speculative-tree-topk", "4"], "drafts one candidate per depth"),
        (["--speculative-tree-policy", "eagle", "--speculative-acceptance-profile", "/missing.json"],
         "does not exist"),
        (["--speculative-tree-policy", "eagle", "--speculative-num-steps", "7"],
         "--speculative-num-steps 7 contradicts the tree options"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-depth", "99"], "exceeds the maximum depth 64"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-width", "6"], "whose width is topk (4)"),
        (["--speculative-tree-policy", "specexec", "--speculative-tree-topk", "4", "--speculative-tree-width", "2"],
         "is below topk 4"),
        (["--speculative-tree-auto"], "--speculative-tree-auto needs --speculative-tree-policy"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-mtp-levels", "2"], "sets hybrid's head levels"),
        (["--speculative-tree-policy", "hybrid", "--speculative-tree-mtp-levels", "8"], "takes 0..7 (below the depth)"),
        (["--speculative-tree-policy", "hybrid", "--speculative-tree-depth", "1"],
         "hybrid trees need --speculative-tree-depth >= 2"),
        (["--speculative-tree-policy", "hybrid", "--speculative-tree-width", "3"], "is below topk 4"),
        (["--speculative-tree-policy", "hybrid", "--speculative-tree-budget", "7", "--speculative-tree-depth", "8"],
         "--speculative-tree-depth 8 is deeper than a tree of 7 draft tokens can be; lower the depth to 7"),
        (["--speculative-tree-policy", "lookup", "--speculative-tree-budget", "16", "--speculative-tree-depth", "3",
          "--speculative-tree-width", "4"], "raise it to 8 or lower the budget"),
        (["--speculative-tree-policy", "hybrid", "--speculative-tree-head-rest", "4"],
         "sets what --speculative-tree-auto chooses from; add --speculative-tree-auto"),
        (["--speculative-tree-policy", "hybrid", "--speculative-tree-auto", "--speculative-tree-head-rest", "-1"],
         "takes a number of plain steps >= 0"),
        (["--speculative-tree-policy", "lookup", "--speculative-tree-auto", "--speculative-tree-head-rest", "4"],
         "lookup trees never run the head; drop it"),
    ],
)
def test_bad_combinations_fail_with_one_line(sglang_with_plugin, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    text = str(exit_info.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text


def test_width_is_the_trees_widest_level_or_the_specexec_beams_that_can_grow(sglang_with_plugin):
    """SGLang's speculative_eagle_topk is the draft width W: topk for eagle, the Sequoia tree's widest level (here
    wider than topk), the most beams that can grow for specexec (exact SpecExec: 23 at 32/6/4, not the budget);
    topk stays the children per node."""
    from sglang_spec.models.loading import shipped_profile_path

    profile = str(shipped_profile_path("smollm2"))
    sequoia = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "sequoia",
                     "--speculative-tree-budget", "31", "--speculative-tree-depth", "6", "--speculative-tree-topk", "4",
                     "--speculative-acceptance-profile", profile])
    assert (sequoia._sglang_spec_tree.topk, sequoia._sglang_spec_tree.width,
            sequoia.speculative_eagle_topk) == (4, 5, 5)
    specexec = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "specexec",
                      "--speculative-tree-budget", "32", "--speculative-tree-depth", "6",
                      "--speculative-tree-topk", "4"])
    assert (specexec.speculative_eagle_topk, specexec.speculative_num_draft_tokens) == (23, 33)
    bounded = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "specexec",
                     "--speculative-tree-budget", "32", "--speculative-tree-width", "8"])
    assert bounded.speculative_eagle_topk == 8 and bounded._sglang_spec_tree.tree_policy().width == 8
    eagle = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "eagle",
                   "--speculative-tree-topk", "3"])
    assert eagle.speculative_eagle_topk == 3
    # lookup / hybrid: a node's children (the head's topk, hybrid, and the context's 2 continuations), at least
    # budget / (depth - 1) for SGLang's tree encoding; the overlap scheduler stays as the user set it (the context is
    # completed from the last verify where the output ids lag: committed.py)
    hybrid = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "hybrid",
                    "--speculative-tree-budget", "12", "--speculative-tree-depth", "5"])
    assert (hybrid.speculative_eagle_topk, hybrid.speculative_num_draft_tokens) == (6, 13)
    assert not hybrid.disable_overlap_schedule and hybrid._sglang_spec_tree.tree_policy().width == 6
    lookup = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "lookup",
                    "--speculative-tree-budget", "16", "--speculative-tree-depth", "3"])
    assert lookup.speculative_eagle_topk == 8
    auto = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "hybrid", "--speculative-tree-auto"])
    assert auto._sglang_spec_tree.auto and not hybrid._sglang_spec_tree.auto
    assert auto._sglang_spec_tree.head_rest is None  # the default: DEFAULT_HEAD_REST, off under DP attention
    rest = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "hybrid", "--speculative-tree-auto",
                  "--speculative-tree-head-rest", "0"])
    assert rest._sglang_spec_tree.head_rest == 0
    levels = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "hybrid",
                    "--speculative-tree-depth", "8", "--speculative-tree-mtp-levels", "3"])
    assert (levels._sglang_spec_tree.tree_policy().mtp_levels == 3
            and hybrid._sglang_spec_tree.tree_policy().mtp_levels == 2)
    # unset, a context tree's depth is its budget (copies run deep), a head tree's stays DEFAULTS' 4
    deep = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "hybrid",
                  "--speculative-tree-budget", "15"])
    # ... but SGLang drafts only its head rounds (2 levels + the step that holds them) and the steps its parent_list
    # needs (1 + ceil(14 / width)): the KV SGLang holds a request each step is width * steps, not width * depth
    width = deep.speculative_eagle_topk
    assert deep.speculative_num_steps == max(2 + 1, 1 + -(-14 // width)) < 15
    lookup = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "lookup"])
    lookup_steps = 1 + -(-7 // lookup.speculative_eagle_topk)
    assert (lookup._sglang_spec_tree.depth, lookup.speculative_num_steps) == (8, lookup_steps)
    assert parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "specexec",
                  "--speculative-tree-budget", "15"]).speculative_num_steps == 4


def test_unknown_policy_is_argparses_own_error(sglang_with_plugin, capsys):
    with pytest.raises(SystemExit):
        parse(["--speculative-tree-policy", "beam"])
    assert "invalid choice: 'beam'" in capsys.readouterr().err


class ResolvedView:
    def __init__(self, **values):
        self.__dict__.update(values)


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(speculative_algorithm="STANDALONE"), "needs --speculative-algorithm NEXTN or EAGLE"),
        (dict(speculative_eagle_topk=2, speculative_num_steps=2), "exceeds the 6 draft tokens"),
        (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle runs its own draft worker"),
        (dict(enable_dp_attention=True), "--speculative-tree-head-rest: under DP attention"),
    ],
)
def test_speculative_checks(config, message):
    from sglang_spec.errors import SpecError
    from sglang_spec.sglang_plugin.options import TreeServerOptions, validate_speculative

    options = TreeServerOptions("eagle", 10, 4, 4, 4, auto=True, head_rest=4)
    good = dict(speculative_algorithm="NEXTN", speculative_eagle_topk=4, speculative_num_steps=4,
                enable_multi_layer_eagle=False, enable_dp_attention=False)
    with pytest.raises(SpecError, match=message):
        validate_speculative(options, ResolvedView(**{**good, **config}))
    validate_speculative(options, ResolvedView(**good))  # the same options pass with a consistent configuration


def test_adaptive_steps_are_refused_as_requested_before_sglang_resolves(sglang_with_plugin):
    """SGLang quietly drops --speculative-adaptive for topk > 1 or NEXTN; a tree launch refuses it in one line
    whatever SGLang would make of it, before SGLang's own resolution runs."""
    from types import SimpleNamespace

    from sglang_spec.sglang_plugin.state import OPTIONS_ATTRIBUTE as ATTRIBUTE
    from sglang_spec.sglang_plugin.options import TreeServerOptions

    resolved = []
    for policy, topk in (("eagle", 4), ("chain", 1)):
        options = TreeServerOptions(policy, 4, 4, topk, topk)
        server_args = SimpleNamespace(**{ATTRIBUTE: options, "speculative_adaptive": True})
        with pytest.raises(hooks.StartupError, match="--speculative-adaptive changes the draft step count") as refused:
            hooks.handle_speculative_decoding_wrapper(server_args, resolved.append)
        assert "\n" not in str(refused.value)
    assert resolved == []  # refused before SGLang's resolution
    untouched = SimpleNamespace(speculative_adaptive=True)  # no tree options: SGLang's behaviour
    hooks.handle_speculative_decoding_wrapper(untouched, resolved.append)
    assert resolved == [untouched]


def test_dsa_models_are_refused_by_sglangs_own_detection(sglang_with_plugin, monkeypatch):
    """DeepSeek-V3.2 (index_topk in its config) is refused in one line where SGLang's capability checks run."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups import overrides

    from sglang_spec.sglang_plugin.state import OPTIONS_ATTRIBUTE as ATTRIBUTE
    from sglang_spec.sglang_plugin.options import TreeServerOptions

    def server_args_for(hf_config):
        monkeypatch.setattr(overrides, "model_config_of", lambda server_args: SimpleNamespace(hf_config=hf_config))
        return SimpleNamespace(**{ATTRIBUTE: TreeServerOptions("eagle", 8, 4, 4, 4)})

    v32 = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    assert hooks._is_dsa(server_args_for(v32))
    r1 = SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])  # same architecture, no sparse index
    assert not hooks._is_dsa(server_args_for(r1))
    server_args = server_args_for(v32)
    monkeypatch.setattr(overrides, "resolving_view",
                        lambda server_args: SimpleNamespace(device="cuda", attention_backend="fa3"))
    with pytest.raises(hooks.StartupError, match="DSA models .* cannot run tree speculation") as refused:
        hooks.capability_adjustments_wrapper(server_args, lambda args: None)
    assert "\n" not in str(refused.value)


def test_an_infeasible_sequoia_plan_is_refused_at_resolution(tmp_path):
    """Budget 31 / depth 6 / topk 4 with the shipped profile expands more than topk nodes on a level: SGLang's
    draft loop cannot hold it, which must surface as one line before any worker starts."""
    from sglang_spec.errors import SpecError
    from sglang_spec.models.loading import shipped_profile_path
    from sglang_spec.sglang_plugin.options import TreeServerOptions, validate_speculative

    options = TreeServerOptions("sequoia", 31, 6, 4, 4, str(shipped_profile_path("smollm2")))
    with pytest.raises(SpecError, match="SGLang's frontier holds 4"):
        validate_speculative(options, ResolvedView(speculative_algorithm="EAGLE", speculative_eagle_topk=4,
                                                   speculative_num_steps=6))


@pytest.mark.parametrize(
    "backends, is_mla, device, message",
    [
        (dict(attention_backend="flashinfer"), True, "cuda", "cannot run tree speculation for an MLA model"),
        (dict(attention_backend="fa3", decode_attention_backend="trtllm_mha"), False, "cuda",
         "decode-attention-backend trtllm_mha cannot run tree speculation for this model"),
        (dict(attention_backend="fa3", speculative_draft_attention_backend="flashmla"), True, "cuda",
         "speculative-draft-attention-backend flashmla"),
        (dict(attention_backend="torch_native"), False, "cpu", "on this CPU"),
    ],
)
def test_backend_checks_read_every_resolved_backend(backends, is_mla, device, message):
    from sglang_spec.errors import SpecError
    from sglang_spec.sglang_plugin.options import TreeServerOptions, validate_backends

    options = TreeServerOptions("eagle", 10, 4, 4, 4)
    with pytest.raises(SpecError, match=message):
        validate_backends(options, backends, is_mla, device)
    validate_backends(options, dict(attention_backend="fa3", decode_attention_backend=None), is_mla, "cuda")
    validate_backends(options, dict(attention_backend="intel_amx"), is_mla, "cpu")
    validate_backends(TreeServerOptions("chain", 3, 3, 1, 1), backends, is_mla, device)  # a chain needs no mask


def test_resolution_runs_inside_sglangs_pipeline(sglang_with_plugin, tiny):
    """A real ServerArgs resolution (CPU, offline, tiny DeepSeek config): the wrapped step rejects a budget the
    draft shape cannot produce, with our one line."""
    loaded, _ = tiny
    server_args = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "eagle",
                         "--speculative-tree-budget", "6", "--speculative-tree-depth", "2",
                         "--speculative-tree-topk", "2"])
    server_args.model_path = str(loaded.path)
    server_args.device = "cpu"
    server_args.skip_tokenizer_init = True
    server_args.speculative_num_draft_tokens = 8  # more verify tokens than topk 2 / depth 2 can draft
    server_args._sglang_spec_tree = type(server_args._sglang_spec_tree)("eagle", 7, 2, 2, 2)
    with pytest.raises(SystemExit) as exit_info:
        server_args.resolve_once()
    assert "exceeds the 6 draft tokens" in str(exit_info.value.code)


def test_engine_keywords_build_server_args_with_the_tree(sglang_with_plugin):
    """sgl.Engine builds its ServerArgs through Engine.server_args_class(**kwargs); the plugin points it at a
    factory that takes the tree keywords out and applies them as the CLI path does."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs

    server_args = Engine.server_args_class(model_path="dummy", speculative_algorithm="NEXTN",
                                           speculative_tree_policy="eagle", speculative_tree_budget=10,
                                           speculative_tree_depth=3, speculative_tree_topk=4)
    assert isinstance(server_args, ServerArgs)
    assert server_args._sglang_spec_tree.policy == "eagle"
    assert (server_args.speculative_num_steps, server_args.speculative_eagle_topk,
            server_args.speculative_num_draft_tokens) == (3, 4, 11)
    assert not hasattr(Engine.server_args_class(model_path="dummy"), "_sglang_spec_tree")
    with pytest.raises(SystemExit, match="error: --speculative-tree-depth needs --speculative-tree-policy"):
        Engine.server_args_class(model_path="dummy", speculative_tree_depth=3)
    with pytest.raises(SystemExit, match="takes a whole number"):
        Engine.server_args_class(model_path="dummy", speculative_tree_policy="eagle", speculative_tree_budget="8")


def test_a_hook_that_failed_to_apply_stops_a_tree_launch(sglang_with_plugin, monkeypatch):
    """HookRegistry logs a failed patch and carries on; with tree options that would silently serve SGLang's own
    tree, so resolution stops the launch instead."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_spec.sglang_plugin import HOOKS

    target = HOOKS[-1][0]
    monkeypatch.setattr(HookRegistry, "_patched", HookRegistry._patched - {target})
    server_args = parse(["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", "eagle"])
    with pytest.raises(SystemExit, match=f"could not hook {target}"):
        hooks.handle_speculative_decoding_wrapper(server_args, lambda args: None)


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.sh"))


def launch_command(script: Path) -> list[str]:
    """The arguments the script gives ``python -m sglang.launch_server`` (shell variables as placeholders)."""
    text = script.read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "sglang.launch_server" in line and not line.lstrip().startswith("#")]
    assert len(lines) == 1, f"{script.name}: expected one launch_server command"
    words = shlex.split(lines[0].split("sglang.launch_server", 1)[1])
    return [word for word in words if word != "$@"]


@pytest.mark.parametrize("script", EXAMPLES, ids=[script.name for script in EXAMPLES])
def test_example_scripts_pass_only_flags_the_server_has(sglang_with_plugin, script):
    """Every flag an example launch passes, and every --speculative-* flag its comments suggest, exists in
    SGLang's parser with the plugin's options added; the launch's arguments parse as given."""
    from sglang.srt.server_args import ServerArgs

    from sglang_spec.sglang_plugin.options import add_arguments

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    if "--speculative-tree-policy" not in parser._option_string_actions:
        add_arguments(parser)  # the plugin's hook did not add them (not loaded): add them as it would
    command = launch_command(script)
    mentioned = set(re.findall(r"--speculative-[a-z-]+", script.read_text()))
    flags = {word.split("=", 1)[0] for word in command if word.startswith("--")} | mentioned
    unknown = sorted(flag for flag in flags if flag not in parser._option_string_actions)
    assert not unknown, f"{script.name} passes flags the server does not have: {unknown}"
    parser.parse_args(command)  # values (choices, whole numbers) as argparse takes them
