"""Package discovery that pyproject.toml cannot express on its own: the top-level kernels/ folder
installs as `sglang_spec.kernels` (never as a bare `kernels` package). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["sglang_spec", "sglang_spec.*"]) + ["sglang_spec.kernels"],
    package_dir={"sglang_spec.kernels": "kernels"},
)
