"""Inference: generation with a KV cache."""
