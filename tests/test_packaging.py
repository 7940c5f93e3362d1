"""`pip install .` ships the Triton kernels as sglang_spec.kernels (never a bare `kernels`) and the data files."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_kernels_import_as_a_subpackage():
    import sglang_spec.kernels

    assert Path(sglang_spec.kernels.__file__).parent == REPO / "kernels"


@pytest.mark.slow
def test_wheel_contains_kernels_and_data(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sglang_spec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "sglang_spec/kernels/__init__.py" in names
    assert not any(name.startswith("kernels/") for name in names)
    assert "sglang_spec/data/profiles/sequoia_demo.json" in names
    assert any(name.endswith("entry_points.txt") for name in names)
