"""The fronts, on the event loop: the msgpack-RPC Unix socket and the opt-in HTTP API.

No MLX here: model work goes to the engine thread as a job or an ``engine.call``.
"""
