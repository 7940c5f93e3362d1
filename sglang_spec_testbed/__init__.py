"""SGLang's real server on a CPU without sgl-kernel's CPU build: the project's test bed (not the product).

The bed is an SGLang plugin of its own (entry point ``sglang.srt.plugins: sglang_spec_testbed``, ``register``):
in a process whose environment sets ``SGLANG_SPEC_CPU=1`` (``server_environment``) it installs the stand-ins
and the few behaviour hooks a CPU needs; everywhere else it does nothing. The product
(``sglang_spec.sglang_plugin``) never imports it.

SGLang 0.5.23 serves on a CPU (``SGLANG_USE_CPU_ENGINE=1``, the ``intel_amx`` attention backend) through the ops of
sgl-kernel's CPU build, which is not on PyPI. This package gives SGLang pure-torch stand-ins for the ops its
Llama, DeepSeek-V3 (MLA + MoE), EAGLE / NEXTN and NGRAM paths call, so the real tokenizer manager, scheduler
subprocess, ModelRunner, EAGLE v2 worker and NGRAM worker (its C++ corpus compiled by SGLang through tvm-ffi with the
host's g++) run here unchanged, our plugin included:

* ``kernels``: a fake ``sgl_kernel`` module and ``torch.ops.sgl_kernel`` namespace. A name with a stand-in
  resolves to it; a name SGLang imports unconditionally but never calls on our paths resolves to a placeholder
  that raises when called; every other name is absent, which is what SGLang's ``hasattr`` / ``ImportError``
  probes expect of a build without that op.
* ``ops``: the stand-ins (cache-location helpers, KV copy, draft metadata, tree build, greedy verify), each
  checked equal to SGLang's own Triton twin where one exists; ``attention``: decode and extend attention, tree mask
  included, for MHA and MLA pools; ``sampling``: the sampling-verify and renormalisation ops (set on SGLang's
  modules by ``patches``, which also holds the few behaviour hooks a CPU needs); ``linear``: sgl-kernel's packed
  GEMM (``weight_packed_linear``) over float32 weights packed at load, for the linear layers and the LM head (the
  draft model's own rounded to bfloat16 with ``SGLANG_SPEC_CPU_DRAFT_WEIGHTS=bfloat16``);
  ``tree_mask``: the tree-mask layout SGLang builds and the extend attention reads (``SGLANG_SPEC_CPU_TREE_MASK=full``
  runs the GPU's ``FULL_MASK`` instead of the CPU's ``QLEN_ONLY``).
  DeepSeek-V3's MoE needs no stand-in: SGLang's own CPU fallback serves it.
* ``boot/``: put on ``PYTHONPATH`` of every SGLang process (``server_environment``); its ``sitecustomize`` calls
  ``activate`` before anything imports sglang, and it holds the torchvision stand-in.
* fused accept: ``server_environment`` has ``--speculative-tree-accept fused`` run its kernels' pure-torch
  references (``SGLANG_SPEC_ACCEPT_KERNELS=reference``; ``triton`` interprets the Triton kernels, as the tiny
  DeepSeek-V3 servers do).
* ``server``: start and stop ``python -m sglang.launch_server`` on this CPU by process group, with hard timeouts;
  ``zygote``: the same launch forked from a process that imported the launcher's modules once (the test suite's
  servers: ~6 s of each start saved).
* ``served_models``: the architectures the bed serves, which SGLang's registry imports instead of all its models
  (``SGLANG_EXTERNAL_MODEL_PACKAGE``; about 3 s of each launch's 25 s here); any other model still loads.
* ``graphs``: with ``SGLANG_SPEC_CPU_GRAPHS=1`` (and ``--cuda-graph-backend-decode full``), the target's verify
  through SGLang's ``DecodeCudaGraphRunner`` as on a GPU (capture per batch size and verify size, padding, static
  buffers), only the graph stood in: a replay runs the captured forward again on the static buffers.
* ``step_timing``: with ``SGLANG_SPEC_CPU_PROFILE=<folder>``, the scheduler's per-batch timings (target and draft
  forwards, loop period) and optionally cProfile statistics of its decode steps (``bench/cpu_step_profile.py``).
* ``threads``: every SGLang process on one OpenMP thread unless ``SGLANG_SPEC_CPU_THREADS=N`` says more, and with
  ``SGLANG_SPEC_CPU_PREFILL_THREADS=N`` prefills on N threads (decode steps keep the process's); for a machine of
  its own (the serving sweep's ``--prefill-threads``). A bad count is one line.
* malloc: ``server_environment`` fixes glibc's mmap and trim thresholds (``MALLOC_ENV``) so a step's large
  temporaries stay in the heap instead of being faulted in again each step (the CUDA caching allocator's role on
  a GPU); a value set in the environment wins.

Everything here is numerics-faithful but slow; it exists to run SGLang's control flow and our plugin end to end,
not to serve traffic. Real CUDA graphs and the FlashInfer / FA3 / Triton attention backends stay GPU-only; page
size > 1 (trees included: ``patches``), several scheduler ranks (tensor parallelism over gloo: ``rank_cores``) and
SGLang's decode graph runner (``graphs``) run here.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from sglang_spec.errors import SpecError
from sglang_spec_testbed import kernels, linear, threads, tree_mask
from sglang_spec.sglang_plugin.fused_accept import ACCEPT_KERNELS_ENV

SUPPORTED_SGLANG = "0.5.23"
ENABLE_FLAG = "SGLANG_SPEC_CPU"  # set to 1 in a process's environment: boot/sitecustomize activates the stand-ins
BOOT_DIR = Path(__file__).resolve().parent / "boot"
SERVED_MODELS = "sglang_spec_testbed.architectures"
# glibc malloc hands a step's large temporaries (logits, attention scores: megabytes) back to the kernel and faults
# them in again the next step: the scheduler of a plain server at 16 requests (extraction) took ~36k minor faults a
# second, 8% of its time in the kernel. Fixed thresholds (which also stop glibc's dynamic ones) keep them in the
# heap: 3.7x fewer faults, 2.8x less kernel time, plain-sync 47.2 -> 53.9 tok/s there (one run each; sixteenth
# session, docs/results/serving_sweep.md). A 32 MiB mmap threshold is glibc's largest.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
              "MALLOC_TOP_PAD_": str(256 << 20)}

_activated = False


def check_sglang_version(version: str | None = None) -> str:
    installed = version if version is not None else metadata.version("sglang")
    if installed != SUPPORTED_SGLANG:
        raise SpecError(
            f"the CPU harness supports sglang {SUPPORTED_SGLANG} only, found {installed}; "
            f"install sglang=={SUPPORTED_SGLANG} (pip install --no-deps sglang=={SUPPORTED_SGLANG})"
        )
    return installed


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def rank_cores(ranks: int, cores: int | None = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` processes: rank i on core i (modulo the cores), ``0|1`` for two.

    SGLang's CPU engine asks for one NUMA node per rank unless this names each rank's cores
    (``numa_utils.init_threads_binding``: dp x tp x pp ranks on a one-node machine stop the launch). It pins
    threads only through sgl-kernel's AMX build (``init_cpu_threads_env``), which the bed's stand-ins do not
    claim, so here the value passes that check; each rank runs ``OMP_NUM_THREADS`` threads wherever the OS puts
    them."""
    cores = cores or os.cpu_count() or 1
    return "|".join(str(rank % cores) for rank in range(ranks))


