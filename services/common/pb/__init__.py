"""Generated protobuf and gRPC stubs (scripts/gen_protos.py); do not edit."""
