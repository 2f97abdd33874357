"""Stage 3: stage 2 made fast — bf16 with cuBLAS GEMMs, fused kernels, GQA-shared
split-KV decode attention, automatic prefix caching (each kernel with a numpy twin,
so device="cpu" runs everything). Reading order: docs/stage3.md."""
