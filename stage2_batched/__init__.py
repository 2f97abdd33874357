"""Stage 2: many users at once on a GPU — continuous batching, a paged KV cache, CUDA
kernels launched from CuPy (each with a numpy twin, so device="cpu" runs everything).
Reading order: docs/stage2.md."""