def server_environment(base: dict[str, str] | None = None, ranks: int = 1) -> dict[str, str]:
    """The environment an SGLang process needs to run on this CPU with the stand-ins active; ``ranks``: the
    scheduler processes the launch starts (dp x tp x pp, ``server.launch_ranks``), more than one gets a core
    binding per rank (``rank_cores``) unless the environment names one. A bad ``SGLANG_SPEC_CPU_THREADS`` is a
    ``SpecError`` (one line)."""
    env = dict(os.environ if base is None else base)
    if ranks > 1 and not env.get(THREADS_BIND_ENV):
        env[THREADS_BIND_ENV] = rank_cores(ranks)
    paths = [str(BOOT_DIR)] + [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        **{ENABLE_FLAG: "1"},
        SGLANG_USE_CPU_ENGINE="1",
        # SGLang's Triton kernels (tree building, greedy verify, commit helpers) run under the interpreter
        TRITON_INTERPRET="1",
        # torch.compile has nothing to gain on these shapes and costs minutes of compile time on 2 cores
        TORCHDYNAMO_DISABLE="1",
        # one OpenMP thread per SGLang process: with a second busy process on a 2-core machine, every
        # multi-threaded op waits for a descheduled thread at its barrier (measured: 8 s vs 183 s for the same
        # 4 x 40 plain decode); SGLANG_SPEC_CPU_THREADS raises it on a machine of its own
        OMP_NUM_THREADS=str(threads.threads_from_environment(env)),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    # the registry imports the bed's few architectures instead of every model SGLang ships (``served_models``)
    env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", SERVED_MODELS)
    # --speculative-tree-accept fused runs its kernels' pure-torch references: interpreted, the Triton kernels take
    # seconds a verify at SmolLM2's vocabulary (``fused_accept.AcceptKernels``); ``triton`` interprets them
    env.setdefault(ACCEPT_KERNELS_ENV, "reference")
    for name, value in MALLOC_ENV.items():
        env.setdefault(name, value)
    return env


def activate() -> None:
    """Installs the stand-ins in this process (idempotent). Must run before sglang is imported."""
    global _activated
    if _activated:
        return
    check_sglang_version()
    if os.environ.get(linear.GEMM_ENV):
        linear.backend_from_environment()
    linear.draft_dtype_from_environment()
    tree_mask.mode_from_environment()
    threads.prefill_threads_from_environment()
    kernels.install()
    _activated = True


def register() -> None:
    """The bed's plugin entry point: its hooks, in a process of the bed only (``ENABLE_FLAG``). Idempotent through
    SGLang's loader (it runs each plugin once a process)."""
    if os.environ.get(ENABLE_FLAG) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_spec_testbed import graphs, patches, step_timing

    for target, name, kind in patches.hooks(patches.overlap_from_environment()):
        HookRegistry.register(target, getattr(patches, name), getattr(HookType, kind))
    for target, hook, kind in tree_mask.hooks(tree_mask.mode_from_environment()):
        HookRegistry.register(target, hook, getattr(HookType, kind))
    for target, hook, kind in threads.hooks(threads.prefill_threads_from_environment()):
        HookRegistry.register(target, hook, getattr(HookType, kind))
    if graphs.graphs_from_environment():
        graphs.install()
        for target, name, kind in graphs.HOOKS:
            HookRegistry.register(target, getattr(graphs, name), getattr(HookType, kind))
    patches.install_attributes()
    claim_amx_platform()
    if os.environ.get(step_timing.PROFILE_ENV):
        for target, name, kind in step_timing.HOOKS:
            HookRegistry.register(target, getattr(step_timing, name), getattr(HookType, kind))


def claim_amx_platform() -> None:
    """SGLang keeps ``--attention-backend intel_amx`` only on a platform that reports AMX tiles, and silently
    swaps it for torch_native (which has no speculative draft backend) elsewhere. Claim the platform fact only:
    ``cpu_has_amx_support()`` itself stays False, so no layer switches to AMX-packed weights."""
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()
