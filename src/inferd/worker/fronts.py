"""A worker's side of the front ends it serves: one link per front end, and whose LLM sequences are whose.

A worker joins one front end (`--connect unix:/run/a.sock`) or several (`--connect a:9000,b:9000`, or
every address of `dns:NAME:PORT`: worker/discovery.py);
each link is a connection with its own handshake, heartbeat and reads. The device (and the credit
ledger that caps what it holds) is the worker's, shared by all its links; no link's write buffer may hold
it up for the others (worker/stuck.py says how each buffer is bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path

from inferd import tls
from inferd.config import ConfigError
from inferd.wire import protocol as p
from inferd.worker.credits import CreditLedger, Seat, ToldState
from inferd.worker.discovery import parse_connect
from inferd.worker.stuck import LINK_HARD_LIMIT_BYTES, LINK_HIGH_WATER_BYTES, STUCK_AFTER_S, DrainWatch

log = logging.getLogger("inferd.worker")

FINISH_POLL_S = 0.01
"""How often a link whose session ended looks whether what it holds has gone out."""


class FrontLink:
    """One connection to one front end, and its write buffer (bounded: worker/stuck.py)."""

    def __init__(
        self,
        index: int,
        address: str,
        writer: asyncio.StreamWriter,
        stuck_after_s: float = STUCK_AFTER_S,
        lifeline: bool = False,
    ) -> None:
        self.index = index
        self.address = address
        self.writer = writer
        self.credits = False
        """The front end takes credits (Welcome.credits); False: an older one, served alone."""
        self.told: ToldState | None = None
        """The state last sent to it in a Credit."""
        self.closed = False
        self.answered_drain = False
        """The front end sent Drain (its own, or its answer to the worker's): it sends no more work."""
        self.leaving = False
        """The worker leaves this front end alone (no longer named: worker/discovery.py), by Drain."""
        self.held = 0
        """Batches it sent that the device has not answered yet."""
        self._none_held = asyncio.Event()
        self._none_held.set()
        self.sent_bytes = 0
        """Bytes ever written to the link (those not in its buffer have gone to the kernel)."""
        self.watch = DrainWatch(stuck_after_s)
        self.lifeline = lifeline
        """The front end whose going ends the worker (a local worker's first): never cut off for being
        slow or stuck (that would end the worker for every front end); waited for instead, as before
        there were several."""
        self._held: list[bytes] | None = None
        """Frames sent inside `together`, written out as one when it ends."""

    @classmethod
    def joined(
        cls,
        index: int,
        address: str,
        writer: asyncio.StreamWriter,
        stuck_after_s: float = STUCK_AFTER_S,
        lifeline: bool = False,
    ) -> FrontLink:
        """A link over a real connection, its write buffer's high-water mark raised: waiting for it to
        drain blocks only past LINK_HIGH_WATER_BYTES."""
        writer.transport.set_write_buffer_limits(high=LINK_HIGH_WATER_BYTES)
        return cls(index, address, writer, stuck_after_s, lifeline)

    def took(self) -> None:
        """A batch it sent is the worker's (queued, staged or running)."""
        self.held += 1
        self._none_held.clear()

    def answered(self) -> None:
        """One of its batches was answered (or dropped, the link being closed)."""
        self.held -= 1
        if self.held == 0:
            self._none_held.set()

    def has_left(self, holds_sequences: bool) -> bool:
        """Left, and done with: the worker left it, it answered Drain (it sends no more work), no batch of
        its is still on the worker, and (`holds_sequences`) no LLM sequence of its still runs."""
        return self.leaving and self.answered_drain and self.held == 0 and not holds_sequences

    async def none_held(self) -> None:
        """Returns once no batch of its is on the worker."""
        await self._none_held.wait()

    def send(self, msg: p.Message) -> None:
        if self.closed or self.writer.is_closing():
            return
        frame = p.encode_frame(msg)
        if self._held is not None:
            self._held.append(frame)
            return
        self._write(frame)

    def together(self) -> FrontLink:
        """`with link.together():` the frames sent inside go out in one write when it ends (a batch's
        result and the Credit that frees its slot: one system call here, one read for the front end), in
        the order sent. (The link is its own context manager: two calls, not a generator's six.)"""
        self._held = []
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, None
        if held and not self.closed and not self.writer.is_closing():
            self._write(b"".join(held))

    def _write(self, data: bytes) -> None:
        self.writer.write(data)
        self.sent_bytes += len(data)
        if self.buffered() > LINK_HARD_LIMIT_BYTES:
            self.cut_off(f"it holds {self.buffered()} bytes unread, more than its credits allow")

    def buffered(self) -> int:
        """Bytes written to the link and not yet taken by the kernel."""
        return self.writer.transport.get_write_buffer_size()

    def behind(self) -> bool:
        """More than the high-water mark waits in its buffer (waiting for it to drain would block)."""
        return self.buffered() > LINK_HIGH_WATER_BYTES

    def cut_off_if_stuck(self, now: float) -> bool:
        """One look of the drain watch (the heartbeat loop's); cut off (True) when the buffer has not
        moved for too long. The lifeline is never cut off."""
        if not self.watch.observe(now, self.buffered(), self.sent_bytes) or self.lifeline:
            return False
        self.cut_off(f"{self.buffered()} bytes unread, none gone out for {self.watch.stuck_for_s(now):.1f}s")
        return True

    async def flush(self) -> None:
        """Wait while the link is past its high-water mark (at once below it)."""
        with contextlib.suppress(OSError):  # a reset, or unacknowledged too long: the reader sees it too
            await self.writer.drain()

    async def finish(self, timeout_s: float) -> None:
        """The session ends: give what is buffered up to `timeout_s` to go out, then close (cut off, if
        the front end did not read it by then)."""
        # Polled, not drain(): with a high-water mark of 0 a TLS transport pauses writing even when empty,
        # and drain() then waits for the peer to close.
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.buffered() > 0 and not self.writer.is_closing():
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(FINISH_POLL_S)
        if self.buffered() > 0:
            self.cut_off(f"{self.buffered()} bytes still unread at the end of its session")
        self.close()

    def cut_off(self, why: str) -> None:
        """Abort the connection, dropping what is buffered: the front end sees its connection end (and
        fails or retries what it had sent), the worker's reader sees it lost (the link is detached)."""
        if not self.writer.is_closing():
            log.warning("cutting off the front end at %s: %s", self.address, why)
        self.closed = True
        self.writer.transport.abort()

    def close(self) -> None:
        self.closed = True
        if not self.writer.is_closing():
            self.writer.close()


class SequenceOwners:
    """The LLM engine serves every link's sequences: ids are made unique per link on the way in
    ('2/seq-7') and each step's deltas go back, under their own ids, to the link that sent them."""

    def __init__(self, links: Callable[[], dict[int, FrontLink]]) -> None:
        self._links = links
        self._owner: dict[str, int] = {}

    def inbound(
        self, link: FrontLink, msg: p.AddSequence | p.AbortSequence
    ) -> p.AddSequence | p.AbortSequence:
        seq_id = f"{link.index}/{msg.seq_id}"
        if isinstance(msg, p.AddSequence):
            self._owner[seq_id] = link.index
            msg.seq_id = seq_id
            return msg
        return p.AbortSequence(seq_id)

    def holds(self, index: int) -> bool:
        """The link has live sequences."""
        return index in self._owner.values()

    def release(self, index: int) -> list[p.AbortSequence]:
        """The link is gone: aborts of its live sequences (their deltas now go nowhere)."""
        gone = [s for s, owner in self._owner.items() if owner == index]
        for seq_id in gone:
            del self._owner[seq_id]
        return [p.AbortSequence(s) for s in gone]

    def send(self, msg: p.Message) -> None:
        """The engine's send: a StepDeltas split by owner (the statistics go to every link)."""
        links = self._links()
        if not isinstance(msg, p.StepDeltas):
            for link in links.values():
                link.send(msg)
            return
        out = {i: p.StepDeltas(msg.compute_s, [], msg.stats) for i in links}
        owners = self._owner

        def local(seq_id: str) -> tuple[p.StepDeltas | None, str]:
            """The owner's message and the id the owner knows; (None, seq_id) when no link owns it."""
            to = out.get(owners.get(seq_id, -1))
            return to, seq_id.split("/", 1)[1] if to is not None else seq_id

        for seq_id in msg.admitted:
            to, local_id = local(seq_id)
            if to is not None:
                to.admitted.append(local_id)
        for seq_id in msg.preempted:
            to, local_id = local(seq_id)
            if to is not None:
                to.preempted.append(local_id)
        for seq_id, token in zip(msg.decoded_ids, msg.decoded_tokens, strict=True):
            to, local_id = local(seq_id)
            if to is not None:
                to.decoded_ids.append(local_id)
                to.decoded_tokens.append(token)
        for d in msg.deltas:
            to, local_id = local(d.seq_id)
            if d.finish_reason is not None:
                owners.pop(d.seq_id, None)
            if to is not None:
                d.seq_id = local_id
                to.deltas.append(d)
        for i, link in links.items():
            link.send(out[i])

    async def flush(self) -> None:
        """After each engine step: backpressure that no front end can turn against the others. While
        every link is past its high-water mark, wait for them (as with one front end: a slow reader
        slows the engine); a link that far behind while others are not is cut off instead of awaited
        (its sequences are aborted, its front end retries or fails them). A stuck link that all the
        others wait behind is cut off by its drain watch. The lifeline is never cut off: it is waited for.
        When one of those waited for drains, the rule is applied again (the others, still behind while it
        keeps up, are cut off) and the step goes on: at most one wait per step."""
        behind = self._cut_behind()
        if not behind:
            return
        waits = [asyncio.ensure_future(link.flush()) for link in behind]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self._cut_behind()

    def _cut_behind(self) -> list[FrontLink]:
        """Cut off the links past their high-water mark while some are not (never the lifeline);
        returns those to wait for: all of them if every link is behind, else a lifeline behind."""
        links = list(self._links().values())
        behind = [link for link in links if link.behind()]
        if len(behind) == len(links):
            return behind
        for link in behind:
            if not link.lifeline:
                link.cut_off(f"{link.buffered()} bytes of token deltas unread while others keep up")
        return [link for link in behind if link.lifeline]


def transport(address: str, ca_file: Path | None, ca_pem: str, insecure: bool) -> ssl.SSLContext | None:
    """How the worker reaches its front ends (`address`: one, or a comma list, dns:NAME:PORT included):
    Unix sockets, TLS verified against the CA (a dns: name's front ends: the name), or plain TCP
    (loopback, or --insecure); ConfigError naming the fix otherwise."""
    try:
        fixed, names = parse_connect(address)
    except ValueError as exc:
        raise ConfigError(f"--connect: {exc}") from None
    tcp = [(str(n), n.host) for n in names]
    for a in fixed:
        _, target = p.parse_address(a)
        if isinstance(target, tuple):
            tcp.append((a, target[0]))
    if not tcp:
        return None
    context = tls.client_context(ca_file, ca_pem) if ca_file is not None or ca_pem else None
    for a, host in tcp:
        tls.check_worker_transport(a, host, tls=context is not None, insecure=insecure)
    return context


def refused(ledger: CreditLedger | Seat, welcome: p.Message) -> str:
    """Why the worker cannot serve the front end that answered its Hello with `welcome` ('': it can)."""
    if not isinstance(welcome, p.Welcome) or not welcome.accepted:
        return f"refused: {getattr(welcome, 'reason', 'unexpected reply')}"
    if not ledger.accepts(welcome.credits):
        return (
            "a front end of an older inferd takes no batch credits, so it cannot share a worker with "
            "other front ends; upgrade it, or give it workers of its own"
        )
    return ""


def untrusted(front: object, exc: ssl.SSLCertVerificationError) -> str:
    """What to say when the front end's certificate did not verify (retrying cannot fix it)."""
    return (
        f"the front end at {front} is not trusted: {exc.verify_message or exc}; pass --ca-file with the CA "
        "that signed its certificate, which must name the --connect host (or the dns: name) as a "
        "subjectAltName"
    )


def give_up_when_silent(writer: asyncio.StreamWriter, timeout_s: float) -> None:
    """Over TCP, let the kernel end the connection when what we send (heartbeats, every second) stays
    unacknowledged for the front end's own heartbeat timeout: a partitioned worker then finds out when
    the front end gives it up, and rejoins as soon as the network heals."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if timeout_s <= 0 or sock is None or option is None or sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))


def tell_credits(ledger: CreditLedger, links: Mapping[Hashable, FrontLink]) -> None:
    """Hand out the ledger's free batch slots and send each link that takes credits the Credit the
    ledger's rule (`CreditLedger.to_tell`) says it gets now: its grant, and the worker's state (what
    runs on it) when that changed for it. The worker's rule, which the fleet simulator runs too."""
    tell = ledger.to_tell({i: link.told for i, link in links.items() if link.credits})
    running_for_s = ledger.running_for_s()
    for index, (granted, state) in tell.items():
        link = links[index]
        link.send(p.Credit(granted, state.idle, state.shared, ledger.running_items, running_for_s))
        link.told = state


def take_batch(ledger: CreditLedger | Seat, link: FrontLink, items: int) -> None:
    """A batch of `items` arrived from `link` (it used a slot). A front end served alone knows what that
    changed (its own batch runs, or is staged): it is not told it again in a Credit of its own, which
    would cost a write here and a read there per batch. Front ends sharing the worker are told as before."""
    ledger.received(link.index, items)
    if not ledger.shared:
        link.told = ledger.state_for(link.index)
