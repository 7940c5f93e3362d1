"""``x @ weight.T`` for a fixed float32 weight at the few rows of a decode step or a tree verify on CPU: the
AVX-512 kernel (``small_gemm``) and the backend choice around it (``packed_linear``). A leaf package: the target
runner (``decode``) and the MTP head (``mtp``) both use it."""
