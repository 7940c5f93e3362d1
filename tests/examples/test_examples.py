import importlib.util
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]


def load(relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_sweep_dry_run_and_report(tmp_path, capsys):
    sweep = load("bench/serving_sweep.py", "serving_sweep")
    assert sweep.main(["--dry-run", "--policies", "chain,sequoia", "--budgets", "4", "--concurrency", "1,8",
                       "--acceptance-profile", "p.json"]) == 0
    out = capsys.readouterr().out
    assert "--speculative-tree-policy sequoia" in out and "--max-concurrency 8" in out
    assert "--speculative-acceptance-profile p.json" in out
    rows = [sweep.row_from_result(p, 4, c, {"output_throughput": 100.0 * c, "accept_length": 2.5,
                                            "mean_tpot_ms": 12.0}) for p in ("chain", "sequoia") for c in (1, 8)]
    sweep.write_csv_and_plot(rows, tmp_path / "sweep.csv")
    assert (tmp_path / "sweep.csv").read_text().splitlines()[0].startswith("policy,budget,concurrency")
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_serving_sweep_compares_sglangs_own_speculation_on_held_out_workloads(tmp_path, capsys):
    """SGLang's EAGLE chain, its topk-4 tree (as many draft tokens as ours) and its NGRAM are launched as a user
    would; the serving workloads and a user's own prompt file become datasets; ratios are over plain in the run."""
    sweep = load("bench/serving_sweep.py", "serving_sweep")
    assert sweep.main(["--dry-run", "--cpu-model", "smollm2", "--policies",
                       "sglang-chain,sglang-tree,sglang-ngram,hybrid,lookup,auto", "--budgets", "15",
                       "--concurrency", "1", "--workloads", "serving"]) == 0
    out = capsys.readouterr().out
    assert "--speculative-tree-policy hybrid --speculative-tree-budget 15 --speculative-tree-depth 15 " \
           "--speculative-tree-topk 4 --speculative-acceptance-profile" in out
    assert "--speculative-tree-topk 4 --speculative-acceptance-profile '<shipped profile>' " \
           "--speculative-tree-auto" in out
    assert "--speculative-tree-policy lookup --speculative-tree-budget 15 --speculative-tree-depth 15 " \
           "--speculative-acceptance-profile" in out
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in out
    assert "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16" in out
    assert "--speculative-algorithm NGRAM --speculative-num-draft-tokens 16" in out
    assert all(f"--dataset-path {name}.json" in out for name in ("code", "extraction", "chat"))
    chat = sweep.serving_questions("chat")
    code = sweep.serving_questions("code")
    assert len(chat) == len(set(chat)) == 32 and len(code) == len(set(code)) == 32 and "def " in code[0]
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "a", "domain": "support"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    args = sweep.parse_args(["--prompts", str(prompts)])
    datasets = sweep.workload_datasets(args, tmp_path)
    assert sorted(datasets) == ["general", "support"]  # a line without a domain is the prompt reader's "general"
    rows = [sweep.row_from_result(policy, 15, 4, {"output_throughput": speed}, "code")
            for policy, speed in (("plain", 10.0), ("sequoia", 13.0), ("sglang-chain", 12.0))]
    sweep.add_speedups(rows)
    assert [row["speedup_over_plain"] for row in rows] == [1.0, 1.3, 1.2] and rows[2]["budget"] == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    with pytest.raises(sweep.SpecError, match="line 1: a prompt line must be a JSON object"):
        sweep.workload_datasets(sweep.parse_args(["--prompts", str(bad)]), tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--policies", "plain,beam"], "unknown policy 'beam'"),
    (["--workloads", "heldout,code"], "give heldout, serving, or a comma list"),
    (["--prompts", "/nonexistent.jsonl"], "no such file"),
])
def test_serving_sweep_refuses_what_it_cannot_run(capsys, argv, message):
    sweep = load("bench/serving_sweep.py", "serving_sweep")
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert message in capsys.readouterr().err
