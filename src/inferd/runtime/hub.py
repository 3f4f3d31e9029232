"""Where workers connect: handshake, then one read loop per connection feeding the model's runtime.

The same path serves local worker processes (Unix socket) and workers on other hosts (TCP). Every
connection is in the server's WorkerDirectory (runtime/membership.py) from its handshake until it
closes: handshaking there, then in its runtime's Membership.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Protocol

from inferd.clock import Clock
from inferd.config.identity import check_zone
from inferd.errors import NotFound
from inferd.runtime.contract import Runtime
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection

log = logging.getLogger("inferd.hub")

HEARTBEAT_S = 1.0


class PoolLinks(Protocol):
    """Where pool links go (a pool worker's `Hello(model="", pool=NAME)`): the server's pools."""

    def refusal(self, pool: str) -> str | None:
        """Why this server takes no link of that pool (it has no such pool); None: it takes it."""
        ...

    async def serve(self, hello: p.Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The link from its Welcome until it closes (the hub checked its protocol, token and zone)."""
        ...

    def close(self) -> None:
        """Close every pool link (the server stops)."""
        ...


class WorkerHub:
    def __init__(
        self,
        registry: ModelRegistry,
        clock: Clock,
        directory: WorkerDirectory,
        tokens: tuple[str, ...] = (),
        load_timeout_s: float = 120.0,
        silence_timeout_s: float = 0.0,
    ) -> None:
        self.registry = registry
        self.clock = clock
        self.tokens = tuple(t for t in tokens if t)
        """Accepted join tokens (the local workers' own, and the one for remote workers); none: open."""
        self.load_timeout_s = load_timeout_s
        self.silence_timeout_s = silence_timeout_s
        """The runtimes' heartbeat timeout, told to workers in Welcome (see Welcome.silence_timeout_s)."""
        self.directory = directory
        """Where each connection is, from its handshake on: the hub writes it, the runtimes keep their
        workers there, fleet control and the admin API read it."""
        self.load_failures: dict[str, str] = {}
        self._servers: list[asyncio.Server] = []
        self.on_first_batch: list[Callable[[WorkerConnection], None]] = []
        """Called when a worker completes its first batch: it did healthy work."""
        self.before_refusal: Callable[[], Awaitable[object]] | None = None
        """Awaited before a worker of a version not served here is turned away (for good), then the
        version is looked up again: a follower front end learns the owner's versions first."""
        self.pool_links: PoolLinks | None = None
        """The server's pools (pools/): a pool worker's pool link goes there; None: no pools."""

    async def listen_unix(self, path: str) -> None:
        self._servers.append(await asyncio.start_unix_server(self._handle, path=path, limit=2**20))

    async def listen_tcp(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Workers on other hosts join here: over TLS with `tls` (a handshake that fails, e.g. a worker
        that does not trust the certificate, only ends that connection), else over plain TCP."""
        server = await asyncio.start_server(
            self._handle, host, port, limit=2**20, ssl=tls, ssl_handshake_timeout=10.0 if tls else None
        )
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        if self.pool_links is not None:
            self.pool_links.close()
        for conn in self.directory.connections():
            conn.close()
        for server in self._servers:
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: WorkerConnection | None = None
        runtime: Runtime | None = None
        reason = "connection closed"
        try:
            async with asyncio.timeout(10.0):
                hello = await p.read_message(reader, p.MAX_HELLO_BYTES)
            if not isinstance(hello, p.Hello):
                return
            if hello.pool is not None and not hello.model:
                await self._pool_link(hello, reader, writer)
                return
            conn, runtime = await self._handshake(hello, reader, writer)
            if conn is None or runtime is None:
                return
            await self._read_loop(conn, runtime, reader)
        except p.ConnectionClosed as exc:
            reason = str(exc) or reason
        except Exception as exc:  # a broken worker must never take the hub down
            reason = f"protocol error: {exc!r}"
            log.exception("worker connection failed")
        finally:
            if conn is not None and runtime is not None:
                runtime.on_worker_lost(conn, reason)
            writer.close()

    async def _pool_link(self, hello: p.Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A pool worker's pool link (no model, no batches): to the server's pools, once admitted."""
        pool, pools = hello.pool or "", self.pool_links
        refusal = self._admission(hello)
        if not refusal:
            refusal = f"this server has no pools: pool {pool!r} is unknown" if pools is None else pools.refusal(pool)
        if refusal or pools is None:
            log.warning("refused pool worker %s (pid %d) of pool %s: %s", hello.worker_id, hello.pid, pool, refusal)
            writer.write(p.encode_frame(p.Welcome(accepted=False, reason=refusal or "no pools")))
            await writer.drain()
            return
        await pools.serve(hello, reader, writer)

    async def _handshake(
        self, hello: p.Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[WorkerConnection | None, Runtime | None]:
        refusal, runtime = self._resolve(hello)
        if runtime is None and self.before_refusal is not None and self._unknown_version(hello):
            await self.before_refusal()
            refusal, runtime = self._resolve(hello)
        if runtime is None:
            log.warning(
                "refused worker %s (pid %d) for model %s: %s",
                hello.worker_id,
                hello.pid,
                hello.model,
                refusal,
            )
            writer.write(p.encode_frame(p.Welcome(accepted=False, reason=refusal)))
            await writer.drain()
            return None, None
        conn = WorkerConnection(
            hello.worker_id,
            hello.model,
            hello.pid,
            hello.host,
            writer,
            connected_at=self.clock.now(),
            credits=0 if hello.credits else None,
            zone=hello.zone,
        )
        with self.directory.handshake(conn):  # released however it ends
            config_json = runtime.config.model_dump_json().encode()
            writer.write(
                p.encode_frame(
                    p.Welcome(
                        accepted=True,
                        model_config_json=config_json,
                        heartbeat_s=HEARTBEAT_S,
                        silence_timeout_s=self.silence_timeout_s,
                        credits=hello.credits,
                    )
                )
            )
            await writer.drain()
            async with asyncio.timeout(self.load_timeout_s):
                msg = await p.read_message(reader)
            if isinstance(msg, p.LoadFailed):
                self.load_failures[hello.model] = msg.message
                log.error("worker %s could not load model %s: %s", hello.worker_id, hello.model, msg.message)
                return None, None
            if not isinstance(msg, p.Ready):
                raise p.ConnectionClosed(f"expected ready, got {type(msg).__name__}")
            conn.version = msg.version
            conn.last_heartbeat = self.clock.now()
            self.load_failures.pop(hello.model, None)
            runtime.add_worker(conn)
            if not self._served(runtime):  # its version was dropped while it loaded: it goes too
                conn.close()
            return conn, runtime

    def _served(self, runtime: Runtime) -> bool:
        try:
            return self.registry.get(runtime.name, runtime.version) is runtime
        except NotFound:
            return False

    def _unknown_version(self, hello: p.Hello) -> bool:
        """A worker with a good token, of a model served here at a version not served (yet): worth one
        more read of the served state. Never for a bad token: a stranger must not make us read the store."""
        if self.tokens and not any(hmac.compare_digest(hello.token.encode(), t.encode()) for t in self.tokens):
            return False
        return hello.model in self.registry and hello.version not in (0, *self.registry.versions(hello.model))

    def _admission(self, hello: p.Hello) -> str:
        """Why any link of this worker is refused (its protocol, its token, its zone); "": none."""
        if hello.protocol != p.PROTOCOL_VERSION:
            return (
                f"worker protocol {hello.protocol} is not supported: this front end speaks protocol "
                f"{p.PROTOCOL_VERSION}; run the same inferd version on both sides"
            )
        if self.tokens and not any(
            hmac.compare_digest(hello.token.encode(), t.encode()) for t in self.tokens
        ):
            return "bad join token"
        if hello.zone is not None:
            try:
                check_zone(hello.zone)
            except ValueError as exc:
                return f"--zone: {exc}"
        return ""

    def _resolve(self, hello: p.Hello) -> tuple[str, Runtime | None]:
        """The runtime the worker serves (its model at its version, or the default version), or why not."""
        refusal = self._admission(hello)
        if refusal:
            return refusal, None
        try:
            runtime = self.registry.get(hello.model, hello.version or None)
        except NotFound as exc:
            if not self._unknown_version(hello):
                return exc.message, None
            served = self.registry.versions(hello.model)
            return (
                f"this server does not serve version {hello.version} of model {hello.model!r} (served "
                f"versions: {served}): start the worker with one of them as --model-version, or without it "
                f"to serve the default version ({self.registry.default_version(hello.model)})",
                None,
            )
        if not runtime.accepts_workers:
            return f"model {hello.model!r} is a {runtime.kind} model: it has no workers", None
        if hello.pool != runtime.config.pool:
            return pool_mismatch(hello.model, hello.pool, runtime.config.pool), None
        return "", runtime

    async def _read_loop(
        self, conn: WorkerConnection, runtime: Runtime, reader: asyncio.StreamReader
    ) -> None:
        while True:
            msg = await p.read_message(reader)
            if isinstance(msg, p.Heartbeat):
                conn.last_heartbeat = self.clock.now()
                conn.high_water = msg.high_water
            elif isinstance(msg, p.Credit):
                conn.on_credit(msg, self.clock.now())
                runtime.on_message(conn, msg)
            elif isinstance(msg, p.LoadFailed):
                raise p.ConnectionClosed(f"worker failed: {msg.message}")
            elif isinstance(msg, p.Drain):  # it drains (SIGTERM): no new work; the answer, a Drain,
                runtime.drain_worker(conn)  # follows the last work sent it (a runtime sends it once)
            else:
                runtime.on_message(conn, msg)
                if conn.completed_batches == 1:
                    for hook in self.on_first_batch:
                        hook(conn)


def pool_mismatch(model: str, worker_pool: str | None, model_pool: str | None) -> str:
    """Why a model link whose pool is not its model's is refused."""
    if model_pool is None:
        return f"model {model!r} is in no pool (it has workers of its own): a worker of pool {worker_pool!r} does not serve it"
    if worker_pool is None:
        return (
            f"model {model!r} is served by pool {model_pool!r}: only that pool's workers serve it "
            f"(`inferd worker --pool {model_pool}`)"
        )
    return f"model {model!r} is in pool {model_pool!r}, not in pool {worker_pool!r}"
