"""The WebSocket: protocol v1 (sans I/O) and the connection that carries it."""
