"""Nameservice: registration, heartbeats and membership events for every instance.

`registry.Registry` is the membership table; `main` serves it over gRPC
(`rtp.v1.NameService`) and publishes joins and leaves on NATS. Clients use
`rtp_serve.services.common.naming.NameClient`.
"""
