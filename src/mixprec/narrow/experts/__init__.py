"""Mixture-of-experts projections in the narrow recipes: per-expert bookkeeping on the device (segments), the
FP8 and microscaled passes (fp8, mx) and the block-wise kernels' operators (blockwise), the projection and its
custom operators (ops), which GEMM route a device takes (routes), the experts module around them (layer), and
transformers' experts interface (hf)."""
