"""prefixd daemon."""
