"""SGLang's decode CUDA-graph runner in a CPU server (``SGLANG_SPEC_CPU_GRAPHS=1`` with ``--cuda-graph-backend-decode
full``): its real bookkeeping, with only the graph itself stood in.

On a GPU a speculative server's target verify runs through ``DecodeCudaGraphRunner``: graphs captured per batch
size (``--cuda-graph-bs-decode``), a batch padded to the next captured size (padded rows read slot 0 at the
backend's fill length), its inputs copied into static buffers (``load_batch``), the replayed graph's static
outputs sliced back to the batch. A tree-auto server builds one such runner per verify size (``verify_shapes``),
and a plain step replays the one-token verify graph. On a CPU SGLang builds no such runner (its CPU graph runner
refuses speculation), so none of that runs on the bed. With this module it does:

* ``capture_decode_graph_around``: the target's ``DecodeCudaGraphRunner`` is built on the CPU as on a GPU. The draft
  model's graphs are not: SGLang's EAGLE worker skips its draft-decode and draft-extend graphs on a CPU, and this
  module leaves that as it is (the head's rounds, and SGLang's draft loop, run eagerly here);
* ``StandInGraphBackend`` (in place of ``FullCudaGraphBackend``): a capture runs the runner's forward twice (SGLang's
  warm-up) and keeps the forward and its output tensors; a replay runs the same forward again, on the same static
  buffers, and copies its result into the captured output tensors, which it returns. As a replayed CUDA graph, it
  reads only what ``load_batch`` and the attention backend's replay metadata put in the static buffers, and a
  caller that kept a replay's outputs sees them overwritten by the next one. Unlike a graph it re-runs the forward's
  host code (SGLang's own ``--debug-cuda-graph`` replays so too), so a branch a real capture would freeze is not
  caught; a host read is (``HostReadGuard``): one inside the captured forward stops the capture, as CUDA's stream
  capture does, unless it is in a stand-in of a device kernel (``DEVICE_KERNEL_STANDINS``: the bed's ops, SGLang's
  CPU twins), which on a GPU reads its metadata on the device;
* the ``intel_amx`` backend's graph metadata: its eager metadata, rebuilt from the static batch before each replay
  (``init_forward_metadata_out_graph``, the hook SGLang calls outside the graph);
* SGLang's ragged verify graphs (its compact mode, which a ragged tree server's runners are built in:
  ``sglang_plugin.ragged_verify``): the backend declares it plans a ragged layout in a graph
  (``supports_ragged_verify_graph``), and as a GPU back-end binds the capture layout's tensors, which the runner
  refreshes in place before each replay (``_stage_ragged_verify_layout``), its replay metadata reads the layout
  captured for the tier (``CAPTURED_LAYOUTS``), not the live batch's, so a request slot the runner pads is planned
  as the runner staged it.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_spec.sglang_plugin.messages import log

GRAPHS_ENV = "SGLANG_SPEC_CPU_GRAPHS"
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
# the code that stands in for a device kernel, which reads its metadata on the device (a host read under it is
# allowed inside a capture): (a part of the file's path, a pattern of the function's name): the bed's ops,
# SGLang's CPU attention backend and its CPU twin of the Triton copy DP attention gathers with (``memcpy_cpu``),
# and the pure-torch references the project's kernels run as on a CPU
DEVICE_KERNEL_STANDINS = ((str(Path(__file__).resolve().parent), "*"),
                          ("sglang/srt/layers/attention/intel_amx_backend.py", "*"),
                          ("sglang/srt/layers/dp_attention.py", "memcpy_cpu"),
                          ("sglang_spec/kernels/", "*_reference"))
# the line a replay logs, the first time for each (graph, batch size), and its reading (``replays_in``)
REPLAY_LOG = ("CPU bed: decode graph replayed: {width} token(s) a request, a batch of {batch} on the graph "
              "captured for {size}")
REPLAY_PATTERN = re.compile(r"decode graph replayed: \d+ token\(s\) a request, a batch of (\d+) on the graph "
                            r"captured for (\d+)")
# the same for a ragged verify graph (SGLang's compact mode: graphs per tier of total verify tokens), and its reading
# (``ragged_replays_in``)
RAGGED_REPLAY_LOG = ("CPU bed: ragged verify graph replayed: a batch of {batch} on the graph captured for {tier} "
                     "verify tokens over {slots} request slots")
RAGGED_REPLAY_PATTERN = re.compile(r"ragged verify graph replayed: a batch of (\d+) on the graph captured for (\d+) "
                                   r"verify tokens over (\d+) request slots")

HOOKS = (
    ("sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_decode_graph",
     "capture_decode_graph_around", "AROUND"),
    ("sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend", "resolve_decode_backend_around",
     "AROUND"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardMode.is_cpu_graph", "is_cpu_graph_as_cuda", "REPLACE"),
    ("sglang.srt.distributed.parallel_state.GroupCoordinator.graph_capture", "group_graph_capture_around", "AROUND"),
    ("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.init_cuda_graph_state",
     "amx_init_cuda_graph_state", "REPLACE"),
    ("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.init_forward_metadata_out_graph",
     "amx_init_forward_metadata_out_graph", "REPLACE"),
)


# the attribute of an intel_amx backend holding its ragged capture layouts: graph tier (tokens) -> layout
CAPTURED_LAYOUTS = "_sglang_spec_bed_ragged_layouts"


def install() -> None:
    """What the runner asks of ``torch.cpu`` as of ``torch.cuda``: whether a graph is being captured (during the
    stand-in's capture run only); the CPU backend's graph metadata planning a ragged layout (module docstring)."""
    torch.cpu.is_current_stream_capturing = lambda: StandInGraphBackend.capturing  # type: ignore[attr-defined]
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

    IntelAMXAttnBackend.supports_ragged_verify_graph = True


def graphs_from_environment() -> bool:
    """``SGLANG_SPEC_CPU_GRAPHS``: 1 stands SGLang's decode graph runner up on the CPU; unset or 0 leaves it off."""
    value = os.environ.get(GRAPHS_ENV, "")
    if value not in ("", "0", "1"):
        from sglang_spec.errors import SpecError

        raise SpecError(f"{GRAPHS_ENV}={value!r}: use 1 (SGLang's decode graph runner, graphs stood in) or 0")
    return value == "1"


def capture_decode_graph_around(original, *args, **kwargs):
    """A CPU model runner's decode graphs: SGLang's GPU runner for the target (its capture through the stand-in
    backend), none for the draft model."""
    model_runner = kwargs["model_runner"]
    if model_runner.device != "cpu":
        return original(*args, **kwargs)
    from sglang.srt.model_executor.model_runner_components.cuda_graph_setup import GraphCapture

    if model_runner.is_draft_worker or not model_runner.is_generation:
        return GraphCapture(runner=None, memory_phase="draft_decode", memory_usage_gb=0, capture_time=0)
    phase = "target_verify" if model_runner.spec_algorithm.is_speculative() else "decode"
    runner = model_runner._decode_cuda_graph_runner_cls()(model_runner)
    return GraphCapture(runner=runner, memory_phase=phase, memory_usage_gb=0, capture_time=0)


def resolve_decode_backend_around(original, cuda_graph_runner, *args, **kwargs):
    """The graph backend of a runner on the CPU: the stand-in, in place of SGLang's full CUDA-graph backend."""
    if cuda_graph_runner.model_runner.device != "cpu":
        return original(cuda_graph_runner, *args, **kwargs)
    return StandInGraphBackend(cuda_graph_runner)


def is_cpu_graph_as_cuda(mode) -> bool:
    """The forward modes a CPU server replays graphs for: a GPU's (decode, target verify, idle), not SGLang's CPU
    graph runner's decode alone."""
    return mode.is_cuda_graph()


def group_graph_capture_around(original, group, graph_capture_context=None, stream=None):
    """A rank group's part in a capture: on a GPU it switches the group's collectives to the graph-capturable
    communicators (PyNccl); on the CPU the group's gloo collectives stay, as they run again at each replay."""
    if group.device.type != "cpu":
        return original(group, graph_capture_context, stream)
    from sglang.srt.distributed.parallel_state import GraphCaptureContext

    if graph_capture_context is None:
        graph_capture_context = GraphCaptureContext(stream if stream is not None else torch.cpu.Stream())
    return contextlib.nullcontext(graph_capture_context)


def amx_init_cuda_graph_state(backend, max_bs: int, max_num_tokens: int) -> None:
    """The CPU backend keeps no graph state: its metadata is rebuilt from the static batch before each replay."""


def amx_init_forward_metadata_out_graph(backend, forward_batch, in_capture: bool = False) -> None:
    """Before a capture and each replay (outside the graph): the backend's eager metadata of the static batch; for a
    ragged verify graph, of the layout captured for its tier, as the runner staged it (module docstring)."""
    layout = getattr(forward_batch.spec_info, "ragged_verify_layout", None)
    if layout is not None and forward_batch.forward_mode.is_target_verify():
        layouts = backend.__dict__.setdefault(CAPTURED_LAYOUTS, {})
        tier = forward_batch.input_ids.shape[0]
        if in_capture:
            layouts[tier] = layout
        else:
            forward_batch.spec_info = copy.copy(forward_batch.spec_info)
            forward_batch.spec_info.ragged_verify_layout = layouts[tier]
    backend.init_forward_metadata(forward_batch)


class StandInGraphBackend:
    """SGLang's ``BaseCudaGraphBackend`` interface; see the module docstring."""

    capturing = False  # a capture run is under way (``torch.cpu.is_current_stream_capturing``)

    def __init__(self, runner) -> None:
        self.runner = runner  # SGLang's DecodeCudaGraphRunner
        self.forwards: dict[Any, Any] = {}
        self.outputs: dict[Any, Any] = {}
        self.replayed: set[Any] = set()  # (shape, batch size) replayed so far: the first replay of each is logged

    @contextlib.contextmanager
    def capture_session(self, stream):
        yield

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None) -> None:
        for _ in range(2):
            forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        StandInGraphBackend.capturing = True
        try:
            with HostReadGuard():
                self.outputs[shape_key] = forward_fn()
        finally:
            StandInGraphBackend.capturing = False
        self.forwards[shape_key] = forward_fn

    def can_run(self, forward_batch, shape_key) -> bool:
        return shape_key in self.forwards

    @contextlib.contextmanager
    def replay_session(self):
        yield

    def replay(self, shape_key, static_forward_batch, **kwargs):
        if (shape_key, self.runner.raw_bs) not in self.replayed:
            self.replayed.add((shape_key, self.runner.raw_bs))
            if self.runner.ragged_verify_mode:
                log(RAGGED_REPLAY_LOG.format(batch=self.runner.raw_bs, tier=shape_key.size, slots=self.runner.bs))
            else:
                log(REPLAY_LOG.format(width=self.runner.captured_req_width, batch=self.runner.raw_bs,
                                      size=shape_key.size))
        output = self.outputs[shape_key]
        _copy_into(output, self.forwards[shape_key]())
        return output

    def cleanup(self) -> None:
        self.forwards.clear()
        self.outputs.clear()


