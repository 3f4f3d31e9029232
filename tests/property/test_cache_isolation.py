"""No lookup of the response cache ever returns an answer stored under another tenant, whatever the
interleaving of stores, lookups, evictions, expiries and digests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.config.cache import CacheConfig
from inferd.gateway.cache import CacheKey, ResponseCache, request_key

TENANTS = st.sampled_from(["", "acme", "globex", "acme2"])
REQUESTS = st.sampled_from(["a", "b", ("a",), ["a", 1], b"a"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), TENANTS, REQUESTS, st.integers(1, 400)),
        st.tuples(st.just("lookup"), TENANTS, REQUESTS),
        st.tuples(st.just("collide"), TENANTS, TENANTS, REQUESTS),
        st.tuples(st.just("advance"), st.floats(0.0, 30.0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 6))
def test_no_lookup_returns_another_tenants_answer(ops: list[tuple], max_entries: int) -> None:
    clock = FakeClock()
    cache: ResponseCache[tuple[str, object]] = ResponseCache(
        CacheConfig(enabled=True, ttl_s=45, max_entries=max_entries, max_bytes=1024), clock
    )
    for op in ops:
        if op[0] == "store":
            _, tenant, request, size = op
            cache.store(request_key(tenant, "sim", 1, request), (tenant, request), size)
        elif op[0] == "lookup":
            _, tenant, request = op
            found = cache.lookup(request_key(tenant, "sim", 1, request))
            assert found is None or found == (tenant, request)
        elif op[0] == "collide":  # even with equal digests, the tenant field keeps the keys apart
            _, owner, other, request = op
            digest = request_key(owner, "sim", 1, request).digest
            cache.store(CacheKey(owner, "sim", 1, digest), (owner, request), 1)
            found = cache.lookup(CacheKey(other, "sim", 1, digest))
            assert found is None or found[0] == other
        else:
            clock.advance(op[1])
