"""Runs at start-up of every Python process whose PYTHONPATH holds this folder (``cuda_host.environment``: SGLang's
launcher and, through inheritance, its scheduler and detokenizer, on a GPU machine without sgl-kernel): installs
the CUDA-mode ``sgl_kernel`` stand-in and FlashInfer's headers for SGLang's JIT (``cuda_host.activate``) before
anything imports sglang. Nothing else of the CPU test bed runs (no torchvision stand-in: the GPU machine has the
real one). A failure ends the process with one line."""

import os
import sys

if os.environ.get("SGLANG_SPEC_CUDA_STANDINS") == "1":
    try:
        from sglang_spec_testbed import cuda_host

        cuda_host.activate()
    except Exception as error:  # sitecustomize errors are otherwise printed and ignored
        sys.stderr.write(f"error: the CUDA sgl_kernel stand-in did not install: {type(error).__name__}: {error}\n")
        sys.stderr.flush()
        os._exit(2)
