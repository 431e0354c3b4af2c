"""Paged attention: the step's metadata, and the backends that attend over the KV blocks.

``metadata`` builds what every backend reads; ``registry`` picks a backend per
device (``cpu``, ``torch``, ``triton``, ``flash-attn``); each backend lives in a
module of its own. Models call :func:`engine.attention.metadata.paged_attention`.
"""
