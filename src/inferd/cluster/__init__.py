"""One server's shared state, for front ends on one host or many: the store (cluster/store.py), its
implementations (memory.py, local.py, redis_store.py), the lease of the one who decides (lease.py), and
the served-state documents every front end follows (served.py, follower.py)."""
