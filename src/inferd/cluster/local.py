"""The store of `inferd serve --frontends N` on one host: the parent process keeps one MemoryState (on a
MonotonicClock) and serves it to its front ends over a private Unix socket in its socket folder
(FrontendPlan.store_path()); each front end reaches it through `LocalStoreClient`, a `Store`. One host
needs neither Redis nor the redis package, and the front ends see the same semantics as on many hosts.

Where the server runs: in a thread of the parent, with an asyncio loop of its own. The parent's main
thread stays the plain synchronous watcher it is (fork, wait, restart). A thread, not a child process,
because the state must outlive everything but the parent: front ends restart and find what they served;
an unexpected error in the server's loop is logged and the loop is started again on the same
MemoryState, where a crashed process would lose it. The front ends forked later inherit copies of the
server's sockets: each closes them at once (`LocalStoreServer.close_inherited`), so that a connection the
server closes is closed for its client too.

The wire: each message is a frame, a 4-byte big-endian length then msgpack (msgspec). A call is one
`Request` and one `Answer` on a connection the client keeps (a small pool); every request carries the
plan's token, compared with hmac.compare_digest. `watch` is a connection of its own on which the server
pushes document names, and an empty name every WATCH_KEEPALIVE_S so that a client notices a server gone
silent. Errors cross as (code, message) and are raised again as the store's own (RevisionConflict,
Fenced); a call not answered within the client's timeout raises StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator

import msgspec

from inferd.clock import Clock
from inferd.cluster.memory import WATCH_QUEUE, MemoryState
from inferd.cluster.store import Fenced, Grant, RevisionConflict, StoreError, StoreUnavailable, Versioned

log = logging.getLogger("inferd.cluster")

MAX_FRAME = 16 * 1024 * 1024
"""The largest message either side accepts (a document is a few KiB to a few MiB)."""
POOL = 4
"""Connections one client keeps for its calls: as many calls run at once, the others wait their turn."""
CALL_TIMEOUT_S = 2.0
"""A call's default deadline (the server answers from memory: past this it is stuck or gone)."""
WATCH_KEEPALIVE_S = 1.0
"""The server's empty notification on an idle watch connection."""
WATCH_SILENCE_S = 5.0
"""A watch connection silent this long (no keepalive either) is given up: StoreUnavailable."""
RESTART_DELAY_S = 0.5
"""How long the parent waits before starting a failed store server again."""
START_TIMEOUT_S = 10.0


class Request(msgspec.Struct, omit_defaults=True):
    token: str
    op: str
    """read, read_prefix, write, delete, acquire, release, holder, watch."""
    doc: str = ""
    body: bytes = b""
    expect: int | None = None
    fence: Grant | None = None
    ttl_s: float | None = None
    lease: str = ""
    holder: str = ""
    grant: Grant | None = None


class Answer(msgspec.Struct, omit_defaults=True):
    error: str = ""
    """"" (done), "conflict", "fenced" or "refused"."""
    message: str = ""
    found: Versioned | None = None
    docs: dict[str, Versioned] = {}
    revision: int = 0
    """write: the new revision; conflict: the document's actual one."""
    grant: Grant | None = None
    """acquire, holder: the grant; fenced: the lease's current one."""


class FrameError(Exception):
    """A frame over MAX_FRAME or one that does not decode."""


_encode = msgspec.msgpack.Encoder().encode
_requests = msgspec.msgpack.Decoder(Request)
_answers = msgspec.msgpack.Decoder(Answer)
_names = msgspec.msgpack.Decoder(str)


def frame(message: object) -> bytes:
    body = _encode(message)
    return len(body).to_bytes(4, "big") + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_FRAME:
        raise FrameError(f"a frame of {size} bytes (the most is {MAX_FRAME})")
    return await reader.readexactly(size)


