"""The engine thread: the only thread that touches MLX, the models and the prefix store."""
