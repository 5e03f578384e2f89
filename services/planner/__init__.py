"""The SLA planner: sizes the worker fleet to the load it predicts (docs/operations/autoscaling.md)."""

import os

# The local actuator forks worker processes while gRPC runs (the nameservice watch). With
# gRPC's fork handlers on, a child forked while gRPC threads are busy can abort before it
# execs (seen: SIGABRT after "epoll_wait error: Bad file descriptor"). The child only execs,
# so it needs no handlers: off, before gRPC starts in this process.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