class LocalStoreServer:
    """The parent's store: a MemoryState served on `path` from a thread of its own (see the module's doc).
    `start()` returns once the socket takes connections; `stop()` ends the thread."""

    def __init__(self, path: str, token: str, clock: Clock) -> None:
        self.path = path
        self.token = token.encode()
        self.state = MemoryState(clock)
        """Kept across restarts of the server's loop."""
        self.failures = 0
        self._watchers: set[asyncio.Queue[str]] = set()
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._fds: dict[int, int] = {}
        """The server's sockets (fd -> inode), for a forked front end to close (close_inherited)."""
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inferd-store", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise StoreError(f"the local store on {self.path} did not start within {START_TIMEOUT_S} s")
        log.info("the front ends' shared store serves on %s", self.path)

    def stop(self) -> None:
        self._stopping.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop ended already
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)

    def close_inherited(self) -> None:
        """In a process forked from the parent: close this process's copies of the server's sockets. Each
        fd is closed only if it is still the socket noted (same inode): one the server's loop closed just
        before the fork may have been reused by then."""
        for fd, inode in list(self._fds.items()):
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == inode:
                    os.close(fd)

    def _note(self, fd: int) -> None:
        self._fds[fd] = os.fstat(fd).st_ino

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                asyncio.run(self._serve())
            except Exception:
                self.failures += 1
                log.exception("the local store server failed; starting it again (its state is kept)")
                self._stopping.wait(RESTART_DELAY_S)
            finally:
                self._ready.set()  # start() waits no longer (a failure is logged above)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._watchers.clear()
        self._connections.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        fd = listener.fileno()
        self._note(fd)
        try:
            server = await asyncio.start_unix_server(self._connection, sock=listener)
            async with server:
                self._ready.set()
                if not self._stopping.is_set():
                    await self._stop.wait()
                await self._close_connections()
        finally:
            self._fds.pop(fd, None)  # (the server closed the listener on its way out: its fileno is -1)
            listener.close()

    async def _close_connections(self) -> None:
        """At stop: end every connection so that its handler returns (one the loop's end cancelled would
        be reported as an error by asyncio's streams); a watcher wakes up and finds its connection gone."""
        for writer in self._connections.values():
            writer.close()
        for queue in self._watchers:
            if not queue.full():
                queue.put_nowait("")
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=START_TIMEOUT_S)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fd = writer.get_extra_info("socket").fileno()
        self._note(fd)
        task = asyncio.current_task()
        assert task is not None  # asyncio's streams run each connection in a task
        self._connections[task] = writer
        try:
            while True:
                request = _requests.decode(await read_frame(reader))
                if not hmac.compare_digest(request.token.encode(), self.token):
                    writer.write(frame(Answer(error="refused", message="a request without the plan's token")))
                    await writer.drain()
                    return
                if request.op == "watch":
                    await self._push(writer)
                    return
                writer.write(frame(self._answer(request)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except (FrameError, msgspec.DecodeError) as exc:
            log.warning("the local store closed a connection that sent a bad frame: %s", exc)
        except Exception:  # a bug in answering: this connection ends, the server and its state go on
            log.exception("the local store failed answering a connection; it is closed")
        finally:
            self._connections.pop(task, None)
            self._fds.pop(fd, None)
            writer.close()

    def _answer(self, request: Request) -> Answer:
        state = self.state
        try:
            match request.op:
                case "read":
                    return Answer(found=state.read(request.doc))
                case "read_prefix":
                    return Answer(docs=state.read_prefix(request.doc))
                case "write":
                    revision = state.write(request.doc, request.body, request.expect, request.fence, request.ttl_s)
                    self._notify(request.doc)
                    return Answer(revision=revision)
                case "delete":
                    if state.delete(request.doc, request.fence):
                        self._notify(request.doc)
                    return Answer()
                case "acquire":
                    return Answer(grant=state.acquire(request.lease, request.holder, request.ttl_s or 0.0))
                case "release":
                    if request.grant is not None:
                        state.release(request.grant)
                    return Answer()
                case "holder":
                    return Answer(grant=state.holder(request.lease))
                case _:
                    return Answer(error="refused", message=f"no operation {request.op!r}")
        except RevisionConflict as exc:
            return Answer(error="conflict", message=str(exc), revision=exc.actual)
        except Fenced as exc:
            return Answer(error="fenced", message=str(exc), grant=exc.current)

    def _notify(self, doc: str) -> None:
        for queue in self._watchers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(doc)

    async def _push(self, writer: asyncio.StreamWriter) -> None:
        """A watch connection: its answer, then every document name written or deleted from now on."""
        queue: asyncio.Queue[str] = asyncio.Queue(WATCH_QUEUE)
        self._watchers.add(queue)
        try:
            writer.write(frame(Answer()))
            await writer.drain()
            while True:
                try:
                    async with asyncio.timeout(WATCH_KEEPALIVE_S):
                        name = await queue.get()
                except TimeoutError:
                    name = ""
                writer.write(frame(name))
                await writer.drain()
        finally:
            self._watchers.discard(queue)


_UNAVAILABLE = (OSError, EOFError, TimeoutError, FrameError, msgspec.DecodeError)
"""What a call that got no answer raises (EOFError: asyncio.IncompleteReadError, a connection closed)."""


def _close(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        writer.close()


class LocalStoreClient:
    """A `Store` on the parent's socket (`path`), for one front end."""

    def __init__(self, path: str, token: str, timeout_s: float = CALL_TIMEOUT_S, pool: int = POOL) -> None:
        self.path = path
        self.token = token
        self.timeout_s = timeout_s
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(pool)

    async def _call(self, request: Request) -> Answer:
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            try:
                async with asyncio.timeout(self.timeout_s):
                    if conn is None:
                        conn = await asyncio.open_unix_connection(self.path)
                    conn[1].write(frame(request))
                    await conn[1].drain()
                    answer = _answers.decode(await read_frame(conn[0]))
            except _UNAVAILABLE as exc:
                _close(None if conn is None else conn[1])
                raise StoreUnavailable(f"the local store on {self.path}: {type(exc).__name__}: {exc}") from exc
            except BaseException:  # cancelled mid-call: the answer may still come, on no one's behalf
                _close(None if conn is None else conn[1])
                raise
            self._idle.append(conn)
        if answer.error == "conflict":
            raise RevisionConflict(request.doc, request.expect if request.expect is not None else -1, answer.revision)
        if answer.error == "fenced":
            fence = request.fence if request.fence is not None else request.grant
            assert fence is not None  # only fenced calls are answered "fenced"
            raise Fenced(fence, answer.grant)
        if answer.error:
            raise StoreError(f"the local store on {self.path} refused {request.op}: {answer.message}")
        return answer

    def _request(self, op: str, **fields: object) -> Request:
        return Request(token=self.token, op=op, **fields)  # type: ignore[arg-type]

    async def read(self, doc: str) -> Versioned | None:
        return (await self._call(self._request("read", doc=doc))).found

    async def read_prefix(self, prefix: str) -> dict[str, Versioned]:
        return (await self._call(self._request("read_prefix", doc=prefix))).docs

    async def write(
        self, doc: str, body: bytes, *, expect: int | None = None, fence: Grant | None = None,
        ttl_s: float | None = None,
    ) -> int:
        request = self._request("write", doc=doc, body=bytes(body), expect=expect, fence=fence, ttl_s=ttl_s)
        return (await self._call(request)).revision

    async def delete(self, doc: str, *, fence: Grant | None = None) -> None:
        await self._call(self._request("delete", doc=doc, fence=fence))

    async def acquire(self, lease: str, holder: str, ttl_s: float) -> Grant | None:
        return (await self._call(self._request("acquire", lease=lease, holder=holder, ttl_s=ttl_s))).grant

    async def release(self, grant: Grant) -> None:
        await self._call(self._request("release", grant=grant))

    async def holder(self, lease: str) -> Grant | None:
        return (await self._call(self._request("holder", lease=lease))).grant

    async def watch(self) -> AsyncIterator[str]:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.path)
                writer.write(frame(self._request("watch")))
                await writer.drain()
                answer = _answers.decode(await read_frame(reader))
            if answer.error:
                raise StoreError(f"the local store on {self.path} refused watch: {answer.message}")
            while True:
                async with asyncio.timeout(WATCH_SILENCE_S):
                    name = _names.decode(await read_frame(reader))
                if name:
                    yield name
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"the local store on {self.path}: {type(exc).__name__}: {exc}") from exc
        finally:
            _close(writer)

    async def close(self) -> None:
        while self._idle:
            _close(self._idle.pop()[1])
