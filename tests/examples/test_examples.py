import importlib.util
from pathlib import Path


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
