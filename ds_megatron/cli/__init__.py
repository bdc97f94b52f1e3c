"""L5: command-line entry points (thin wrappers over the library)."""
