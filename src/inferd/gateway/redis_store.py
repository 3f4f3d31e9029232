"""Quota state in Redis, shared by every front end (`[gateway] redis_url`; the inferd[redis] extra).

Two Lua scripts, each atomic on the Redis server:

* READ returns a tenant's state and the server's TIME in one round trip. Every front end uses that one
  clock, so their decisions agree on what "now" is.
* CAS writes the new state only if the key still holds what READ returned, else returns 0.

`update` runs READ, computes the new state in Python with the quota policy (the one implementation of
the arithmetic), and CASes it; a lost race (another front end wrote in between) runs the step again on
the fresh state. Losing means someone else's update went through, so the front ends as a whole always
progress; one caller gives up after MAX_ATTEMPTS with a retryable Overloaded.
"""

from __future__ import annotations

import logging
from typing import Any

from inferd.clock import Clock, MonotonicClock
from inferd.config import ConfigError
from inferd.errors import Overloaded
from inferd.gateway.quota_store import InProcessStore, QuotaSettings, QuotaStore, Step, StoreUnavailable, T
from inferd.gateway.quotas import QuotaState

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 200

READ = """
local state = redis.call('GET', KEYS[1])
local time = redis.call('TIME')
return {state, time[1], time[2]}
"""

CAS = """
local current = redis.call('GET', KEYS[1]) or ''
if current ~= ARGV[1] then
  return 0
end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
"""


class RedisStore:
    """Quota state in Redis; see the module docstring."""

    def __init__(self, url: str, timeout_ms: int = 250) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import TimeoutError as RedisTimeoutError
        except ImportError:
            raise ConfigError(
                "[gateway] redis_url needs the redis package: install inferd with the redis extra "
                "(pip install 'inferd[redis]'), or remove redis_url to keep quotas in process"
            ) from None
        self.url = url
        self._unreachable: tuple[type[BaseException], ...] = (
            RedisConnectionError,
            RedisTimeoutError,
            OSError,
        )
        timeout = timeout_ms / 1000
        self._client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
        )
        self._read = self._client.register_script(READ)
        self._cas = self._client.register_script(CAS)
        self.conflicts = 0
        """CAS attempts lost to another front end's update (a measure of contention)."""

    async def update(self, key: str, step: Step[T], keep_s: float) -> T:
        keep_ms = str(max(1, round(keep_s * 1000)))
        try:
            for _ in range(MAX_ATTEMPTS):
                raw, secs, micros = await self._read(keys=[key])
                result, new = step(QuotaState.decode(raw), int(secs) + int(micros) / 1_000_000)
                if await self._cas(
                    keys=[key], args=[raw or "", "" if new is None else new.encode(), keep_ms]
                ):
                    return result
                self.conflicts += 1
        except self._unreachable as exc:
            raise StoreUnavailable(f"redis at {self.url}: {type(exc).__name__}: {exc}") from exc
        raise Overloaded(
            f"quota state of {key!r} changed under {MAX_ATTEMPTS} attempts in a row (other front ends "
            "updating it): try again",
            retry_after_s=0.1,
            reason="quota_contention",
        )

    async def close(self) -> None:
        await self._client.aclose()


def open_quota_store(settings: QuotaSettings, clock: Clock | None = None) -> QuotaStore:
    """The store the settings ask for: Redis when redis_url is set, else in process."""
    if settings.redis_url is None:
        return InProcessStore(clock or MonotonicClock())
    log.info(
        "quota state in redis at %s (timeout %d ms; when unreachable: %s)",
        settings.redis_url,
        settings.redis_timeout_ms,
        settings.on_store_error,
    )
    return RedisStore(settings.redis_url, settings.redis_timeout_ms)
