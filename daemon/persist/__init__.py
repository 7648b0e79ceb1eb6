"""The prefix cache on disk: file format, directory, store <-> entries, background load and save."""
