"""The WebSocket transport: one socket carrying many streams of protocol v1
(gateway/session/)."""
