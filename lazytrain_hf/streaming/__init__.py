"""The layer-streaming executor."""
