"""FlashInfer for a lent GPU machine that has none (and cannot download it): the wheels, trimmed to travel.

    python bench/gpu_flashinfer_payload.py            # writes .whl/flashinfer_trim.zip and the apache-tvm-ffi wheel

Then, on the machine (the device tool's ``run`` with ``carry: [".whl"]``), before ``scripts/gpu_check.sh --group mla``:

    mkdir -p /tmp/site && (cd /tmp/site && python3 -m zipfile -e "$OLDPWD/.whl/flashinfer_trim.zip" . \\
        && python3 -m zipfile -e "$OLDPWD"/.whl/apache_tvm_ffi-*.whl .)
    export PYTHONPATH=/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=/usr/local/cuda

FlashInfer 0.7.2's wheel is 65 MB, more than the 64 MiB a call may carry with the checkout, and most of it is the
kernel sources of modules the MLA tree verify never builds. Kept: every ``.py`` (``import flashinfer`` imports most
of its modules), the metadata, the top level of ``data/csrc`` (the MLA and cascade sources are there) and the
headers the JIT compiles against (``data/include``, CUTLASS, CCCL, spdlog): about 33 MB zipped. On an H200
(2026-11-28, ``docs/gpu-validation.md``) FlashInfer built its FA3 MLA module from it in 19-24 s, then the cascade.
The machines' image runs Python 3.12, hence the cp312 tvm-ffi wheel.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLASHINFER = "flashinfer-python==0.7.2"
TVM_FFI = "apache-tvm-ffi==0.1.11"
DIST_INFO = "flashinfer_python-0.7.2.dist-info/"
HEADERS = ("flashinfer/data/include/", "flashinfer/data/cutlass/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def kept(name: str) -> bool:
    """Whether a member of FlashInfer's wheel travels (the module doc says which)."""
    if name.endswith("/RECORD"):  # lists the files left out; nothing reads it after unpacking
        return False
    return (name.endswith(".py") or name.startswith(DIST_INFO) or name.startswith(HEADERS)
            or (name.startswith("flashinfer/data/csrc/") and name.count("/") == 3)
            or (name.startswith("flashinfer/") and name.count("/") == 1))


def trim(wheel: Path, out: Path) -> int:
    """The kept members of ``wheel`` into the zip ``out``; returns how many."""
    count = 0
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for info in source.infolist():
            if kept(info.filename):
                target.writestr(info, source.read(info.filename))
                count += 1
    return count


def download(requirement: str, into: Path) -> Path:
    """One wheel for the machines' CPython 3.12 on x86-64, without its dependencies."""
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into), requirement],
                   check=True)
    name = requirement.split("==")[0].replace("-", "_")
    return next(into.glob(f"{name}-*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".whl", help="folder to write (git-ignored by default)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        flashinfer = download(FLASHINFER, Path(scratch))
        members = trim(flashinfer, args.out / "flashinfer_trim.zip")
        tvm_ffi = download(TVM_FFI, Path(scratch))
        (args.out / tvm_ffi.name).write_bytes(tvm_ffi.read_bytes())
    size = sum(path.stat().st_size for path in args.out.iterdir()) / 2**20
    print(f"{args.out}: flashinfer_trim.zip ({members} members) and {tvm_ffi.name}, {size:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
