"""What every worker process (prefill, decode, fused) shares: flags and engine construction
(config), the servicer base with the Stats RPC and error mapping (servicer), KV on the wire
(kv_wire), KV-event and load publishing (kv_events), metrics, and the process's life (serve).

Only worker processes import this package: it loads torch.
"""
