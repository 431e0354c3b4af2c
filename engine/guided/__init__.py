"""Guided decoding: response_format compiled to a grammar, per-sequence matchers, token bitmasks."""
