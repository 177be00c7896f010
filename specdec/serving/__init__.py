"""Service plumbing: configuration, gRPC helpers, sessions, the wire form of trees, the
Ray Serve application and its launcher, the client, the latency injector."""
