"""Model architectures, their configs, weight loading and the model store (GGUF conversion)."""
