"""`pip install .` ships the Triton kernels as sglang_spec.kernels (never a bare `kernels`) and the data files."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_kernels_import_as_a_subpackage():
    import sglang_spec.kernels

    assert Path(sglang_spec.kernels.__file__).parent == REPO / "sglang_spec" / "kernels"


@pytest.mark.slow
def test_wheel_contains_kernels_and_data(tmp_path):
    # build from a copy: an in-place build leaves build/ and *.egg-info in the checkout, and a stale egg-info
    # there shadows the installed package's metadata (its entry points) for anything run from the repo root
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "sglang_spec", source / "sglang_spec", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sglang_spec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "sglang_spec/kernels/__init__.py" in names
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "sglang_spec").rglob("*.py")}
    assert not modules - names, sorted(modules - names)  # every module ships (a folder without __init__.py would not)
    assert not any(name.startswith("kernels/") for name in names)
    assert "sglang_spec/data/profiles/sequoia_demo.json" in names
    from sglang_spec.models.loading import SHIPPED_HEADS, SHIPPED_PROFILES

    for file in SHIPPED_HEADS.values():  # the shipped heads and their profiles install with the package
        assert f"sglang_spec/data/heads/{file}" in names
    for files in SHIPPED_PROFILES.values():
        assert {f"sglang_spec/data/profiles/{file}" for file in files.values()} <= names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[sglang.srt.plugins]" in entry_points and "sglang_spec.sglang_plugin:register" in entry_points
