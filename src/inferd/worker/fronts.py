"""A worker's side of the front ends it serves: one link per front end, and whose LLM sequences are whose.

A worker joins one front end (`--connect unix:/run/a.sock`) or several (`--connect a:9000,b:9000`);
each link is a connection with its own handshake, heartbeat and reads. The device (and the credit
ledger that caps what it holds) is the worker's, shared by all its links.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Mapping

from inferd.worker import protocol as p
from inferd.worker.credits import CreditLedger, ToldState


class FrontLink:
    """One connection to one front end."""

    def __init__(self, index: int, address: str, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.address = address
        self.writer = writer
        self.credits = False
        """The front end takes credits (Welcome.credits); False: an older one, served alone."""
        self.told: ToldState | None = None
        """The state last sent to it in a Credit."""
        self.closed = False

    def send(self, msg: p.Message) -> None:
        if not self.closed and not self.writer.is_closing():
            self.writer.write(p.encode_frame(msg))

    async def flush(self) -> None:
        with contextlib.suppress(OSError):  # a reset, or unacknowledged too long: the reader sees it too
            await self.writer.drain()

    def close(self) -> None:
        self.closed = True
        if not self.writer.is_closing():
            self.writer.close()


def split_addresses(connect: str) -> list[str]:
    """'a:9000,b:9000' -> ['a:9000', 'b:9000'] (one address: a list of one)."""
    addresses = [a.strip() for a in connect.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"--connect {connect!r} names no front end address")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"--connect {connect!r} names a front end twice")
    return addresses


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
        for link in list(self._links().values()):
            await link.flush()


def give_up_when_silent(writer: asyncio.StreamWriter, timeout_s: float) -> None:
    """Over TCP, let the kernel end the connection when what we send (heartbeats, every second) stays
    unacknowledged for the front end's own heartbeat timeout: a partitioned worker then finds out when
    the front end gives it up, and rejoins as soon as the network heals."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if timeout_s <= 0 or sock is None or option is None or sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))


def tell_credits(ledger: CreditLedger, links: Mapping[int, FrontLink]) -> None:
    """Hand out the ledger's free batch slots and send each link that takes credits the Credit the
    ledger's rule (`CreditLedger.to_tell`) says it gets now: its grant, and the worker's state (what
    runs on it) when that changed for it. The worker's rule, which the fleet simulator runs too."""
    tell = ledger.to_tell({i: link.told for i, link in links.items() if link.credits})
    running_for_s = ledger.running_for_s()
    for index, (granted, state) in tell.items():
        link = links[index]
        link.send(p.Credit(granted, state.idle, state.shared, ledger.running_items, running_for_s))
        link.told = state
