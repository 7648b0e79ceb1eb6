"""The prefixd daemon: an asyncio front and one engine thread that owns the device.

Parts (docs/architecture.md walks through them):
  service/  the process: command line, configuration, logs, systemd/launchd, lifecycle
  front/    the socket and HTTP fronts, on the event loop (no MLX)
  engine/   the engine thread: inbox, scheduler, prefill, batched decoding
  cache/    the prefix store (pure Python, tested without a model)
  kv/       what ties the store to mlx-lm's cache objects
  persist/  the prefix cache on disk
  models/   loading, prompt encoding, GGUF import, BLAS preload, model setup
"""
