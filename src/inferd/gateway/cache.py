"""The response cache: exact-match answers of deterministic models, kept in memory.

A `ResponseCache` is one model version's store: a bounded LRU (by entries and by bytes) whose entries
expire `ttl_s` after they were computed, on an injected clock. `get_or_compute` adds single-flight:
while one caller (the leader) computes the answer for a key, identical callers (followers) wait for it
instead of computing it again. A leader's error is never cached: its own caller gets the error, and
each follower tries again (the first to wake leads a new computation), so a follower is never failed
by another caller's deadline, disconnect or bad luck; its own deadline still bounds its wait.

Keys (`CacheKey`) carry the tenant, the model, the served version and a BLAKE2b digest of the canonical
request (`request_key`). The tenant and version are fields of the key itself, not only inputs of the
digest, so an entry stored under one tenant can never answer another, even on a digest collision.
`ResponseCache` keeps its answers in memory; `RedisResponseCache` (gateway/redis_cache.py) overrides
`fetch` and `keep` to share them between front ends through Redis. Single-flight stays in process
either way. A store that cannot be reached raises `StoreUnavailable` from `fetch`: the caller's answer
is then computed without the cache ("bypass").
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import numpy as np

from inferd.clock import Clock
from inferd.config.cache import CacheConfig

V = TypeVar("V")
Lookup = Literal["hit", "miss", "bypass"]


class StoreUnavailable(Exception):
    """The cache's shared store could not be reached: answer without the cache."""


@dataclass(frozen=True, slots=True)
class CacheKey:
    tenant: str
    """The caller's tenant name ("" for anonymous callers)."""
    model: str
    version: int
    digest: bytes
    """BLAKE2b-256 of the canonical request."""


def _canonical_hook(obj: Any) -> Any:
    """numpy values as (dtype, shape, data): equal arrays encode equally, whatever their origin (JSON or
    binary tensors); object arrays (BYTES tensors) by their elements, never by their pointers."""
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return ("O", obj.shape, obj.ravel().tolist())
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return (obj.dtype.str, obj.item())
    raise NotImplementedError(f"cannot build a cache key from {type(obj).__name__}")


_canonical = msgspec.msgpack.Encoder(enc_hook=_canonical_hook)


def request_key(tenant: str, model: str, version: int, canonical: Any) -> CacheKey:
    """The key of one request: `canonical` is what decides the answer (the decoded inputs and the
    parameters that change the output; never the request id, deadline or priority)."""
    digest = hashlib.blake2b(_canonical.encode((tenant, model, version, canonical)), digest_size=32)
    return CacheKey(tenant, model, version, digest.digest())


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    size: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class CacheStatistics:
    entries: int
    bytes: int
    hits: int
    misses: int
    coalesced: int
    """Hits that waited for another caller's computation (single-flight followers)."""
    evictions: int
    expirations: int
    in_flight: int
    store_errors: int = 0
    """Errors of a shared store (gateway/redis_cache.py); the memory store has none."""


_MISSING: Any = object()


