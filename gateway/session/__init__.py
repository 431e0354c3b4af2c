"""What the WebSocket and gRPC share: protocol v1 (frames, sans I/O) and the StreamSession
that runs it over any transport; gateway/ws/ and gateway/grpc/ are thin transports."""
