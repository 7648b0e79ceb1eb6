"""What ties the prefix store to mlx-lm's cache objects: layer layout, payloads, forks and captures."""
