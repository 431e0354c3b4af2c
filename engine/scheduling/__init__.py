"""Torch-free continuous batching: sequences, the scheduler and the KV block manager."""
