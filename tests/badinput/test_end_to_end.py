"""A few reproductions from the issue exactly as a user types them: a new process through the console entry point,
raw bytes on the command line, exit status 2 and one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BOOT = Path(__file__).resolve().parents[2] / "sglang_spec" / "sglang_plugin" / "cpu" / "boot"


def run_cli(*args: str | bytes) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BOOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable.encode(), b"-m", b"sglang_spec.cli",
               *(arg if isinstance(arg, bytes) else arg.encode() for arg in args)]
    return subprocess.run(command, capture_output=True, env=env, timeout=300)


def assert_one_line(result: subprocess.CompletedProcess, message: bytes) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(b"error: "), result.stderr
    assert message in lines[0] and b"Traceback" not in result.stderr and result.stdout == b""


def test_a_prompt_of_raw_non_utf8_bytes(tiny):
    result = run_cli("generate", "--model", "tiny-deepseek", "--no-chat", "--prompt", b"ab\xff\xfe")
    assert_one_line(result, b"is not valid UTF-8")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_out_dev_full_force_keeps_the_device(tiny, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("abc\n")
    result = run_cli("traffic", "generate", "--model", "tiny-deepseek", "--prompts", str(prompts), "--out",
                     "/dev/full", "--force")
    assert_one_line(result, b"/dev/full is a device, not a regular file")
    assert Path("/dev/full").is_char_device()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]
