"""The gRPC protocol (deltaserve.v1) and its generated stubs."""
