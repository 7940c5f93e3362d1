"""Triton kernels for the speculative step.

One module per op, each with its Triton kernel(s), launcher(s) and pure-torch reference(s) side by side:

* ``tree_metadata``  draft candidates + topology -> tokens, positions, links, ancestor mask, FlashInfer packed mask
* ``verify_accept``  target logits -> per-node target token -> accepted path, bonus, output-buffer writes
* ``kv_commit``      accepted KV rows moved in place to contiguous positions; freed slots reported
* ``mla_tree_attention``  MLA tree verify's tree part: each tree query against its ancestors' latent rows,
                     base-2 lse for FlashInfer's ``merge_state`` (the prefix part is FlashInfer's MLA decode)
* ``ngram_match``    context lookup from a device token history: ``NgramIndex.continuations`` per query (request
                     row + a node's tail), no host read

Launchers take everything as arguments (``out=`` buffers included) and never read tensors on the host. On a CPU
the kernels run under ``TRITON_INTERPRET=1``, which must be set before this package is imported.
"""
