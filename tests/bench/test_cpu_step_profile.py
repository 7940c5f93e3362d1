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
