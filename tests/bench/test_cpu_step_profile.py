"""bench/cpu_step_profile.py's arithmetic on scheduler records (the servers themselves take minutes: the script is
run by hand, its numbers are in docs/sglang-plugin.md)."""

import pytest


def record(mode: str, start: float, target: float = 0.0, draft: float = 0.0, batch: int = 2,
           target_modes=("TARGET_VERIFY",)) -> dict:
    return {"mode": mode, "batch": batch, "start": start, "run_s": 0.0, "target_s": target, "draft_s": draft,
            "target_modes": list(target_modes)}


def test_a_step_lasts_until_the_next_batch_starts_and_the_rest_is_overhead(bench_script):
    profile = bench_script("cpu_step_profile")
    batches = [record("EXTEND", 0.0, target=0.5), record("DECODE", 1.0, 0.2, 0.1, target_modes=["DECODE"]),
               record("DECODE", 1.5, 0.3, 0.1),
               record("DECODE", 2.1, 0.2, 0.1)]  # the last step has no period: timed over the first two
    answers = [{"meta_info": {"completion_tokens": 4}}, {"meta_info": {"completion_tokens": 4}}]
    row = profile.summarise("sequoia", 2, batches, answers)
    assert row["steps"] == 3 and row["timed_steps"] == 2 and row["other_batches"] == ["EXTEND"]
    assert row["decode_mode_steps"] == 1  # a cold (or plain decoding's) step: its target forward decoded
    assert row["step_ms"] == pytest.approx(550.0)
    assert row["target_ms"] == pytest.approx(250.0) and row["draft_ms"] == pytest.approx(100.0)
    assert row["overhead_ms"] == pytest.approx(200.0)
    assert row["tokens_per_step"] == pytest.approx(2.0)  # 2 x 3 tokens after the prefill's, over 3 steps
    assert row["ms_per_token"] == pytest.approx(275.0)


def test_auto_and_sync_servers_get_their_options_and_a_running_cap_for_sixteen(bench_script, tmp_path):
    profile = bench_script("cpu_step_profile")
    args = profile.parse_args(["--configs", "plain-sync,auto", "--concurrency", "1,16", "--depth", "8"])
    assert profile.tree_args("plain-sync", args, tmp_path) == ["--max-running-requests", "16",
                                                               "--disable-overlap-schedule"]
    auto = profile.tree_args("auto", args, tmp_path)
    assert auto[-1] == "--speculative-tree-auto" and auto[auto.index("--speculative-tree-policy") + 1] == "hybrid"
    # auto-sync: the same server with the overlap scheduler off, as plain-sync
    assert profile.tree_args("auto-sync", args, tmp_path) == auto + ["--disable-overlap-schedule"]
    assert profile.tree_args("plain", profile.parse_args(["--concurrency", "1,8"]), tmp_path) == []


def plan(batch: int, tokens: int, committed: list[int]) -> dict:
    return {"batch": batch, "tokens": tokens, "verify_tokens": [tokens] * batch, "committed": committed}


def test_tree_auto_steps_split_into_the_plans_plain_and_tree_steps(bench_script):
    profile = bench_script("cpu_step_profile")
    batches = [record("DECODE", 0.0, 0.05, 0.0), record("DECODE", 0.1, 0.12, 0.03),
               record("EXTEND", 0.3, 0.4), record("DECODE", 0.8, 0.06, 0.0),
               record("DECODE", 0.9, 0.1, 0.02)]  # the last step has no period: left out
    plans = [plan(2, 1, [1, 1]), plan(2, 6, [3, 2]), plan(2, 1, [1, 1]), plan(2, 6, [4, 1])]
    split = profile.split_by_kind(batches, plans)
    assert set(split) == {"plain", "tree"}
    plain, tree = split["plain"], split["tree"]
    assert plain["steps"] == 2 and tree["steps"] == 1
    assert plain["step_ms"] == pytest.approx(100.0)  # 0.1 s, 0.1 s
    assert plain["target_ms"] == pytest.approx(55.0) and plain["overhead_ms"] == pytest.approx(45.0)
    # a tree step's period runs to the next batch, the prefill after it included (as ``summarise`` times it)
    assert tree["step_ms"] == pytest.approx(200.0) and tree["draft_ms"] == pytest.approx(30.0)
    assert tree["tokens_per_step"] == 5 and tree["verify_tokens_per_step"] == 12
    assert tree["tokens_per_second"] == pytest.approx(25.0)


