"""numba's housekeeping for stage 1, beside the core: the cache folder, warm-up marks, threads."""
