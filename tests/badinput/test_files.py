"""The atomic writer and the output-path check (``sglang_spec/files.py``): a failed or interrupted write never
leaves a truncated or missing file where a good one stood, never a temporary file, and never replaces a node that
is not a regular file."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_spec import files
from sglang_spec.errors import SpecError
from sglang_spec.files import atomic_write, check_output_path, parse_json, read_json, write_text_atomic


def listing(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_writes_replace_the_file_and_keep_its_permissions(tmp_path):
    target = tmp_path / "a.json"
    write_text_atomic(target, "one")
    assert target.read_text() == "one"
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()  # what open(path, "w") gives, not 0o600
    target.chmod(0o640)
    write_text_atomic(target, "two")
    assert target.read_text() == "two" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert listing(tmp_path) == ["a.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt(), OSError(errno.ENOSPC, "full")])
def test_a_failing_write_leaves_the_old_file_and_no_temporary(tmp_path, failure):
    target = tmp_path / "profile.json"
    target.write_text("good")
    expected = SpecError if isinstance(failure, OSError) else type(failure)
    with pytest.raises(expected):
        with atomic_write(target) as handle:
            handle.write("half of a new fi")
            raise failure
    assert target.read_text() == "good" and listing(tmp_path) == ["profile.json"]


def test_a_failing_fsync_or_rename_is_one_line_and_changes_nothing(tmp_path, monkeypatch):
    target = tmp_path / "head.safetensors"
    target.write_bytes(b"good")

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    for name in ("fsync", "replace"):
        with monkeypatch.context() as patch:
            patch.setattr(files.os, name, no_space)
            with pytest.raises(SpecError, match="No space left on device"):
                write_text_atomic(target, "new")
        assert target.read_bytes() == b"good" and listing(tmp_path) == ["head.safetensors"]


def test_non_regular_targets_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for path, kind in ((fifo, "a fifo"), (folder, "a directory")):
        with pytest.raises(SpecError, match=f"is {kind}, not a regular file"):
            write_text_atomic(path, "x")
        with pytest.raises(SpecError, match=f"is {kind}"):
            check_output_path(path, force=True)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and folder.is_dir() and listing(folder) == []
    assert listing(tmp_path) == ["fifo", "folder"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_dev_full_stays_a_device():
    with pytest.raises(SpecError, match="is a device"):
        write_text_atomic("/dev/full", "x")
    with pytest.raises(SpecError, match="is a device"):
        check_output_path("/dev/full", force=True)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_output_path_check(tmp_path):
    (tmp_path / "file").write_text("x")
    assert check_output_path(tmp_path / "new" / "deeper" / "out.json") == tmp_path / "new" / "deeper" / "out.json"
    assert not (tmp_path / "new").exists()  # creates nothing
    with pytest.raises(SpecError, match="exists; pass --force"):
        check_output_path(tmp_path / "file")
    check_output_path(tmp_path / "file", force=True)
    with pytest.raises(SpecError, match="is not a folder"):
        check_output_path(tmp_path / "file" / "out.json")
    with pytest.raises(SpecError, match="names no file"):
        check_output_path(tmp_path / "..")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SpecError, match="not writable"):
            check_output_path(locked / "out.json")


def test_a_killed_writer_leaves_the_old_file(tmp_path):
    """SIGKILL in the middle of a write (no clean-up can run): the target is still the old, complete file."""
    target = tmp_path / "traffic.jsonl"
    target.write_text("good\n")
    script = textwrap.dedent(f"""
        import os, sys, time
        from sglang_spec.files import atomic_write
        with atomic_write({str(target)!r}) as handle:
            handle.write("x" * 100000)
            handle.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "writing"
    process.kill()
    process.wait()
    assert target.read_text() == "good\n"
    leftovers = [name for name in listing(tmp_path) if name != "traffic.jsonl"]
    assert all(name.startswith(".traffic.jsonl.") and name.endswith(".tmp") for name in leftovers)


def test_sigterm_cleans_up_through_the_cli(tmp_path):
    """The CLI turns SIGTERM into an exception, so a terminated writer removes its temporary file."""
    target = tmp_path / "t.json"
    target.write_text("good")
    script = textwrap.dedent(f"""
        import os, signal, time
        import sglang_spec.cli.tree as tree_command
        from sglang_spec.cli import main
        from sglang_spec.files import atomic_write

        def run(args):
            with atomic_write({str(target)!r}) as handle:
                handle.write("partial")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            return 0

        tree_command.run = run  # what `tree` runs: a writer that is terminated mid-write
        raise SystemExit(main(["tree", "--policy", "chain", "--budget", "1", "--depth", "1"]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 143, result.stderr
    assert "terminated" in result.stderr and "Traceback" not in result.stderr
    assert target.read_text() == "good" and listing(tmp_path) == ["t.json"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | json_values.map(lambda value: json.dumps(value)[:-1]))
def test_parse_json_fails_only_with_a_one_line_value_error(text):
    try:
        parse_json(text)
    except ValueError as error:
        assert "\n" not in str(error)


def test_json_files_that_are_not_json(tmp_path):
    cases = {
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "digits.json": "[" + "9" * 5000 + "]",
        "binary.json": b"\xff\xfe{}",
        "empty.json": "",
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(SpecError) as error:
            read_json(path, "profile")
        assert "\n" not in str(error.value) and str(path) in str(error.value)
    with pytest.raises(SpecError, match="is a folder"):
        read_json(tmp_path, "profile")
