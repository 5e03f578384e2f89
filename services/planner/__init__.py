"""The SLA planner: sizes the worker fleet to the load it predicts (docs/operations/autoscaling.md)."""
