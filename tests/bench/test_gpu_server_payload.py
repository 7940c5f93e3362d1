"""``bench/gpu_server_payload.py``: what travels to a lent GPU machine for the server groups fits the 64 MiB a device
call carries with the checkout, and says which item grew; the trim, the unpacking and the manifest are what the
builder does. Where the wheels are cached the payload is built (offline) and held to the committed manifest;
elsewhere (CI: nothing is downloaded) the manifest's sizes are used."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GROWTH = 0.02  # a built item may differ from the manifest's record by this fraction before it must be re-recorded


@pytest.fixture
def payload(bench_script):
    return bench_script("gpu_server_payload")


def cached(payload) -> bool:
    cache = payload.wheel_cache()
    return (all(payload.cached_wheel(requirement, cache) for requirement in (payload.SGLANG, *payload.WHEELS))
            and importlib.util.find_spec("flashinfer") is not None)


def test_checkout_and_payload_fit_what_a_device_call_carries(payload, tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    recorded = json.loads(payload.MANIFEST.read_text())["items"]
    items = recorded
    if cached(payload):
        items = payload.build(tmp_path / "payload", offline=True)["items"]
        moved = {item: (size, recorded.get(item, 0)) for item, size in items.items()
                 if abs(size - recorded.get(item, 0)) > GROWTH * max(recorded.get(item, 0), 1)}
        assert not moved, (f"items differ from {payload.MANIFEST.name} (built, recorded): {moved}; re-record with "
                           "python bench/gpu_server_payload.py --record")
    problem = payload.over_limit(payload.checkout_bytes(), items, recorded)
    assert problem is None, problem


def test_the_manifest_records_the_wheels_the_builder_packs(payload):
    """A wheel added to WHEELS (or a version changed) without a new record fails here, not on the machine."""
    manifest = json.loads(payload.MANIFEST.read_text())
    recorded = {(payload._normal(name.split("-")[0]), name.split("-")[1]) for name in manifest["wheels"]}
    wanted = {(payload._normal(name), version) for name, version in (r.split("==") for r in payload.WHEELS)}
    assert recorded == wanted
    assert manifest["sglang_wheel"].startswith("sglang-0.5.23-cp312-")
    assert set(manifest["items"]) == set(payload.ITEMS)


def test_over_limit_names_the_item_that_grew(payload):
    mib = 2**20
    recorded = {"sglang_trim.zip": 14 * mib, "wheels": 18 * mib}
    assert payload.over_limit(20 * mib, recorded, recorded) is None
    grown = {"sglang_trim.zip": 14 * mib, "wheels": 31 * mib}
    assert payload.over_limit(20 * mib, grown, recorded) == (
        "checkout 20.0 MiB + payload 45.0 MiB = 65.0 MiB, over the 64 MiB a device call carries; "
        "grew: wheels +13.00 MiB")
    assert "largest item: wheels" in payload.over_limit(40 * mib, grown)


def test_the_trim_drops_rust_extensions_multimodal_gen_and_the_record(payload, tmp_path):
    members = {"sglang/__init__.py": True, "sglang/srt/server_args.py": True,
               "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so": False,
               "sglang/multimodal_gen/runtime/x.py": False, "sglang-0.5.23.dist-info/METADATA": True,
               "sglang-0.5.23.dist-info/RECORD": False, "sglang/kernels/jit/csrc/speculative/tree.cuh": True}
    wheel = tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in members:
            archive.writestr(name, "x")
    assert payload.trim_sglang(wheel, tmp_path / "trim.zip") == sum(members.values())
    assert sorted(zipfile.ZipFile(tmp_path / "trim.zip").namelist()) == sorted(n for n, kept in members.items() if kept)


def test_install_unpacks_every_item_and_names_a_missing_one(payload, tmp_path):
    folder = tmp_path / "payload"
    (folder / "wheels").mkdir(parents=True)
    for name, member in (("sglang_trim.zip", "sglang/__init__.py"),
                         ("flashinfer_headers.zip", "flashinfer/data/include/flashinfer/sampling.cuh"),
                         ("smollm2_tokenizer.zip", "tokenizer.json"),
                         ("wheels/dill-0.4.1-py3-none-any.whl", "dill/x.py")):
        with zipfile.ZipFile(folder / name, "w") as archive:
            archive.writestr(member, "x")
    site = tmp_path / "site"
    assert len(payload.install(folder, site)) == 4
    for path in ("sglang/__init__.py", "dill/x.py", "smollm2_tokenizer/tokenizer.json",
                 "flashinfer_headers/flashinfer/data/include/flashinfer/sampling.cuh"):
        assert (site / path).is_file(), path
    assert len(payload.install(folder, tmp_path / "dry", wheels=False)) == 3
    assert not (tmp_path / "dry" / "dill").exists()
    (folder / "flashinfer_headers.zip").unlink()
    with pytest.raises(payload.PayloadError, match="lacks flashinfer_headers.zip: build it"):
        payload.install(folder, site)


def test_an_offline_build_without_cached_wheels_is_one_line(payload, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SPEC_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(payload.PayloadError, match=r"wheels not in .*: run python bench/gpu_server_payload.py once"):
        payload.build(tmp_path / "payload", offline=True)


def test_the_payload_folder_is_ignored_so_it_travels_only_when_carried():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "-q", ".gpu-payload/wheels/x.whl"], cwd=REPO).returncode == 0
