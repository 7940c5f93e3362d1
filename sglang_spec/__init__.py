"""sglang_spec: tree-based speculative decoding for DeepSeek-R1-class models on SGLang."""

__version__ = "0.1.0"
