"""The first check of every server group of ``scripts/gpu_check.sh``: what would keep SGLang's server from running
on this machine, one line each, before any server starts; the group's other checks run only when it passed.

    python bench/gpu_server_preflight.py --out FILE --group server      # on the GPU machine
    python bench/gpu_server_preflight.py --out FILE --group server --dry-run   # on a CPU (CI)

On a GPU (in order; each step's failures are gaps, and the steps after a failed step still run when they can):

1. the payload (``bench/gpu_server_payload.py``, carried as ``.gpu-payload``) unpacked into ``SITE`` unless
   sglang 0.5.23 is installed;
2. the group's models built from seeds into ``MODELS_DIR`` (``bench/gpu_server_models.py``);
3. in a fresh process set up as a server's (``cuda_host.environment``: the CUDA-mode ``sgl_kernel`` stand-in
   installed by ``boot_cuda/sitecustomize.py``): every module of ``SERVER_MODULES`` imported (import gaps), the
   ``sgl_kernel`` names they asked for (one absent is a gap unless a probe of SGLang's expects it: ``PROBED``),
   the APIs SGLang 0.5.23 uses of the machine's newer or older torch / Triton / transformers (``api_gaps``),
   SGLang's JIT modules built with nvcc through tvm-ffi (``JIT_MODULES``: JIT gaps), and every called stand-in
   against a float64 reference, then captured in a CUDA graph and replayed on new inputs against eager runs.

The dry run does the same on this CPU: the payload built from cached wheels into a temporary folder (skipped with a
note when they are not cached: CI never downloads) and its trimmed sglang imported in place of the installed one,
the models at toy widths, the imports with torch claiming a CUDA device and FlashInfer hidden (as on the lent
machines), the stand-ins on CPU tensors without graphs; the JIT modules are listed, not built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SGLANG_SPEC_GPU_SITE", "/tmp/sglang-spec-site"))  # where the payload is unpacked
MODELS_DIR = REPO / "runs" / "gpu-check" / "models"
GROUP_MODELS = {"server": ("smollm2-random-k8",), "server-mla": ("tiny-deepseek-random",),
                "server-faults": ("smollm2-random-k8",), "server-fa3": ("smollm2-random-k8",),
                "server-tp2": ("smollm2-random-k8",)}
# what a Llama / DeepSeek NEXTN server imports with the triton / flashinfer / fa3 back-ends, the plugin included
SERVER_MODULES = (
    "sglang.launch_server", "sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.models.llama", "sglang.srt.models.deepseek_v2", "sglang.srt.models.deepseek_nextn",
    "sglang.kernels.ops.gemm.cutedsl_dual_gemm",  # imported when a Llama MLP is built (layers/dual_gemm.py)
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.layers.attention.flashinfer_mla_backend",
    "sglang.srt.layers.sampler", "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
    "sglang.srt.constrained.xgrammar_backend", "sglang.srt.distributed.device_communicators.custom_all_reduce",
    "sglang_spec.sglang_plugin", "sglang_spec.sglang_plugin.hooks.startup", "sglang_spec.sglang_plugin.fused_accept",
    "sglang_spec.sglang_plugin.draft_models.llama_nextn",
)
AUDIT_SECONDS = 270  # the imports, JIT builds and graph replays, within the check's 300 s limit (bench/gpu_check.py)
HIDDEN = ("flashinfer",)  # absent on the lent machines; hidden in the dry run
PROBED = ("sgl_kernel.allreduce",)  # asked, absent on purpose: SGLang falls back (custom all-reduce -> NCCL)
# a group's own gap, known before anything runs
GROUP_GAPS = {"server-fa3": "the fa3 back-end needs sgl-kernel's compiled FA3 kernels (sgl_kernel.flash_attn, in "
                            "the 373 MB sgl-kernel wheel): nothing carried stands in for them"}
JIT_MODULES = (("sglang.kernels.ops.speculative.tree", "_jit_tree_module", ()),
               ("sglang.kernels.ops.speculative.sampling", "_jit_sampling_module", (4, True)))


# ---------------------------------------------------------------------------------------------- in the audit process
def pretend_cuda() -> None:
    """torch claims one sm90 CUDA device (the dry run): SGLang's ``is_cuda()`` branches import as on a GPU."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_name = lambda *args, **kwargs: "pretended sm90 (dry run)"
    torch.cuda.device_count = lambda: 1
    for name in HIDDEN:
        sys.modules[name] = None  # type: ignore[assignment]  # import fails, find_spec answers None


