"""The HTTP API: OpenAI-compatible completions, resumable SSE, stream cancel, tokens, pages."""
