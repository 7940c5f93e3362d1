"""bench/mla_tree_verify.py (the ``mla`` group of scripts/gpu_check.sh) in its CPU form: the cascade through the
CPU twin of FlashInfer and the interpreted tree kernel, against float32 masked attention, the twin's own cascade
with the torch tree reference, and SGLang's Triton MLA tree verify kernel (interpreted) where sglang is installed;
without a GPU the full run says it cannot run here (exit 3, a skip in gpu_check)."""

import importlib.util
import json

import pytest
import torch


def test_tiny_run_agrees_with_every_reference(bench_script, tmp_path, capsys):
    script = bench_script("mla_tree_verify")
    out = tmp_path / "mla.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["passed"] and result["detail"].startswith("within")
    rows = result["equality"]
    assert {(row["page_size"], row["tree_tokens"]) for row in rows} == {(p, n) for p in (1, 4) for n in (1, 4, 8)}
    assert max(row["vs_reference"] for row in rows) < 1e-4 and max(row["vs_cpu_twin"] for row in rows) < 1e-4
    if importlib.util.find_spec("sglang") is not None:  # SGLang's kernel at page size 1 (token slots)
        assert [row["page_size"] for row in rows if "vs_sglang_triton" in row] == [1, 1, 1]
        assert max(row["vs_sglang_triton"] for row in rows if "vs_sglang_triton" in row) < 1e-4


def test_without_a_gpu_the_full_run_cannot_run_here(bench_script, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the real checks")
    assert bench_script("mla_tree_verify").main(["--out", str(tmp_path / "mla.json")]) == 3
    assert "no CUDA device" in capsys.readouterr().out
