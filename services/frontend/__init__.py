"""The frontend service: OpenAI-compatible HTTP API and gRPC ingress (no torch)."""
