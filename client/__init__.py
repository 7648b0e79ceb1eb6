"""prefixd clients and command line."""
