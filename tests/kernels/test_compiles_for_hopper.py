"""The sampled target-token kernel and the n-gram match kernel compiled for an H100 (sm90) on this CPU: Triton's
compiler, unlike its interpreter, refuses a loop-carried variable that changes type (the first 16-way search passed
every interpreted test and failed to compile on the GPU). Compiling needs no GPU: Triton lowers to PTX and runs its
bundled ptxas. It runs in a subprocess because the suite's kernels are interpreted (TRITON_INTERPRET=1 is set before
they are defined)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_spec.kernels import verify_accept as va

    kernel = va._target_tokens_kernel
    types = {"logits_ptr": "*fp32", "logits_stride": "i64", "temperature_ptr": "*fp32", "top_k_ptr": "*i64",
             "top_p_ptr": "*fp32", "coins_ptr": "*fp32", "out_ptr": "*i64", "V": "i32"}
    for sample in (True, False):
        constants = dict(N=9, SAMPLE=sample, BLOCK_V=1024, SEARCH_BLOCK_V=256, WAYS=va.SEARCH_WAYS,
                         SEARCH=va.search_passes(va.SEARCH_WAYS), ONE=va.ONE_BITS, GREEDY_BELOW=va.TEMPERATURE_FLOOR)
        names = kernel.arg_names
        source = ASTSource(fn=kernel, signature={name: types.get(name, "constexpr") for name in names},
                           constexprs={(names.index(name),): value for name, value in constants.items()})
        compiled = compile(source, target=GPUTarget("cuda", 90, 32))
        assert "cubin" in compiled.asm, sorted(compiled.asm)
        print("compiled", sample)
""")


def test_the_target_token_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled", "True", "compiled", "False"]


NGRAM_SCRIPT = textwrap.dedent("""
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_spec.kernels import ngram_match as nm

    kernel = nm._ngram_match_kernel
    names = kernel.arg_names
    constants = dict(N=8, N_PAD=8, W=3, W_PAD=4, OCCURRENCES=64, BLOCK=nm.BLOCK_POSITIONS)
    types = {name: "*i64" for name in names if name.endswith("_ptr")}
    types.update(ROW_STRIDE="i64", T="i64")
    source = ASTSource(fn=kernel, signature={name: types.get(name, "constexpr") for name in names},
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    compiled = compile(source, target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, sorted(compiled.asm)
    print("compiled")
""")


def test_the_ngram_match_kernel_compiles_for_sm90():
    """The context lookup's kernel (``kernels/ngram_match``) through Triton's compiler, as above."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", NGRAM_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled"]
