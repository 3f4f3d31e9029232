"""The response cache in Redis, shared by every front end on `[gateway] redis_url`:

    [models.sim]
    cache = { enabled = true, store = "redis", ttl_s = 60, max_entries = 10000 }

Keys. One entry per answer, `inferd:cache:{MODEL:vVERSION}:TENANT:DIGEST`: the model, the served
version, the tenant's name ("_" for anonymous callers; tenant names start with a letter or digit) and
the BLAKE2b digest of the canonical request (gateway/cache.py). Never an API key or a raw request.
The version is part of the key, so a front end serving a new version never reads the old version's
answers; those are left to expire (other front ends may still serve that version during a rollout).
The `{...}` hash tag keeps one model version's keys in one Redis Cluster slot.

Values. The answer encoded with msgpack (numpy arrays as an extension type; never pickle, so a
shared Redis cannot make a front end run code), stored with a Redis TTL of `ttl_s`.

Bounds. Each model version has a sorted set of its entries scored by last use (Redis server time in
microseconds, one clock for every front end), a hash of their sizes and a byte counter. The store script
adds an entry and then pops the least recently used until `max_entries` and `max_bytes` hold again, all
atomically on the Redis server; so the bounds hold per model version across front ends, as the memory
store's do in one. An entry that expired on its own is dropped from the bookkeeping when it is next
read, or by the store script once unused for `ttl_s`; until then it still counts against the bounds (the
bounds err on the side of evicting early). Redis's own `maxmemory` stays the operator's backstop for the
whole instance.

Outages. A Redis error or timeout (`[gateway] redis_timeout_ms`) is counted per model
(inferd_cache_store_errors_total) and the request is answered without the cache ("bypass"); for
RETRY_AFTER_S after an error the store is not asked at all, so an outage costs one timeout per
second, not one per request. Single-flight stays in process (per front end and tenant): identical
requests on two front ends may both compute, and both store the same answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.config.cache import CacheConfig
from inferd.gateway.cache import CacheKey, CacheStatistics, ResponseCache, StoreUnavailable

log = logging.getLogger(__name__)

V = TypeVar("V")
KEY_PREFIX = "inferd:cache:"
RETRY_AFTER_S = 1.0
"""After a store error, how long the store is left alone (requests bypass the cache meanwhile)."""
PRUNE_LIMIT = 64
"""Most long-unused entries one store script forgets (bounds its run time on the Redis server)."""

FETCH = """
local value = redis.call('GET', KEYS[1])
if not value then
  local size = redis.call('HGET', KEYS[3], KEYS[1])
  if not size then
    return 0
  end
  redis.call('HDEL', KEYS[3], KEYS[1])
  redis.call('ZREM', KEYS[2], KEYS[1])
  redis.call('DECRBY', KEYS[4], size)
  return 1
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], 'XX', t[1] * 1000000 + t[2], KEYS[1])
return value
"""
"""KEYS: entry, lru, sizes, bytes. The value (refreshed as most recently used), else 0 (absent) or 1
(it had expired: dropped from the bookkeeping)."""

KEEP = """
local function forget(key)
  local size = redis.call('HGET', KEYS[3], key) or 0
  redis.call('HDEL', KEYS[3], key)
  redis.call('ZREM', KEYS[2], key)
  redis.call('DEL', key)
  return redis.call('DECRBY', KEYS[4], size)
end
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local ttl = tonumber(ARGV[2])
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then
  redis.call('DECRBY', KEYS[4], old)
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], ARGV[5])
local total = redis.call('INCRBY', KEYS[4], ARGV[5])
local expired = 0
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl * 1000, 'LIMIT', 0, ARGV[6])) do
  total = forget(key)
  expired = expired + 1
