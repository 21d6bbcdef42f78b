"""Which kernel runs a linear or an expert in lower precision: Tessera's blockwise FP8
(`blockwise`, on `core.kernels.fp8`) with its once-per-step weight cache (`weight_cache`),
torchao's Float8Linear (`torchao_fp8`), and Transformer Engine (`te_backend`, `te_fused`)."""
