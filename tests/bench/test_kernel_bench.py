import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def load_bench(monkeypatch):
    """bench/kernels.py imported the way the script runs (bench/ on the path, so `import harness` works)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_explains_itself_without_a_gpu(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the real sweep")
    assert load_bench(monkeypatch).main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


@pytest.mark.slow
def test_smoke_run_covers_every_op_and_writes_json(tmp_path, capsys, monkeypatch):
    out = tmp_path / "kernels.json"
    assert load_bench(monkeypatch).main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ops = {(row["op"], row["provider"]) for row in report["rows"]}
    for op in ["tree_metadata", "flashinfer_mask", "target_greedy", "target_sample", "accept_walk", "commit_kv", "step",
               "ngram_match", "lookup_trees"]:
        assert (op, "ours") in ops
    assert ("accept_walk", "sglang-triton") in ops and ("tree_metadata", "sglang-triton") in ops
    assert report["environment"]["torch"]
    assert "tree_metadata" in capsys.readouterr().out
