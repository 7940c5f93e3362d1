"""Triton kernels for the speculative step, installed as ``sglang_spec.kernels``."""
