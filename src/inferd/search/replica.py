"""The worker side of a search model: one process holds one replica of one shard (a ShardIndex).

worker/main.py hands the connection here when its model's kind is "search". The front end assigns a
shard (ShardAssign): the replica loads the shard's latest snapshot, if any, and says which seq it holds;
the front end then ships the log entries after it, in seq order (ShardCall "apply"), and sends searches,
gets and snapshot orders the same way. Calls run one at a time, in arrival order: a search sees every
entry shipped before it. Short reads (searches and gets whose recent CPU time is under INLINE_MAX_S)
run on the event loop, as they arrive or as they come up in the queue behind a long call: the hand-off
to a thread and back cost more CPU than a small shard's search; they yield the loop every INLINE_SLICE_S
of such work, so a burst of them does not hold up heartbeats. Everything else runs on the shard's
thread, so heartbeats keep flowing while the shard works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inferd.errors import ServingError
from inferd.search import wire
from inferd.search.shard import ShardIndex
from inferd.search.types import IndexSettings
from inferd.worker import protocol as p

log = logging.getLogger("inferd.search.replica")

MAX_QUEUED_CALLS = 256
"""Calls read ahead of the one running; past it the socket is not read (the front end bounds its own)."""
INLINE_MAX_S = 0.005
"""A read op runs on the event loop while its recent CPU time stays under this (else on the thread)."""
INLINE_OPS = frozenset({"search", "get"})
INLINE_SLICE_S = 0.002
"""Inline reads run back to back for at most about this long before the loop is yielded (heartbeats, the
socket): a chunk of many small reads does not hold the event loop for its whole length."""
READ_CHUNK = 256 * 1024
_LEN = struct.Struct(">I")


class InlinePolicy:
    """Which calls run on the replica's event loop: reads while their CPU time (an EWMA per op; CPU, not
    wall time, so that a busy machine's preemptions do not count) stays under `max_s`. A read that grew
    slow (a large shard, a deep k) moves to the thread, and back once its times fall again (they are
    observed wherever it ran)."""

    def __init__(self, max_s: float = INLINE_MAX_S, alpha: float = 0.2) -> None:
        self.max_s = max_s
        self.alpha = alpha
        self.estimate_s: dict[str, float] = {}

    def inline(self, op: str) -> bool:
        return op in INLINE_OPS and self.estimate_s.get(op, 0.0) < self.max_s

    def observe(self, op: str, seconds: float) -> None:
        old = self.estimate_s.get(op)
        self.estimate_s[op] = seconds if old is None else old + self.alpha * (seconds - old)


def split_frames(buf: bytearray, max_bytes: int = p.MAX_FRAME_BYTES) -> list[bytes]:
    """The whole frames' bodies at the start of `buf`, removed from it (a partial frame stays);
    ProtocolError for a frame over `max_bytes`."""
    frames: list[bytes] = []
    pos, end = 0, len(buf)
    while end - pos >= 4:
        (size,) = _LEN.unpack_from(buf, pos)
        if size > max_bytes:
            raise p.ProtocolError(f"frame of {size} bytes exceeds the {max_bytes} byte limit")
        if end - pos - 4 < size:
            break
        frames.append(bytes(buf[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    del buf[:pos]
    return frames


class Replica:
    def __init__(self, worker_id: str, writer: asyncio.StreamWriter) -> None:
        self.worker_id = worker_id
        self.writer = writer
        self.index: ShardIndex | None = None
        self.shard = -1
        self.snapshot_dir: Path | None = None
        self.completed = 0
        self._calls: asyncio.Queue[p.ShardAssign | p.ShardCall | None] = asyncio.Queue(MAX_QUEUED_CALLS)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-shard")
        self._busy = False
        """A call taken from the queue is running (on the thread): later calls queue behind it."""
        self.policy = InlinePolicy()
        self.inline_slice_s = INLINE_SLICE_S
        self._slice_start = time.perf_counter()
        """When the loop was last yielded here (a read of buffered bytes need not yield): the inline work
        since then is bounded."""

    async def serve(self, reader: asyncio.StreamReader, version: int, heartbeat_s: float) -> str:
        """Until the front end drains us ("drained") or goes away ("lost")."""
        self._send(p.Ready(version=version, load_s=0.0, warmup_s=0.0))
        try:
            async with asyncio.TaskGroup() as tg:
                beat = tg.create_task(self._heartbeat(heartbeat_s))
                runner = tg.create_task(self._run())
                outcome = await self._receive(reader)
                await self._calls.put(None)
                await runner
                beat.cancel()
        finally:
            self._thread.shutdown(wait=False, cancel_futures=True)
        return outcome

    async def _receive(self, reader: asyncio.StreamReader) -> str:
        buf = bytearray()
        while True:
            try:
                chunk = await reader.read(READ_CHUNK)
                if not chunk:
                    return "lost"
                buf += chunk
                frames = split_frames(buf)
            except (OSError, p.ProtocolError):
                return "lost"
            for frame in frames:
                try:
                    msg = p.decode_message(frame)
                except p.ProtocolError:
                    return "lost"
                if isinstance(msg, p.Drain):
                    return "drained"
                if isinstance(msg, p.ShardCall) and self._inline(msg):
                    self._deliver(self._call(msg))
                    await self._yield_if_held()
                elif isinstance(msg, (p.ShardAssign, p.ShardCall)):
                    await self._calls.put(msg)
            with contextlib.suppress(OSError):
                await self.writer.drain()

    async def _yield_if_held(self) -> None:
        """Let the loop run (heartbeats, other connections) once inline work held it a slice's length;
        the frames after stay in order (each call still checks what is ahead of it)."""
        if time.perf_counter() - self._slice_start >= self.inline_slice_s:
            await asyncio.sleep(0)
            self._slice_start = time.perf_counter()

    def _inline(self, msg: p.ShardCall) -> bool:
        """Run it here and now: a short read with nothing ahead of it (arrival order holds)."""
        return not self._busy and self._calls.empty() and self.policy.inline(msg.op)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while (msg := await self._calls.get()) is not None:
            self._busy = True
            if isinstance(msg, p.ShardAssign):
                reply = await loop.run_in_executor(self._thread, self._assign, msg)
            elif self.policy.inline(msg.op):  # queued behind a long call, but short itself
                reply = self._call(msg)
            else:
                reply = await loop.run_in_executor(self._thread, self._call, msg)
            self._busy = False
            self._deliver(reply)
            with contextlib.suppress(OSError):
                await self.writer.drain()
            await self._yield_if_held()

    def _deliver(self, reply: p.ShardReply) -> None:
        self.completed += 1
        self._send(reply)

    # ---- on the shard's thread (short reads: on the event loop) -------------------------------------------
    def _assign(self, msg: p.ShardAssign) -> p.ShardReply:
        settings: IndexSettings = wire.settings(msg.settings)
        self.shard, self.snapshot_dir = msg.shard, Path(msg.snapshot_dir)
        t0 = time.perf_counter()
        try:
            self.index = ShardIndex.load(self.snapshot_dir, settings)
            how = "from its snapshot"
        except (FileNotFoundError, ServingError) as exc:  # none yet, or unusable: the log rebuilds it
            if self.snapshot_dir.exists():
                log.warning("shard %d snapshot at %s not used: %s", msg.shard, self.snapshot_dir, exc)
            self.index = ShardIndex(settings)
            how = "empty"
        log.info(
            "replica %s serves shard %d, %s at seq %d (%d documents) in %.2fs",
            self.worker_id,
            msg.shard,
            how,
            self.index.applied_seq,
            self.index.documents,
            time.perf_counter() - t0,
        )
        return self._reply(0)

    def _call(self, msg: p.ShardCall) -> p.ShardReply:
        if self.index is None:
            return self._reply(msg.call_id, error=("Internal", "no shard assigned yet"))
        try:
            if msg.op == "apply":
                for entry in wire.entries(msg.body):
                    self.index.apply(entry)
                return self._reply(msg.call_id)
            if msg.op == "search":
                t0 = time.thread_time()
                result = self.index.search(wire.query(msg.body))
                self.policy.observe("search", time.thread_time() - t0)
                return self._reply(msg.call_id, wire.encode(result))
            if msg.op == "unvectored":  # a re-embed's next page (search/reembed.py)
                cursor, limit = wire.pair(msg.body)
                return self._reply(msg.call_id, wire.encode(self.index.unvectored(cursor, limit)))
            if msg.op == "get":
                t0 = time.thread_time()
                doc = self.index.get(wire.text(msg.body))
                self.policy.observe("get", time.thread_time() - t0)
                return self._reply(msg.call_id, wire.encode(doc))
            if msg.op == "snapshot" and self.snapshot_dir is not None:
                seq = self.index.applied_seq
                self.index.save(self.snapshot_dir)
                return self._reply(msg.call_id, wire.encode(seq))
            return self._reply(msg.call_id, error=("BadRequest", f"unknown shard op {msg.op!r}"))
        except ServingError as exc:
            return self._reply(msg.call_id, error=(exc.code, exc.message))
        except Exception as exc:  # a failing op is reported to its caller, never crashes the replica
            log.exception("shard %d op %s failed", self.shard, msg.op)
            return self._reply(msg.call_id, error=("Internal", f"{type(exc).__name__}: {exc}"))

    def _reply(self, call_id: int, body: bytes = b"", error: tuple[str, str] | None = None) -> p.ShardReply:
        index = self.index
        return p.ShardReply(
            call_id,
            applied_seq=index.applied_seq if index else 0,
            documents=index.documents if index else 0,
            body=body,
            error=error,
        )

    # ---- the connection ------------------------------------------------------------------------------
    async def _heartbeat(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self._send(p.Heartbeat(running=int(not self._calls.empty()), completed_batches=self.completed))
            with contextlib.suppress(OSError):
                await self.writer.drain()

    def _send(self, msg: p.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(p.encode_frame(msg))


async def serve_replica(
    worker_id: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    version: int,
    heartbeat_s: float,
) -> str:
    """worker/main.py's entry for a search model's worker: serve one connection, return its outcome."""
    return await Replica(worker_id, writer).serve(reader, version, heartbeat_s)
