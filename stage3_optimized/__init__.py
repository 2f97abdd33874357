"""Stage 3: stage 2 made fast, one lesson at a time (docs/lessons/stage3; options.RUNG says
how many this copy holds): a prefix cache, fused kernels, bf16 with cuBLAS GEMMs, GQA-shared
split-KV decode attention, tensor-core prefill, sampling on the device, a lean decode step and
CUDA graphs, each kernel with a numpy twin, so device="cpu" runs everything. Reading order:
docs/stage3.md."""
