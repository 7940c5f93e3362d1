"""``harness.commit``: what a result says it was measured at."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import harness  # noqa: E402


def test_a_copy_whose_tracked_files_differ_from_its_commit_says_so(tmp_path, monkeypatch):
    """A GPU machine's copy carries the call's working tree with the session's first ``.git``: a result measured
    there must not name the older commit as if it were that code."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    copy = tmp_path / "copy"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(copy)], check=True)
    monkeypatch.setattr(harness, "REPO", copy)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=copy, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert harness.commit() == head
    (copy / "README.md").write_text("changed\n")
    assert harness.commit() == head + "+modified"
    subprocess.run(["git", "checkout", "-q", "README.md"], cwd=copy, check=True)
    (copy / "new_untracked_file.txt").write_text("runs/ outputs and the like do not count\n")
    assert harness.commit() == head
