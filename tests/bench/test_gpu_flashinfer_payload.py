"""``bench/gpu_flashinfer_payload.py``: which members of FlashInfer's wheel travel to a GPU machine."""

import importlib.util
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("gpu_flashinfer_payload",
                                                  REPO / "bench" / "gpu_flashinfer_payload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trim_keeps_python_metadata_headers_and_the_top_level_sources(tmp_path):
    payload = load()
    wheel = tmp_path / "flashinfer_python-0.7.2-py3-none-any.whl"
    members = {
        "flashinfer/__init__.py": True, "flashinfer/experimental/x/kernel.py": True,
        "flashinfer/experimental/x/kernel_src.cu": False, "flashinfer/fused_moe/backends/big.cubin": False,
        "flashinfer/data/csrc/batch_mla_sm90_run.cu": True, "flashinfer/data/csrc/cascade.cu": True,
        "flashinfer/data/csrc/cake_dsv4/sm_120a/huge.cu": False, "flashinfer/data/include/flashinfer/mla.cuh": True,
        "flashinfer/data/cutlass/include/cute/tensor.hpp": True, "flashinfer/version.txt": True,
        "flashinfer_python-0.7.2.dist-info/METADATA": True, "flashinfer_python-0.7.2.dist-info/RECORD": False,
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in members:
            archive.writestr(name, "x")
    out = tmp_path / "trim.zip"
    assert payload.trim(wheel, out) == sum(members.values())
    assert sorted(zipfile.ZipFile(out).namelist()) == sorted(name for name, keep in members.items() if keep)
