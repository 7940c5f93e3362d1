"""Runs at start-up of every Python process whose PYTHONPATH holds this folder (``server_environment`` puts it
there for SGLang's launcher and, through inheritance, its scheduler and detokenizer subprocesses): installs the
CPU stand-ins before anything imports sglang. A wrong sglang version ends the process with one line."""

import os
import sys

if os.environ.get("SGLANG_SPEC_CPU") == "1":
    try:
        from sglang_spec_testbed import activate

        activate()
    except Exception as error:  # sitecustomize errors are otherwise printed and ignored
        sys.stderr.write(f"error: {error}\n")
        sys.stderr.flush()
        os._exit(2)
