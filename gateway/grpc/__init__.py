"""The optional gRPC API (``--grpc-port``): protocol v1 over ``tokenrelay.v1.Relay/Chat``."""
