"""Stage 3 (planned, not built yet): BF16 + cuBLAS, FlashAttention-2 style prefill,
GQA-shared decode, fused kernels, automatic prefix caching. See ../shared/DESIGN.md."""
