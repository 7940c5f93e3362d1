"""bench/copy_ceiling.py: the replay's arithmetic on hand-made sequences (each drafter against what it may and may not
copy), and the script end to end on tiny-deepseek's toy prompts."""

import json

import pytest

from sglang_spec.tree.ngram import NgramIndex


@pytest.fixture
def ceiling(bench_script):
    return bench_script("copy_ceiling")


def test_the_best_copy_copies_the_best_run_after_an_occurrence_of_the_last_token(ceiling):
    context = [1, 2, 3, 4, 9, 7, 2, 3, 4, 5, 6, 2]  # "2" ends it; 2 was followed by 3 4 9 and by 3 4 5 6
    assert ceiling.copy_run(context, [3, 4, 5, 6, 8], depth=11) == 4  # the second occurrence copies further
    assert ceiling.copy_run(context, [3, 4, 5, 6, 8], depth=3) == 3  # capped at the depth
    assert ceiling.copy_run(context, [3, 4], depth=11) == 2  # and at the output's end
    # negative controls: tokens the context holds, but never right after a "2", are not a copy
    assert ceiling.copy_run(context, [9, 7], depth=11) == 0
    assert ceiling.copy_run([1, 2, 3], [2, 3], depth=11) == 0  # the last token "3" never occurred before


def test_the_lookup_chain_takes_the_first_candidate_and_the_tree_any_of_the_first_few(ceiling):
    index = NgramIndex([5, 6, 9, 5, 7, 8, 5, 7, 1, 5])  # "5" alone matches: 7 followed it twice, 6 once
    assert ceiling.lookup_run(index, [7], depth=11, width=1) == 1
    assert ceiling.lookup_run(index, [6, 9], depth=11, width=1) == 0  # 6 is the second candidate: not in a chain
    assert ceiling.lookup_run(index, [6, 9], depth=11, width=2) == 2  # then "5 6" matches, and 9 followed it
    assert ceiling.lookup_run(index, [6, 9], depth=1, width=2) == 1
    assert ceiling.lookup_run(index, [4], depth=11, width=4) == 0  # never followed a 5


def test_replay_counts_steps_as_a_servers_accept_length_does(ceiling):
    output = list(range(100, 121))  # 21 tokens: the first is prefill's, 20 are left to the steps
    nothing = lambda index, future, depth: 0  # noqa: E731 (a plain decoding: one token a step)
    everything = lambda index, future, depth: min(depth, len(future))  # noqa: E731 (an oracle at the depth)
    assert ceiling.replay([1, 2], output, depth=4, draft=nothing) == 20
    assert ceiling.replay([1, 2], output, depth=4, draft=everything) == 4  # 5 tokens a step
    assert ceiling.replay([1, 2], output, depth=3, draft=everything) == 5
    assert ceiling.replay([1, 2], output[:1], depth=4, draft=everything) == 0


def test_a_copied_output_takes_fewer_steps_than_a_new_one_and_the_rows_add_up(ceiling):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    copied = [3, 4, 5, 6, 7, 8, 9, 10]  # the prompt again from "3"
    fresh = [40, 41, 42, 43, 44, 45, 46, 47]
    rows = ceiling.rows_for("w", [prompt + [2], prompt + [2]], [copied, fresh], depth=11, width=4)
    assert [row.drafter for row in rows] == list(ceiling.DRAFTERS)
    for row in rows:
        assert row.tokens == 14 and row.steps == 1 + 7
        assert row.per_prompt == [7.0, 1.0] and row.tokens_per_step == pytest.approx(14 / 8)


def test_quick_run_writes_every_drafter_and_a_table(ceiling, tiny, tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    assert ceiling.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["depth"] == 11 and report["max_new_tokens"] == 48
    assert [(row["workload"], row["drafter"]) for row in report["rows"]] == [("toy", name) for name in ceiling.DRAFTERS]
    by_drafter = {row["drafter"]: row for row in report["rows"]}
    # the toy prompts repeat themselves, so the model's output copies them and copying pays
    assert all(row["tokens_per_step"] > 1.5 for row in report["rows"]), report["rows"]
    assert all(row["tokens"] == 3 * 47 and len(row["per_prompt"]) == 3 for row in report["rows"])
    assert "| toy | best-copy |" in capsys.readouterr().out


def test_bad_options_are_one_line_before_a_model_loads(ceiling, tmp_path, capsys):
    for argv in (["--workloads", "code,prose"], ["--prompts", str(tmp_path / "none.jsonl")],
                 ["--prompts", __file__, "--workloads", "code"], ["--depth", "0"]):
        with pytest.raises(SystemExit) as raised:
            ceiling.parse_args(argv)
        assert raised.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: argument --"), lines
