"""The store of front ends on many hosts, in Redis (`[cluster] store` or `--store`; the inferd[redis]
extra, imported only when a store URL is configured).

Keys, all under the hash tag `{NAME}` (`[cluster] name`) so that one cluster's keys share one Redis
Cluster slot and the scripts may touch several:
- `{NAME}:doc:DOC`: a hash (rev, body); a document written with a ttl expires with PEXPIRE.
- `{NAME}:revs`: a hash DOC -> the document's last revision, never expiring: a document that expired or
  was deleted and is written again goes on from it (a reader never sees one revision twice for other
  bytes); its fields also list the documents for read_prefix.
- `{NAME}:lease:LEASE`: a hash (holder, epoch) that expires with the grant (PEXPIRE).
- `{NAME}:epoch:LEASE`: the lease's last epoch, INCR'd at each new grant and never expiring: epochs never
  go back.
- `{NAME}:changes`: the channel where every write and delete publishes the document's name.

Compare-and-set, fencing and leases are Lua scripts (redis-py's register_script: EVALSHA, loaded again on
NOSCRIPT), atomic on the server; each write's PUBLISH is inside its script, so no write goes unnotified
to a watcher that is subscribed. Time is the Redis server's own (PEXPIRE, PTTL): every front end agrees on
when a lease or a document expires. redis-py's retries are off (a write retried after its answer was lost
would be applied twice); every call has one deadline, and a Redis that does not answer within it raises
StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from inferd.cluster.store import Fenced, Grant, RevisionConflict, StoreError, StoreUnavailable, Versioned
from inferd.config import ConfigError

log = logging.getLogger("inferd.cluster")

WATCH_KEEPALIVE_S = 1.0
"""An idle subscription PINGs this often."""
WATCH_SILENCE_S = 5.0
"""A subscription that heard nothing this long (not even its PONG) is given up: StoreUnavailable."""

# KEYS: doc, revs, lease of the fence; ARGV: doc name, body, expect ('' none), fence holder ('' none),
# fence epoch, ttl ms ('' none), channel
WRITE = """
if ARGV[4] ~= '' then
  local cur = redis.call('HMGET', KEYS[3], 'holder', 'epoch')
  if cur[1] ~= ARGV[4] or cur[2] ~= ARGV[5] then
    return {'fenced', cur[1] or '', cur[2] or '0', redis.call('PTTL', KEYS[3])}
  end
end
local rev = tonumber(redis.call('HGET', KEYS[1], 'rev') or '0')
if ARGV[3] ~= '' and tonumber(ARGV[3]) ~= rev then
  return {'conflict', rev}
end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local new = math.max(rev, last) + 1
redis.call('HSET', KEYS[1], 'rev', new, 'body', ARGV[2])
if ARGV[6] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
else
  redis.call('PERSIST', KEYS[1])
end
redis.call('HSET', KEYS[2], ARGV[1], new)
redis.call('PUBLISH', ARGV[7], ARGV[1])
return {'ok', new}
"""

# KEYS: doc, lease of the fence; ARGV: doc name, fence holder ('' none), fence epoch, channel
DELETE = """
if ARGV[2] ~= '' then
  local cur = redis.call('HMGET', KEYS[2], 'holder', 'epoch')
  if cur[1] ~= ARGV[2] or cur[2] ~= ARGV[3] then
    return {'fenced', cur[1] or '', cur[2] or '0', redis.call('PTTL', KEYS[2])}
  end
end
if redis.call('DEL', KEYS[1]) == 1 then
  redis.call('PUBLISH', ARGV[4], ARGV[1])
end
return {'ok', 0}
"""

# KEYS: lease, its epoch counter; ARGV: holder, ttl ms. The epoch granted, or nil while another holds it.
ACQUIRE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'epoch')
if cur[1] then
  if cur[1] ~= ARGV[1] then
    return false
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(cur[2])
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'epoch', epoch)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return epoch
"""

# KEYS: lease; ARGV: holder, epoch
RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'epoch')
if cur[1] == ARGV[1] and cur[2] == ARGV[2] then
  redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: lease. {holder, epoch, ms left}, or nil when nobody holds it.
HOLDER = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'epoch')
if not cur[1] then
  return false
end
return {cur[1], cur[2], redis.call('PTTL', KEYS[1])}
"""


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


def _current(lease: str, reply: list[Any]) -> Grant | None:
    """The lease's grant from a script's (holder, epoch, ms left), None when nobody holds it."""
    holder, epoch, left_ms = reply
    if not holder:
        return None
    return Grant(lease, holder.decode(), int(epoch), max(0, int(left_ms)) / 1000)


def without_password(url: str) -> str:
    """`url` as logs and answers may show it: without the user and password, if it holds them."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