class ResponseCache(Generic[V]):
    """Bounded LRU + TTL store with single-flight computation per key (plain object, injected clock)."""

    def __init__(self, config: CacheConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._entries: OrderedDict[CacheKey, _Entry[V]] = OrderedDict()
        self._flights: dict[CacheKey, asyncio.Future[Any]] = {}
        self._bytes = 0
        self._hits = self._misses = self._coalesced = self._evictions = self._expirations = 0

    # ---- the store ----------------------------------------------------------------------------------
    def lookup(self, key: CacheKey) -> V | None:
        """The live answer stored under exactly `key`, refreshed as most recently used; else None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.clock.now() >= entry.expires_at:
            self._remove(key)
            self._expirations += 1
            return None
        self._entries.move_to_end(key)
        return entry.value

    def store(self, key: CacheKey, value: V, size: int) -> bool:
        """Keep `value` (of `size` bytes) under `key`, evicting the least recently used past the bounds.
        An answer larger than max_bytes is not kept (False)."""
        if size > self.config.max_bytes:
            return False
        if key in self._entries:
            self._remove(key)
        self._entries[key] = _Entry(value, size, self.clock.now() + self.config.ttl_s)
        self._bytes += size
        while len(self._entries) > self.config.max_entries or self._bytes > self.config.max_bytes:
            self._remove(next(iter(self._entries)))
            self._evictions += 1
        return True

    def drop_versions(self, keep: frozenset[int]) -> int:
        """Forget every answer of a version not in `keep` (after a rollout); returns how many."""
        stale = [k for k in self._entries if k.version not in keep]
        for key in stale:
            self._remove(key)
        return len(stale)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def reconfigure(self, config: CacheConfig) -> int:
        """A reload's new settings: each answer now expires ttl_s after it was computed (a shorter ttl
        never serves one past it) and the new bounds evict the least recently used. Returns how many
        answers were dropped."""
        shift, now, before = config.ttl_s - self.config.ttl_s, self.clock.now(), len(self._entries)
        self.config = config
        for entry in self._entries.values():
            entry.expires_at += shift
        for key in [k for k, e in self._entries.items() if now >= e.expires_at]:
            self._remove(key)
            self._expirations += 1
        while len(self._entries) > config.max_entries or self._bytes > config.max_bytes:
            self._remove(next(iter(self._entries)))
            self._evictions += 1
        return before - len(self._entries)

    def _remove(self, key: CacheKey) -> None:
        self._bytes -= self._entries.pop(key).size

    async def fetch(self, key: CacheKey) -> V | None:
        """`lookup`, awaited by single-flight; a shared store reads over the network here."""
        return self.lookup(key)

    async def keep(self, key: CacheKey, value: V, size: int) -> None:
        """`store`, awaited by single-flight; a shared store writes over the network here."""
        self.store(key, value, size)

    # ---- single-flight ------------------------------------------------------------------------------
    async def get_or_compute(
        self, key: CacheKey, compute: Callable[[], Awaitable[tuple[V, int]]]
    ) -> tuple[V, Lookup]:
        """The stored answer ("hit"), the answer of an identical computation in flight ("hit", after
        waiting for it), or this caller's own computation ("miss"), which `compute` returns with its
        size and which is stored. If the leader fails, its error goes to its caller only and each
        follower tries again. A store that cannot be reached answers with `compute` alone ("bypass")."""
        while True:
            flight = self._flights.get(key)
            if flight is None:
                try:
                    value = await self.fetch(key)
                except StoreUnavailable:
                    return (await compute())[0], "bypass"
                if value is not None:
                    self._hits += 1
                    return value, "hit"
                flight = self._flights.get(key)  # one may have started while a shared store answered
            if flight is None:
                self._misses += 1
                return await self._lead(key, compute), "miss"
            shared = await asyncio.shield(flight)  # a follower that leaves never cancels the leader
            if shared is not _MISSING:
                self._hits += 1
                self._coalesced += 1
                return shared, "hit"

    async def _lead(self, key: CacheKey, compute: Callable[[], Awaitable[tuple[V, int]]]) -> V:
        flight: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        outcome: Any = _MISSING  # stays so on error or cancellation: followers then try again
        try:
            value, size = await compute()
            outcome = value
            await self.keep(key, value, size)
            return value
        finally:
            del self._flights[key]
            flight.set_result(outcome)

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(
            entries=len(self._entries),
            bytes=self._bytes,
            hits=self._hits,
            misses=self._misses,
            coalesced=self._coalesced,
            evictions=self._evictions,
            expirations=self._expirations,
            in_flight=len(self._flights),
        )


def encoded_size(value: Any) -> int:
    """About how many bytes an answer holds: the length of its canonical encoding."""
    return len(_canonical.encode(value))
