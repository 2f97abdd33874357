"""numba's housekeeping for stage 1, beside the core: its cache folder, warm-up marks and threads."""
