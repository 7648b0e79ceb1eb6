"""Models: loading and fingerprinting, prompt encoding, GGUF import, BLAS preload, one-time setup.

Import the modules themselves: loaded_model imports MLX, and blas must run
before anything does.
"""
