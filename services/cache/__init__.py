"""The remote KV tier: cache service instances (in-memory LRU, T2) in front of Redis (T3).

`lru.ByteLRU` and `redis_tier.RedisTier` are the two stores, `servicer.CacheServicer` the
gRPC `rtp.v1.Cache` service over them, `main` the process, and `client.CacheClient` what
prefill workers use to reach a sharded set of instances.
"""

# Most block hash keys one Get/Exists/Put call may carry; shared by service and client.
# A 128k-token prompt in 16-token blocks has 8192 keys; twice that leaves room for smaller
# blocks while keeping one call's bookkeeping bounded.
MAX_KEYS = 16384
