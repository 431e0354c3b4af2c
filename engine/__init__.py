"""tokenrelay's PyTorch engine: continuous batching over a paged KV cache."""
