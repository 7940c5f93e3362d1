"""The model architectures the CPU bed serves, as SGLang's registry reads an external model package
(``SGLANG_EXTERNAL_MODEL_PACKAGE``, set by ``server_environment``): the registry imports these few modules at
start-up instead of every model SGLang ships (about a hundred, each process), and loads the rest only when a
model asks for an architecture missing here (SGLang's own fall-back), so any model still serves.

One module an SGLang model module, each re-exporting that module's ``EntryClass``.
"""
