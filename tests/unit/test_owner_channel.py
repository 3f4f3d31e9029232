"""The owner channel of `inferd serve --frontends N` (frontends/owner_channel.py): the other front ends' way
to the owner, with its token check and its bounds, and the pings that tell a hung owner from a slow one."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Iterator

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.frontends import owner_channel
from inferd.frontends.owner_channel import PING, Liveness, OwnerChannel, OwnerUnreachable, Request
from inferd.frontends.plan import FrontendPlan


# ---- the owner channel ----------------------------------------------------------------------------------
@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="inferd-owner-")  # short: a Unix socket path has ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_the_channel_answers_each_kind_with_its_handler_and_refuses_a_wrong_token(
    socket_dir: str,
) -> None:
    plan = FrontendPlan(0, 2, socket_dir, "token")
    owner = OwnerChannel(plan)

    async def echo(payload: bytes) -> bytes:
        return payload.upper()

    owner.handle("echo", echo, 1.0)
    follower = OwnerChannel(plan.at(1))
    with pytest.raises(OwnerUnreachable):  # not listening yet
        await follower.ask("echo", b"x", 1.0)
    await owner.open()
    try:
        assert await follower.ask("echo", b"abc", 1.0) == b"ABC"
        with pytest.raises(OwnerUnreachable, match="without an answer"):
            await follower.ask("other", b"abc", 1.0)
        stranger = OwnerChannel(FrontendPlan(1, 2, socket_dir, "wrong"))
        with pytest.raises(OwnerUnreachable, match="without an answer"):
            await stranger.ask("echo", b"abc", 1.0)
    finally:
        owner.close()


class Answered:
    """The owner's side of one owner channel connection: what it wrote back."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def sent(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_the_owner_refuses_odd_tokens_oversized_and_unfinished_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owner = OwnerChannel(FrontendPlan(0, 2, "/nonexistent", "token"), max_bytes=1024)
    handled: list[bytes] = []

    async def echo(payload: bytes) -> bytes:
        handled.append(payload)
        return payload

    owner.handle("echo", echo, 1.0)
    for request, eof in [
        (Request("echo", "tökén", b"x"), True),  # a token that is not ASCII: refused like any other
        (Request("echo", "token", b"x" * 2048), True),  # over the bound
        (Request("echo", "token", b"x"), False),  # never sent whole
    ]:
        monkeypatch.setattr(owner_channel, "READ_TIMEOUT_S", 0.05)
        answered = Answered()
        await asyncio.wait_for(owner._answer(sent(msgspec.msgpack.encode(request), eof), answered), 30)  # type: ignore[arg-type]
        assert (answered.data, answered.closed) == (b"", True)
    assert handled == []
    answered = Answered()
    await owner._answer(sent(msgspec.msgpack.encode(Request("echo", "token", b"x"))), answered)  # type: ignore[arg-type]
    assert (answered.data, handled) == (b"x", [b"x"])


# ---- liveness: a hung owner told from a slow one -------------------------------------------------------
def test_an_owner_is_hung_once_it_answered_no_ping_for_hung_after_s() -> None:
    clock = FakeClock()
    live = Liveness(clock, every_s=1.0, hung_after_s=3.0)
    clock.advance(2.0)
    assert not live.hung() and live.ping_timeout_s() == 1.0  # a ping answered after 3 s is too late
    live.heard()
    clock.advance(2.9)
    assert not live.hung()  # silence counts from the last answer, not from the wait's start
    clock.advance(0.1)
    assert live.hung() and live.silent_s() == pytest.approx(3.0) and live.ping_timeout_s() == 0.0


async def test_the_owner_answers_pings_itself(socket_dir: str) -> None:
    plan = FrontendPlan(0, 2, socket_dir, "token")
    owner = OwnerChannel(plan)  # no handler registered: the channel answers pings from its event loop
    await owner.open()
    try:
        assert await OwnerChannel(plan.at(1)).ask(PING, b"", 1.0) == b"pong"
    finally:
        owner.close()


async def test_a_slow_answer_of_an_owner_that_answers_pings_is_waited_for(socket_dir: str) -> None:
    plan, clock = FrontendPlan(0, 2, socket_dir, "token"), FakeClock()
    owner, released = OwnerChannel(plan), asyncio.Event()

    async def slow(payload: bytes) -> bytes:
        await released.wait()
        return b"done"

    async def pong(payload: bytes) -> bytes:  # each ping answered a (virtual) second after the last
        clock.advance(1.0)
        if clock.now() >= start + 10.0:
            released.set()
        return b"pong"

    owner.handle("slow", slow, 60.0)
    owner.handle(PING, pong, 1.0)
    follower = OwnerChannel(plan.at(1), clock=clock, ping_every_s=0.001, hung_after_s=3.0)
    start = clock.now()
    await owner.open()
    try:
        assert await asyncio.wait_for(follower.ask_watched("slow", b"", 60.0), 30) == b"done"
    finally:
        owner.close()
    assert clock.now() - start >= 10.0  # it waited past hung_after_s: the owner answered pings


async def test_a_hung_owner_fails_the_wait_well_before_its_timeout(socket_dir: str) -> None:
    plan = FrontendPlan(1, 2, socket_dir, "token")
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # takes connections, never reads: stopped
    hung.bind(plan.owner_path())
    hung.listen(64)
    follower = OwnerChannel(plan, ping_every_s=0.05, hung_after_s=0.3)
    try:
        with pytest.raises(OwnerUnreachable, match=r"no ping .* it is hung"):
            await asyncio.wait_for(follower.ask_watched("slow", b"", 600.0), 30)  # a guard: not 600 s
    finally:
        hung.close()


async def test_a_dead_owner_fails_the_wait_at_once_as_unreachable(socket_dir: str) -> None:
    follower = OwnerChannel(FrontendPlan(1, 2, socket_dir, "token"), hung_after_s=600.0)
    with pytest.raises(OwnerUnreachable, match="FileNotFoundError"):  # nothing listens: no ping wait
        await asyncio.wait_for(follower.ask_watched("slow", b"", 600.0), 30)


async def test_watched_asks_pending_at_once_share_one_watcher(socket_dir: str) -> None:
    plan, clock = FrontendPlan(0, 2, socket_dir, "token"), FakeClock()
    owner, released, pings = OwnerChannel(plan), asyncio.Event(), []

    async def slow(payload: bytes) -> bytes:
        await released.wait()
        return payload

    async def pong(payload: bytes) -> bytes:
        pings.append(clock.now())
        clock.advance(1.0)
        if len(pings) >= 10:
            released.set()
        return b"pong"

    owner.handle("slow", slow, 60.0)
    owner.handle(PING, pong, 1.0)
    follower = OwnerChannel(plan.at(1), clock=clock, ping_every_s=0.001, hung_after_s=3.0)
    await owner.open()
    try:
        asks = [follower.ask_watched("slow", str(i).encode(), 60.0) for i in range(20)]
        answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
    finally:
        owner.close()
    assert answers == [str(i).encode() for i in range(20)]  # each its own answer
    assert 10 <= len(pings) < 20  # one ping at a time for all 20 (a watcher each would send 20 at a time)
    assert follower._watcher is not None and follower._watcher.done()  # nobody waits: it stopped
