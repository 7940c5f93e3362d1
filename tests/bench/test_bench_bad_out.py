"""Every bench script refuses an --out it cannot write before any work, in one line with status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["acceptance", "head_quality", "kernels", "serving_sweep", "sglang_trees",
                                    "verify_cost", "greedy_identity", "gpu_check", "hybrid", "limits",
                                    "cpu_step_profile", "hybrid_shapes", "copy_ceiling"])
def test_unwritable_out_is_one_line_and_status_2(script, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    result = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), "--out", str(blocker / "r.json")],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "a-file" in lines[0], result.stderr
    assert blocker.read_text() == "not a folder\n"


@pytest.mark.parametrize("script, option, value", [
    ("acceptance", "--budgets", "4,abc"), ("acceptance", "--temperatures", "0,nan"), ("acceptance", "--depths", "0"),
    ("sglang_trees", "--budgets", "16,,32"), ("sglang_trees", "--num-prompts", "99"),
    ("cpu_step_profile", "--concurrency", "1,17"), ("cpu_step_profile", "--configs", "plain,eagle"),
    ("hybrid_shapes", "--shapes", "15:x:3"), ("hybrid_shapes", "--max-new-tokens", "0"),
])
def test_bad_list_or_number_option_is_one_line_and_status_2(script, option, value):
    result = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), option, value],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: argument {option}:"), result.stderr