class RedisStore:
    """A `Store` in Redis; see the module's doc. `password` comes from the environment only
    (INFERD_STORE_PASSWORD, cluster/config.py)."""

    def __init__(
        self, url: str, name: str = "inferd", timeout_s: float = 0.5, password: str | None = None,
        ca_file: Path | None = None,
    ) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import RedisError
            from redis.exceptions import TimeoutError as RedisTimeoutError
        except ImportError:
            raise ConfigError(
                "a redis:// cluster store needs the redis package: install inferd with the redis extra "
                "(pip install 'inferd[redis]'), or drop [cluster] store / --store"
            ) from None
        self.url = url
        self.where = without_password(url)
        """The URL as errors and logs name it."""
        self.name = name
        self.timeout_s = timeout_s
        self.channel = f"{{{name}}}:changes"
        self._refused: type[BaseException] = RedisError
        self._unreachable: tuple[type[BaseException], ...] = (
            RedisConnectionError, RedisTimeoutError, OSError, TimeoutError,
        )
        options: dict[str, Any] = {}
        if password is not None:
            options["password"] = password
        if ca_file is not None and urlsplit(url).scheme == "rediss":
            options["ssl_ca_certs"] = str(ca_file)
        self._client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            **options,
        )
        self._write = self._client.register_script(WRITE)
        self._delete = self._client.register_script(DELETE)
        self._acquire = self._client.register_script(ACQUIRE)
        self._release = self._client.register_script(RELEASE)
        self._holder = self._client.register_script(HOLDER)

    def _key(self, kind: str, name: str = "") -> str:
        return f"{{{self.name}}}:{kind}" + (f":{name}" if name else "")

    async def _run(self, call: Any, wait_s: float = 0.0) -> Any:
        """One call within the deadline (plus `wait_s` it waits on purpose); StoreUnavailable when Redis
        does not answer."""
        try:
            async with asyncio.timeout(self.timeout_s + wait_s):
                return await call
        except self._unreachable as exc:
            raise StoreUnavailable(f"the cluster store at {self.where}: {type(exc).__name__}: {exc}") from exc
        except self._refused as exc:  # answered with an error (a wrong password, a key of another type)
            raise StoreError(f"the cluster store at {self.where} refused: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        await self._run(self._client.ping())

    async def read(self, doc: str) -> Versioned | None:
        revision, body = await self._run(self._client.hmget(self._key("doc", doc), "rev", "body"))
        return None if revision is None else Versioned(int(revision), body)

    async def read_prefix(self, prefix: str) -> dict[str, Versioned]:
        names = sorted(
            n for raw in await self._run(self._client.hkeys(self._key("revs")))
            if (n := raw.decode()).startswith(prefix)
        )
        if not names:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(self._key("doc", name), "rev", "body")
        found = await self._run(pipe.execute())
        return {name: Versioned(int(rev), body) for name, (rev, body) in zip(names, found, strict=True) if rev}

    async def write(
        self, doc: str, body: bytes, *, expect: int | None = None, fence: Grant | None = None,
        ttl_s: float | None = None,
    ) -> int:
        keys = [self._key("doc", doc), self._key("revs"), self._key("lease", fence.lease if fence else doc)]
        args = [
            doc, bytes(body), "" if expect is None else str(expect), fence.holder if fence else "",
            str(fence.epoch) if fence else "", "" if ttl_s is None else _ms(ttl_s), self.channel,
        ]
        reply = await self._run(self._write(keys=keys, args=args))
        outcome = reply[0].decode()
        if outcome == "conflict":
            raise RevisionConflict(doc, -1 if expect is None else expect, int(reply[1]))
        if outcome == "fenced":
            assert fence is not None  # only a fenced write is answered "fenced"
            raise Fenced(fence, _current(fence.lease, reply[1:]))
        return int(reply[1])

    async def delete(self, doc: str, *, fence: Grant | None = None) -> None:
        keys = [self._key("doc", doc), self._key("lease", fence.lease if fence else doc)]
        args = [doc, fence.holder if fence else "", str(fence.epoch) if fence else "", self.channel]
        reply = await self._run(self._delete(keys=keys, args=args))
        if reply[0].decode() == "fenced":
            assert fence is not None
            raise Fenced(fence, _current(fence.lease, reply[1:]))

    async def acquire(self, lease: str, holder: str, ttl_s: float) -> Grant | None:
        keys = [self._key("lease", lease), self._key("epoch", lease)]
        epoch = await self._run(self._acquire(keys=keys, args=[holder, _ms(ttl_s)]))
        return None if epoch is None else Grant(lease, holder, int(epoch), ttl_s)

    async def release(self, grant: Grant) -> None:
        keys = [self._key("lease", grant.lease)]
        await self._run(self._release(keys=keys, args=[grant.holder, str(grant.epoch)]))

    async def holder(self, lease: str) -> Grant | None:
        reply = await self._run(self._holder(keys=[self._key("lease", lease)]))
        return None if reply is None else _current(lease, reply)

    async def watch(self) -> AsyncIterator[str]:
        pubsub = self._client.pubsub()
        loop = asyncio.get_running_loop()
        try:
            await self._run(pubsub.subscribe(self.channel))
            heard = loop.time()
            while True:
                message = await self._run(
                    pubsub.get_message(ignore_subscribe_messages=True, timeout=WATCH_KEEPALIVE_S),
                    WATCH_KEEPALIVE_S,
                )
                if message is None:
                    if loop.time() - heard > WATCH_SILENCE_S:
                        raise StoreUnavailable(
                            f"the cluster store at {self.where}: its subscription heard nothing in "
                            f"{WATCH_SILENCE_S} s"
                        )
                    await self._run(pubsub.ping())
                    continue
                heard = loop.time()
                if message["type"] == "message":
                    yield message["data"].decode()
        finally:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await pubsub.aclose()
            except self._unreachable as exc:  # cleanup only: the subscription is gone either way
                log.debug("closing a subscription to %s: %s", self.where, exc)

    async def close(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._client.aclose()
        except self._unreachable as exc:
            log.debug("closing the cluster store's connections to %s: %s", self.where, exc)
