"""Tokenizer loading and incremental detokenization with stop strings."""