def import_gaps(modules: tuple[str, ...] = SERVER_MODULES) -> list[str]:
    import importlib

    gaps = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - each gap in one line
            gaps.append(f"import {module}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                        [:300])
    return gaps


def name_gaps(asked: set[str]) -> tuple[list[str], dict[str, str]]:
    """Each ``sgl_kernel`` name asked: stand-in, placeholder or absent (a gap unless ``PROBED``)."""
    from sglang_spec_testbed import cuda_kernels

    kinds, gaps = {}, []
    for full in sorted(asked):
        name = full.rsplit(".", 1)[1]
        if name in cuda_kernels.STAND_INS:
            kinds[full] = "stand-in"
        elif name in cuda_kernels.IMPORTED_ONLY:
            kinds[full] = "placeholder"
        elif full.split(".", 1)[1] in cuda_kernels.SUBMODULES:
            kinds[full] = "sub-module"
        else:
            kinds[full] = "absent"
            if full not in PROBED:
                gaps.append(f"sgl_kernel name {full} asked for and not stood in")
    return gaps, kinds


def api_gaps() -> list[str]:
    """APIs of torch / Triton / transformers that SGLang 0.5.23 or the stand-ins use, missing here."""
    import torch
    import triton.language as tl

    gaps = []
    if not hasattr(torch._C, "_construct_storage_from_data_pointer"):
        gaps.append(f"torch {torch.__version__} has no _construct_storage_from_data_pointer (weak_ref_tensor)")
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    for name in ("gdc_wait", "gdc_launch_dependents"):  # sglang/kernels/ops/attention/decode_attention.py
        if cuda is None or not hasattr(cuda, name):
            gaps.append(f"triton {__import__('triton').__version__} has no tl.extra.cuda.{name} (Triton decode "
                        "attention)")
    return gaps


def jit_gaps() -> tuple[list[str], dict[str, float]]:
    import importlib

    gaps, seconds = [], {}
    for module, function, args in JIT_MODULES:
        started = time.perf_counter()
        try:
            getattr(importlib.import_module(module), function)(*args)
        except Exception as error:  # noqa: BLE001
            text = str(error).strip().splitlines()
            gaps.append(f"JIT {module}.{function}: {type(error).__name__}: {(text[-1] if text else '')[:250]}")
        seconds[f"{module}.{function}"] = round(time.perf_counter() - started, 1)
    return gaps, seconds


def audit(dry: bool) -> dict:
    """Steps 3's imports, names, APIs, JIT and stand-ins in this process (its environment is a server's)."""
    from gpu_server_standins import standin_gaps
    from sglang_spec_testbed import kernels

    if "sgl_kernel" not in sys.modules:
        return {"gaps": ["the CUDA sgl_kernel stand-in is not installed in this process (boot_cuda/sitecustomize.py "
                         "did not run: check PYTHONPATH)"]}
    if dry:
        pretend_cuda()
    gaps = import_gaps()
    named, kinds = name_gaps(set(kernels.ASKED))
    gaps += named + api_gaps()
    jit_seconds: dict[str, float] = {}
    if not dry:
        jit, jit_seconds = jit_gaps()
        gaps += jit
    import sglang
    import torch

    device = "cpu" if dry else "cuda"
    gaps += standin_gaps(torch.device(device), graphs=not dry)
    return {"gaps": gaps, "sgl_kernel_names": kinds, "jit_seconds": jit_seconds, "sglang": sglang.__file__,
            "jit_planned": [f"{module}.{function}" for module, function, _ in JIT_MODULES] if dry else []}


# ---------------------------------------------------------------------------------------------- the check
def prepare(dry: bool, group: str, scratch: Path, notes: list[str]) -> tuple[list[str], Path | None, Path | None]:
    """Steps 1 and 2: the sglang site (None: the installed sglang), the FlashInfer headers folder, their gaps."""
    import gpu_server_models
    import gpu_server_payload as payload

    gaps: list[str] = []
    site = scratch / "site" if dry else SITE
    tokenizer: Path | None = None
    headers: Path | None = None
    try:
        if dry:
            folder = scratch / "payload"
            manifest = payload.build(folder, offline=True)
            notes.append(f"payload built from cached wheels: {sum(manifest['items'].values()) / 2**20:.1f} MiB")
        else:
            folder = payload.PAYLOAD
        if not dry and installed_sglang() and not folder.exists():
            raise payload.PayloadError(f"sglang {installed_sglang()} is installed here and no payload was carried")
        payload.install(folder, site, wheels=not dry)  # the dry run's Python is not the machine's 3.12
        tokenizer, headers = site / "smollm2_tokenizer", site / "flashinfer_headers"
    except payload.PayloadError as error:
        if not dry and installed_sglang() != "0.5.23":
            gaps.append(f"payload: {error}")
        elif not dry:
            notes.append(f"sglang 0.5.23 installed; no payload unpacked ({error})")
        else:
            notes.append(f"payload not built here ({error}); the installed sglang is audited")
        site = None
    if tokenizer is None:
        from sglang_spec.catalog import resolve_model_path

        _, tokenizer = resolve_model_path("smollm2", progress=False)
    if not gaps:
        try:
            gpu_server_models.build(MODELS_DIR, tokenizer, tiny=dry, names=GROUP_MODELS[group])
        except Exception as error:  # noqa: BLE001
            gaps.append(f"models: {type(error).__name__}: {str(error).splitlines()[0][:250]}")
    return gaps, site, headers


def installed_sglang() -> str | None:
    """The version of an sglang this process can import without the payload (None: none)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def models_gaps(group: str) -> list[str]:
    """The group's models at toy widths (a dry run reusing another group's audit)."""
    import gpu_server_models
    from sglang_spec.catalog import resolve_model_path

    try:
        gpu_server_models.build(MODELS_DIR, resolve_model_path("smollm2", progress=False)[1], tiny=True,
                                names=GROUP_MODELS[group])
    except Exception as error:  # noqa: BLE001
        return [f"models: {type(error).__name__}: {str(error).splitlines()[0][:250]}"]
    return []


def audit_environment(site: Path | None, headers: Path | None, dry: bool) -> dict[str, str]:
    """A server process's environment (``cuda_host.environment``) with ``site`` first; the dry run adds the CPU
    bed's torchvision stand-in (the lent machines have torchvision; this CPU's PyPI wheel would not import)."""
    from sglang_spec_testbed import BOOT_DIR, cuda_host

    env = dict(os.environ)
    paths = ([str(site)] if site else []) + [str(REPO), str(REPO / "bench")] + ([str(BOOT_DIR)] if dry else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return cuda_host.environment(env, headers)


def run_audit(dry: bool, site: Path | None, headers: Path | None, out: Path, log: Path) -> dict:
    """Step 3 in a fresh process set up as a server's; its output goes to ``log``."""
    argv = [sys.executable, str(Path(__file__)), "--audit", str(out)] + ["--dry-run"] * dry
    try:
        done = subprocess.run(argv, env=audit_environment(site, headers, dry), capture_output=True, text=True,
                              timeout=AUDIT_SECONDS)
    except subprocess.TimeoutExpired:
        return {"gaps": [f"the audit (imports, JIT builds, graph replays) ran past {AUDIT_SECONDS} s"]}
    log.write_text(done.stdout + done.stderr)
    if not out.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()
        return {"gaps": [f"the audit process exited with {done.returncode} and wrote nothing "
                         f"({tail[-1][:250] if tail else 'no output'})"]}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results file (JSON)")
    parser.add_argument("--group", default="server", choices=sorted(GROUP_MODELS))
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: nothing built for, or run on, a GPU")
    parser.add_argument("--audit", type=Path, help=argparse.SUPPRESS)  # step 3, in its own process
    args = parser.parse_args(argv)
    if args.audit:
        args.audit.write_text(json.dumps(audit(args.dry_run)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    started, notes = time.perf_counter(), []
    # the dry run audits once: a later group's preflight beside the server group's reuses its audit
    earlier = args.out.parent / "server_preflight.json"
    reuse = args.dry_run and args.group != "server" and earlier.exists()
    with tempfile.TemporaryDirectory(prefix="gpu-preflight-") as scratch:
        gaps, site, headers = prepare(args.dry_run, args.group, Path(scratch), notes) if not reuse \
            else (models_gaps(args.group), None, None)
        prepared = time.perf_counter() - started
        if reuse:
            result = {key: value for key, value in json.loads(earlier.read_text()).items()
                      if key in ("gaps", "sgl_kernel_names", "sglang", "jit_planned")}
            notes.append("the audit is server_preflight's, beside it in this dry run")
        else:
            result = run_audit(args.dry_run, site, headers, Path(scratch) / "audit.json",
                               args.out.with_suffix(".audit.log"))
    gaps += result.pop("gaps")
    if args.group in GROUP_GAPS:  # a gap where sgl-kernel is not installed; the dry run says what a GPU run would
        import importlib.util

        if args.dry_run:
            notes.append(f"a GPU run without sgl-kernel stops here: {GROUP_GAPS[args.group]}")
        elif importlib.util.find_spec("sgl_kernel") is None:
            gaps.append(GROUP_GAPS[args.group])
    for gap in gaps:
        print(f"gap: {gap}", flush=True)
    detail = (f"{len(gaps)} gaps: " + "; ".join(gaps[:3]) + (" ..." if len(gaps) > 3 else "") if gaps else
              f"no gaps: {len(SERVER_MODULES)} modules imported, {len(result.get('sgl_kernel_names', {}))} "
              f"sgl_kernel names resolved, stand-ins equal their references"
              + ("" if args.dry_run else " and their CUDA-graph replays"))
    if notes:
        detail += " (" + "; ".join(notes) + ")"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"check": f"{args.group}_preflight", "dry_run": args.dry_run, "passed": not gaps,
                                    "detail": detail, "gaps": gaps, "notes": notes, "seconds": {
                                        "prepare": round(prepared, 1),
                                        "total": round(time.perf_counter() - started, 1)}, **result}, indent=1))
    print(detail, flush=True)
    return 1 if gaps else 0


if __name__ == "__main__":
    for path in (str(REPO), str(REPO / "bench")):
        if path not in sys.path:
            sys.path.insert(0, path)
    sys.exit(main())