class HostReadGuard(TorchDispatchMode):
    """During a capture run: a tensor's value read to the host (``.item()``, ``int()``, ``bool()`` of a tensor;
    ``aten._local_scalar_dense``) outside a device kernel's stand-in (and what it calls) raises, naming where, as
    CUDA's stream capture fails on a host synchronisation. (``.tolist()`` reads memory without an aten op and is
    not seen.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            caller = _caller()
            if caller is not None and not _under_a_kernel_standin(caller):
                raise RuntimeError(f"CPU bed: a host read inside a captured decode graph, at "
                                   f"{caller.f_code.co_filename}:{caller.f_lineno}; a CUDA graph capture fails there")
        return func(*args, **(kwargs or {}))


def _under_a_kernel_standin(frame) -> bool:
    """Whether ``frame`` or one of its callers inside the captured run (below ``capture_one``) is a device kernel's
    stand-in (``DEVICE_KERNEL_STANDINS``)."""
    capture = StandInGraphBackend.capture_one.__code__
    while frame is not None and frame.f_code is not capture:
        code = frame.f_code
        if any(part in code.co_filename and fnmatch.fnmatchcase(code.co_name, name)
               for part, name in DEVICE_KERNEL_STANDINS):
            return True
        frame = frame.f_back
    return False


def _caller():
    """The innermost frame outside torch and this module (None: none)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame


def _copy_into(captured: Any, fresh: Any) -> None:
    """The fresh forward's tensors into the captured output's, field by field (the graph's static outputs)."""
    if captured is None or fresh is None:
        return
    if torch.is_tensor(captured):
        captured.copy_(fresh)
        return
    if isinstance(captured, (list, tuple)):
        for mine, theirs in zip(captured, fresh):
            _copy_into(mine, theirs)
        return
    if hasattr(captured, "__dict__"):  # SGLang's output records (LogitsProcessorOutput and the like)
        for name, value in vars(captured).items():
            _copy_into(value, getattr(fresh, name, None))


def replays_in(log_text: str) -> list[tuple[int, int]]:
    """(batch size, captured size) of each replay a server's log shows (``REPLAY_LOG``)."""
    return [(int(batch), int(size)) for batch, size in REPLAY_PATTERN.findall(log_text)]


def ragged_replays_in(log_text: str) -> list[tuple[int, int, int]]:
    """(batch size, tier tokens, request slots) of each ragged verify replay a server's log shows
    (``RAGGED_REPLAY_LOG``)."""
    return [(int(batch), int(tier), int(slots)) for batch, tier, slots in RAGGED_REPLAY_PATTERN.findall(log_text)]