def test_steps_the_planner_did_not_log_one_for_one_are_not_split(bench_script):
    profile = bench_script("cpu_step_profile")
    batches = [record("DECODE", 0.0), record("DECODE", 0.1), record("DECODE", 0.2)]
    assert profile.split_by_kind(batches, [plan(2, 1, [1, 1])] * 3)  # the control: one line a step
    assert profile.split_by_kind(batches, [plan(2, 1, [1, 1])] * 2) == {}  # a step missing from the log
    assert profile.split_by_kind(batches, [plan(3, 1, [1, 1, 1])] * 3) == {}  # another batch's lines
    assert profile.split_by_kind(batches, []) == {}  # plain decoding: no planner


def test_speedups_are_over_plain_decoding_in_the_overlap_loop_where_it_ran_else_without_it(bench_script):
    profile = bench_script("cpu_step_profile")

    def rows():
        return [{"config": config, "concurrency": 4, "ms_per_token": ms}
                for config, ms in (("plain", 20.0), ("plain-sync", 16.0), ("auto-sync", 10.0))]

    outputs = {"plain": {4: [[1, 2]]}, "plain-sync": {4: [[1, 2]]}, "auto-sync": {4: [[1, 3]]}}
    both = rows()
    profile.compare_to_plain(both, outputs)
    assert both[2]["speedup"] == pytest.approx(2.0) and both[2]["greedy_identical"] is False
    assert both[1]["greedy_identical"] is True
    alone = rows()[1:]
    profile.compare_to_plain(alone, {name: outputs[name] for name in ("plain-sync", "auto-sync")})
    assert alone[1]["speedup"] == pytest.approx(1.6) and "greedy_identical" not in alone[0]
    none = rows()[2:]
    profile.compare_to_plain(none, {"auto-sync": outputs["auto-sync"]})
    assert "speedup" not in none[0] and "greedy_identical" not in none[0]


def test_a_plan_kinds_bound_is_its_verify_and_a_plain_steps_other_work(bench_script):
    """A tree step of 100 ms (target 60, draft 30, other 10) committing 6 tokens, against plain decoding at 4
    requests (50 ms a step: target 48, other 2; 12.5 ms a token): 60 tokens/s over 80 is 0.75x, and the same step
    with its drafting free and a plain step's 2 ms of other work (62 ms) would be 6 / 62 ms: 1.21x."""
    profile = bench_script("cpu_step_profile")
    tree = {"steps": 3, "step_ms": 100.0, "target_ms": 60.0, "draft_ms": 30.0, "overhead_ms": 10.0,
            "tokens_per_step": 6.0, "verify_tokens_per_step": 12.0, "tokens_per_second": 60.0}
    plain = {"config": "plain-sync", "concurrency": 4, "ms_per_token": 12.5, "step_ms": 50.0, "target_ms": 48.0,
             "draft_ms": 0.0, "overhead_ms": 2.0}
    auto = {"config": "auto-sync", "concurrency": 4, "ms_per_token": 16.0, "by_kind": {"tree": dict(tree)}}
    profile.compare_to_plain([plain, auto], {"plain-sync": {4: [[1]]}, "auto-sync": {4: [[1]]}})
    bound = auto["by_kind"]["tree"]
    assert bound["x_plain"] == pytest.approx(0.75)
    assert bound["free_drafting_x_plain"] == pytest.approx(6 / 0.062 / 80)
    lone = {"config": "auto-sync", "concurrency": 4, "ms_per_token": 16.0, "by_kind": {"tree": dict(tree)}}
    profile.compare_to_plain([lone], {"auto-sync": {4: [[1]]}})  # no plain server ran: no ratios
    assert "x_plain" not in lone["by_kind"]["tree"]
