"""Compiled kernels: CPU paged decode attention (C, built at first use) and packed matmuls."""
