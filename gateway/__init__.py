"""tokenrelay's gateway: WebSocket + HTTP API over a Redis stream log."""
