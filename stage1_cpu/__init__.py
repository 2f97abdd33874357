"""Stage 1: a readable, exact CPU engine for Qwen3 (numpy reference ops, numba kernels,
INT8/INT4 group quantization, MoE routing). Reading order: docs/stage1.md."""
