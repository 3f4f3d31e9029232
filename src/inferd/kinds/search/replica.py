"""The worker side of a search model: one process holds one replica of one shard (a ShardIndex).

worker/main.py hands each front end's connection (a link) here when its model's kind is "search"; a
worker shared by several front ends (`inferd serve --frontends N`) holds ONE replica for all its links.
The index's writer front end (the holder of its lease: the one that sends ShardAssign) assigns a shard:
the replica keeps the index it holds when that one fits the writer's log, else loads the snapshot the
assignment carries (its bytes, over the connection: no replica reads a data_dir), runs a warm-up query on
a built or loaded one (kinds/search/warmup.py), and then says which seq it holds; the writer then ships
the log entries after it, in seq order (ShardCall "apply"), and sends searches, gets and snapshot calls
the same way. A new writer (another front end took the lease over)
assigns the shard again under a newer epoch: from then on only its link may apply (kinds/search/handover.py),
and a deposed writer's assignments and applies are refused.
The other links only read: they are told the replica's shard and applied seq by a note (a ShardReply
with call_id ANNOUNCE, its body the shard, -1 while one loads) when they join, when a shard is assigned
and after every apply. Calls of every link run one at a time, in arrival order: a search sees every
entry applied before it arrived; the writer's replies are waited for, while a reading link that stops
taking its replies (past MAX_LINK_BUFFER_BYTES) is dropped, never holding up the others. A Drain from
the writer link ends every link (the worker exits); one from another link is ignored (a front end that
only reads does not retire the worker). A writer that comes back while another front end kept the
replica finds its index kept; a replica every front end left is assigned afresh, as with one front end.

Short reads (searches and gets whose recent CPU time is under INLINE_MAX_S) run on the event loop, as
they arrive or as they come up in the queue behind a long call: the hand-off to a thread and back cost
more CPU than a small shard's search; they yield the loop every INLINE_SLICE_S of such work, so a burst
of them does not hold up heartbeats. Everything else runs on the shard's thread, so heartbeats keep
flowing while the shard works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from inferd.errors import Internal, ServingError
from inferd.kinds.search import wire
from inferd.kinds.search.handover import IncomingSnapshot, OutgoingSnapshot, WriterFence, keeps
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import IndexSettings
from inferd.kinds.search.warmup import warm_up
from inferd.kinds.search.wire import ANNOUNCE
from inferd.wire import protocol as p

log = logging.getLogger("inferd.search.replica")

MAX_QUEUED_CALLS = 256
"""Calls read ahead of the one running; past it the socket is not read (the front end bounds its own)."""
INLINE_MAX_S = 0.005
"""A read op runs on the event loop while its recent CPU time stays under this (else on the thread)."""
INLINE_OPS = frozenset({"search", "get"})
INLINE_SLICE_S = 0.002
"""Inline reads run back to back for at most about this long before the loop is yielded (heartbeats, the
socket): a chunk of many small reads does not hold the event loop for its whole length."""
MAX_LINK_BUFFER_BYTES = 32 * 2**20
"""Replies and notes a reading link has not taken yet; past it the link is dropped (its front end
rejoins), so a stalled front end never holds up the calls of the others."""
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
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.links: dict[int, asyncio.StreamWriter] = {}
        """The front ends served, by their place in --connect."""
        self.fence = WriterFence()
        """The link that assigned the shard (the index's writer: it ships the log), by lease epoch."""
        self.incoming = IncomingSnapshot()
        self.outgoing = OutgoingSnapshot()
        self.index: ShardIndex | None = None
        self.index_epoch = 0
        """The epoch of the writer whose assignment the index was kept or loaded under (its entries)."""
        self.shard = -1
        self.settings = b""
        """The assigned index settings (as sent): a new assignment of the same shard may keep the index."""
        self.completed = 0
        self._calls: asyncio.Queue[tuple[int, asyncio.StreamWriter, p.ShardAssign | p.ShardCall] | None] = (
            asyncio.Queue(MAX_QUEUED_CALLS)
        )
        """Calls of every link, in arrival order, with the link's connection their reply goes to (a
        front end that went and came back has a new one: it never gets its predecessor's replies)."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-shard")
        self._runner: asyncio.Task[None] | None = None
        """Runs the queued calls while any link is there (a call of a link that went is still run: an
        apply keeps the index in log order)."""
        self._retiring: asyncio.Task[None] | None = None
        """The runner finishing up after the last link went: the next one starts after it."""
        self._drained = asyncio.Event()
        """The writer drained the replica, or its runner failed: every link ends."""
        self._failure: BaseException | None = None
        """What the runner failed with (a bug): every link raises it, the worker exits."""
        self._busy = False
        """A call taken from the queue is running (on the thread): later calls queue behind it."""
        self.policy = InlinePolicy()
        self.inline_slice_s = INLINE_SLICE_S
        self._slice_start = time.perf_counter()
        """When the loop was last yielded here (a read of buffered bytes need not yield): the inline work
        since then is bounded."""

    async def serve(
        self,
        link: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        version: int,
        heartbeat_s: float,
    ) -> str:
        """One front end's link, until that front end goes ("lost") or the writer drains us ("drained")."""
        self.links[link] = writer
        self._send(link, p.Ready(version=version, load_s=0.0, warmup_s=0.0))
        self._send(link, self._note())  # the shard held (-1: none yet), for a writer to keep it
        if self._runner is None:
            self._runner = asyncio.create_task(self._run(self._retiring), name=f"replica-{self.worker_id}")
            self._runner.add_done_callback(self._runner_done)
        try:
            async with asyncio.TaskGroup() as tg:
                beat = tg.create_task(self._heartbeat(link, heartbeat_s))
                receiving = tg.create_task(self._receive(link, reader))
                drained = tg.create_task(self._drained.wait())
                await asyncio.wait({receiving, drained}, return_when=asyncio.FIRST_COMPLETED)
                if self._failure is not None:  # no call would be answered again: end as a crash
                    raise Internal(f"replica {self.worker_id} failed: {self._failure!r}") from self._failure
                outcome = receiving.result() if receiving.done() else "drained"
                if outcome == "drained" and not self._drained.is_set():
                    await self._finish()
                for task in (beat, receiving, drained):
                    task.cancel()
        finally:
            self.links.pop(link, None)
            self.fence.left(link)
            self.incoming.left(link)
            if not self.links:
                await self._retire_runner()
                if not self.links:  # no front end kept it: the next one assigns it afresh, as with one
                    self.index, self.shard, self.settings, self.index_epoch = None, -1, b"", 0
                    self.fence = WriterFence()  # (a front end's store may number epochs anew)
        return outcome

    @property
    def writer_link(self) -> int | None:
        return self.fence.link

    def _runner_done(self, runner: asyncio.Task[None]) -> None:
        if not runner.cancelled() and runner.exception() is not None:
            self._failure = runner.exception()
            log.error("replica %s: its calls' runner failed: %r", self.worker_id, self._failure)
            self._drained.set()

    async def _retire_runner(self) -> None:
        """No link left: the runner runs what is queued, then stops (a link that comes starts another)."""
        runner, self._runner = self._runner, None
        if runner is not None and not runner.done():
            self._retiring = runner
            await self._calls.put(None)
            await runner

    async def _finish(self) -> None:
        """Drained by the writer: run what is queued, then end every link."""
        await self._retire_runner()
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._drained.set()

    async def _receive(self, link: int, reader: asyncio.StreamReader) -> str:
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
                    if self.writer_link in (None, link):
                        return "drained"
                    log.info("replica %s: a Drain from a reading front end is ignored", self.worker_id)
                elif isinstance(msg, p.ShardCall) and self._inline(msg):
                    self._deliver(self.links[link], self._call(msg))
                    await self._yield_if_held()
                elif isinstance(msg, p.ShardAssign):
                    await self._assigning(link, msg)
                elif isinstance(msg, p.ShardCall) and msg.op == "apply" and not self.fence.writes(link):
                    why = "this front end no longer writes the shard (another took it over)"
                    self._deliver(self.links[link], self._reply(msg.call_id, error=("Conflict", why)))
                elif isinstance(msg, p.ShardCall):
                    await self._calls.put((link, self.links[link], msg))
            await self._flush(link)

    async def _assigning(self, link: int, msg: p.ShardAssign) -> None:
        """A piece of an assignment: refused from a deposed writer; queued once whole."""
        refused = self.fence.admit(link, msg.epoch)
        if refused is not None:
            log.warning("replica %s: an assignment refused: %s", self.worker_id, refused)
            self._deliver(self.links[link], self._reply(0, error=("Conflict", refused)))
            return
        whole = self.incoming.add(link, msg)
        if whole is None:
            return
        if whole.shard != self.shard:  # the readers stop reading it until it holds the new one
            self._tell_readers(link, self._note(loading=True))
        await self._calls.put((link, self.links[link], whole))

    async def _yield_if_held(self) -> None:
        """Let the loop run (heartbeats, other connections) once inline work held it a slice's length;
        the frames after stay in order (each call still checks what is ahead of it)."""
        if time.perf_counter() - self._slice_start >= self.inline_slice_s:
            await asyncio.sleep(0)
            self._slice_start = time.perf_counter()

    def _inline(self, msg: p.ShardCall) -> bool:
        """Run it here and now: a short read with nothing ahead of it (arrival order holds)."""
        return not self._busy and self._calls.empty() and self.policy.inline(msg.op)

    async def _run(self, after: asyncio.Task[None] | None = None) -> None:
        if after is not None:  # the previous runner's calls first, one at a time
            await asyncio.shield(after)
        loop = asyncio.get_running_loop()
        while (item := await self._calls.get()) is not None:
            link, writer, msg = item
            self._busy = True
            if isinstance(msg, p.ShardAssign):
                reply = await loop.run_in_executor(self._thread, self._assign, msg)
            elif self.policy.inline(msg.op):  # queued behind a long call, but short itself
                reply = self._call(msg)
            else:
                reply = await loop.run_in_executor(self._thread, self._call, msg)
            self._busy = False
            if isinstance(msg, p.ShardAssign) or msg.op == "apply":
                self._tell_readers(link, self._note())  # the readers learn before the writer's answer
            self._deliver(writer, reply)
            await self._flush_links()
            await self._yield_if_held()

    async def _flush_links(self) -> None:
        """The writer link's replies are waited for (it ships the log); a reading link that does not
        take its own in time is dropped instead of holding up every link's calls."""
        for link, writer in list(self.links.items()):
            if link == self.writer_link:
                await self._flush(link)
            elif writer.transport.get_write_buffer_size() > MAX_LINK_BUFFER_BYTES:
                log.warning(
                    "replica %s: front end %d does not read its replies: dropped", self.worker_id, link
                )
                writer.transport.abort()

    def _note(self, loading: bool = False) -> p.ShardReply:
        """What the reading links are told: the shard held (-1 while loading) and how far it applied."""
        shard = -1 if loading or self.index is None else self.shard
        return self._reply(ANNOUNCE, wire.encode(shard))

    def _tell_readers(self, writer: int, note: p.ShardReply) -> None:
        for link in self.links:
            if link != writer:
                self._send(link, note)

    def _deliver(self, writer: asyncio.StreamWriter, reply: p.ShardReply) -> None:
        self.completed += 1
        if not writer.is_closing() and writer in self.links.values():  # its link is still there
            writer.write(p.encode_frame(reply))

    # ---- on the shard's thread (short reads: on the event loop) -------------------------------------------
    def _assign(self, msg: p.ShardAssign) -> p.ShardReply:
        held = None if self.index is None else (self.shard, self.settings, self.index.applied_seq, self.index_epoch)
        self.index_epoch = msg.epoch  # kept or loaded, its entries are this writer's from now on
        if keeps(held, msg):
            log.info("replica %s keeps shard %d at seq %d", self.worker_id, self.shard, self._seq())
            return self._reply(0)
        settings: IndexSettings = wire.settings(msg.settings)
        self.index = None  # loading: a link that joins now is told so, not the old index's seq as the new's
        self.shard, self.settings = msg.shard, msg.settings
        t0 = time.perf_counter()
        index, how = None, "empty"
        try:
            if msg.snapshot:
                index, how = ShardIndex.unpacked(msg.snapshot, settings), "from the snapshot sent"
        except ServingError as exc:  # unusable: it starts empty, and its writer sees it holds too little
            log.warning("shard %d: the snapshot sent is not used: %s", msg.shard, exc)
        index = ShardIndex(settings) if index is None else index
        loaded_s, warm_s = time.perf_counter() - t0, warm_up(index)  # before the answer: no read comes sooner
        self.index = index  # warm: links that join from now on are told it serves the shard
        log.info(
            "replica %s serves shard %d, %s at seq %d (%d documents) in %.2fs, warm-up %.3fs",
            *(self.worker_id, msg.shard, how, index.applied_seq, index.documents, loaded_s, warm_s),
        )
        return self._reply(0)

    def _seq(self) -> int:
        return self.index.applied_seq if self.index is not None else 0

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
            if msg.op == "unvectored":  # a re-embed's next page (kinds/search/reembed.py)
                cursor, limit = wire.pair(msg.body)
                return self._reply(msg.call_id, wire.encode(self.index.unvectored(cursor, limit)))
            if msg.op == "get":
                t0 = time.thread_time()
                doc = self.index.get(wire.text(msg.body))
                self.policy.observe("get", time.thread_time() - t0)
                return self._reply(msg.call_id, wire.encode(doc))
            if msg.op == "snapshot":  # the index packed, read piece by piece by the writer
                index, offset = self.index, wire.number(msg.body) if msg.body else 0
                piece = self.outgoing.piece(offset, lambda: (index.applied_seq, index.packed()))
                return self._reply(msg.call_id, wire.encode(piece))
            if msg.op == "applied":  # a takeover asks: the shard, the writer epoch (the reply: its seq)
                return self._reply(msg.call_id, wire.encode((self.shard, self.index_epoch)))
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

    # ---- the links ---------------------------------------------------------------------------------------
    async def _heartbeat(self, link: int, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self._send(
                link, p.Heartbeat(running=int(not self._calls.empty()), completed_batches=self.completed)
            )
            await self._flush(link)

    def _send(self, link: int, msg: p.Message) -> None:
        writer = self.links.get(link)
        if writer is not None and not writer.is_closing():
            writer.write(p.encode_frame(msg))

    async def _flush(self, link: int) -> None:
        writer = self.links.get(link)
        if writer is not None:
            with contextlib.suppress(OSError):
                await writer.drain()
