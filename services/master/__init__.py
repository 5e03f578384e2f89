"""The master: global scheduler that routes each request (docs/design.md "The request path", step 3).

cluster.py (membership, loads, prefix index) -> policy.py (which workers) -> servicer.py
(rtp.v1.Master.Route) -> main.py (the service process).
"""