end
local evicted = 0
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[3]) or total > tonumber(ARGV[4]) do
  total = forget(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
  evicted = evicted + 1
end
for i = 2, 4 do
  redis.call('PEXPIRE', KEYS[i], ttl)
end
return {redis.call('ZCARD', KEYS[2]), total, expired, evicted}
"""
"""KEYS: entry, lru, sizes, bytes; ARGV: value, ttl ms, max entries, max bytes, size, prune limit.
Returns (entries, bytes) held after it, and how many it forgot as expired and evicted."""


# ---- the codec ------------------------------------------------------------------------------------
_ARRAY, _OBJECT_ARRAY = 1, 2
_plain = msgspec.msgpack.Encoder()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return msgspec.msgpack.Ext(_OBJECT_ARRAY, _plain.encode((obj.shape, obj.ravel().tolist())))
        raw = np.ascontiguousarray(obj).tobytes()
        return msgspec.msgpack.Ext(_ARRAY, _plain.encode((obj.dtype.str, obj.shape, raw)))
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot keep a {type(obj).__name__} in the redis cache")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _ARRAY:
        dtype, shape, raw = msgspec.msgpack.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _OBJECT_ARRAY:
        shape, items = msgspec.msgpack.decode(data)
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    raise ValueError(f"unknown msgpack extension {code} in a cached answer")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode_answer(value: Any) -> bytes:
    """An answer as stored in Redis: msgpack, numpy arrays as extensions (tuples come back as lists)."""
    return _encoder.encode(value)


def decode_answer(raw: bytes) -> Any:
    return _decoder.decode(raw)


# ---- the connection and its health ----------------------------------------------------------------
class StoreHealth:
    """Whether to ask the store now: not for `retry_after_s` after an error (plain object, injected
    clock). Logs when the store goes down and when it answers again, once each."""

    def __init__(self, clock: Clock, what: str, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.clock = clock
        self.what = what
        self.retry_after_s = retry_after_s
        self.up = True
        self._retry_at = 0.0

    def usable(self) -> bool:
        return self.clock.now() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        self._retry_at = self.clock.now() + self.retry_after_s
        if self.up:
            self.up = False
            log.warning(
                "response cache: %s unreachable (%s: %s): answering without it",
                self.what,
                type(exc).__name__,
                exc,
            )

    def answered(self) -> None:
        if not self.up:
            self.up = True
            log.info("response cache: %s answers again", self.what)


class RedisCacheClient:
    """The Redis connection of every Redis-backed cache store of one front end, and its health."""

    def __init__(self, url: str, clock: Clock, timeout_ms: int = 250) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.exceptions import RedisError
        except ImportError:
            raise ConfigError(
                'cache.store = "redis" needs the redis package: install inferd with the redis extra '
                "(pip install 'inferd[redis]'), or use cache.store = \"memory\""
            ) from None
        self.url = url
        self.errors: tuple[type[BaseException], ...] = (RedisError, OSError)
        timeout = timeout_ms / 1000
        self.client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self.fetch = self.client.register_script(FETCH)
        self.keep = self.client.register_script(KEEP)
        self.health = StoreHealth(clock, f"redis at {url}")
        log.info("response cache: shared answers in redis at %s (timeout %d ms)", url, timeout_ms)

    async def close(self) -> None:
        await self.client.aclose()


class _Cached(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def cache(self) -> CacheConfig: ...


def check_cache_stores(models: Iterable[_Cached], redis_url: str | None) -> None:
    """A model caching in Redis needs `[gateway] redis_url`: refused before start, naming the fix."""
    for m in models:
        if m.cache.enabled and m.cache.store == "redis":
            redis_url_for(m.name, redis_url)


def redis_url_for(model: str, redis_url: str | None) -> str:
    """`redis_url`, which a model with cache.store = "redis" needs (else a ConfigError naming the fix)."""
    if redis_url is None:
        raise ConfigError(
            f'model {model!r} has cache.store = "redis" but [gateway] redis_url is not set: set '
            '[gateway] redis_url = "redis://HOST:6379/0", or use cache.store = "memory"'
        )
    return redis_url


# ---- the store ------------------------------------------------------------------------------------
class RedisResponseCache(ResponseCache[V]):
    """One model version's answers in Redis (see the module docstring); single-flight from
    ResponseCache, in process. `on_error(exc)` hears of every store error."""

    def __init__(
        self,
        config: CacheConfig,
        clock: Clock,
        redis: RedisCacheClient,
        scope: tuple[str, int],
        on_error: Callable[[BaseException], None],
    ) -> None:
        super().__init__(config, clock)
        self.redis = redis
        self.on_error = on_error
        model, version = scope
        self._scope = f"{KEY_PREFIX}{{{model}:v{version}}}"
        self._held = (0, 0)
        self._store_errors = self._evicted = self._expired = 0

    def keys(self, key: CacheKey) -> list[str]:
        """The Redis keys of `key`: its entry, then its model version's lru set, sizes and byte count."""
        entry = f"{self._scope}:{key.tenant or '_'}:{key.digest.hex()}"
        return [entry, f"{self._scope}:lru", f"{self._scope}:sizes", f"{self._scope}:bytes"]

    async def fetch(self, key: CacheKey) -> V | None:
        if not self.redis.health.usable():
            raise StoreUnavailable(f"{self.redis.health.what} is down")
        try:
            raw = await self.redis.fetch(keys=self.keys(key))
            value = decode_answer(raw) if isinstance(raw, bytes) else None
        except (*self.redis.errors, msgspec.DecodeError, ValueError) as exc:
            self._failed(exc)
            raise StoreUnavailable(f"{self.redis.health.what}: {exc}") from exc
        self.redis.health.answered()
        self._expired += raw == 1
        return value

    async def keep(self, key: CacheKey, value: V, size: int) -> None:
        """Store the answer (its size: its encoded length), unless that is over max_bytes; a store error
        only counts."""
        raw = encode_answer(value)
        if len(raw) > self.config.max_bytes or not self.redis.health.usable():
            return
        ttl_ms = max(1, round(self.config.ttl_s * 1000))
        args = [raw, ttl_ms, self.config.max_entries, self.config.max_bytes, len(raw), PRUNE_LIMIT]
        try:
            entries, held, expired, evicted = await self.redis.keep(keys=self.keys(key), args=args)
        except self.redis.errors as exc:
            self._failed(exc)
            return
        self.redis.health.answered()
        self._held = (int(entries), int(held))
        self._expired += int(expired)
        self._evicted += int(evicted)

    def _failed(self, exc: BaseException) -> None:
        self._store_errors += 1
        self.redis.health.failed(exc)
        self.on_error(exc)

    def statistics(self) -> CacheStatistics:
        """Entries and bytes as the last store script saw them (every front end's answers together)."""
        own = super().statistics()
        entries, held = self._held
        return CacheStatistics(
            entries=entries,
            bytes=held,
            hits=own.hits,
            misses=own.misses,
            coalesced=own.coalesced,
            evictions=self._evicted,
            expirations=self._expired,
            in_flight=own.in_flight,
            store_errors=self._store_errors,
        )
