"""SGLang model classes the plugin adds to SGLang's model registry (``register`` hooks the registry's lazy load).

* ``llama_nextn.LlamaForCausalLMNextN``: an sglang_spec MTP head for a Llama-family target, served as SGLang's
  NEXTN / EAGLE draft model with exactly the reference decoder's arithmetic (``export.export_llama_draft``
  writes the folder it loads).
"""
