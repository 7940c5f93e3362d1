"""The CPU bed's registry imports only the architectures it serves (``sglang_spec_testbed/architectures``): SGLang's
registry reads them as an external model package, and still loads every model it ships when asked for one missing
there."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from sglang_spec_testbed import SERVED_MODELS, server_environment

pytestmark = pytest.mark.sglang


def test_the_bed_names_its_model_package_and_leaves_a_callers_own():
    assert server_environment({})["SGLANG_EXTERNAL_MODEL_PACKAGE"] == SERVED_MODELS
    assert server_environment({"SGLANG_EXTERNAL_MODEL_PACKAGE": "mine"})["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "mine"


def test_the_package_holds_the_bed_targets_and_drafts_and_the_registry_falls_back_to_every_model():
    from sglang.srt.models.registry import _ModelRegistry, import_model_classes

    served = import_model_classes(SERVED_MODELS, strict=True)
    assert {"LlamaForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN"} <= set(served)
    package = importlib.import_module(SERVED_MODELS)
    assert all(hasattr(importlib.import_module(f"{SERVED_MODELS}.{name}"), "EntryClass")
               for _, name, _ in pkgutil.iter_modules(package.__path__))
    registry = _ModelRegistry(models=dict(served), _default_models_loaded=False)
    assert registry.resolve_model_cls(["LlamaForCausalLM"])[0] is served["LlamaForCausalLM"]
    assert not registry._default_models_loaded  # served without importing the rest
    assert registry.is_arch_supported("Qwen2ForCausalLM") and registry._default_models_loaded
