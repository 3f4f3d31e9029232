"""The owner channel of `inferd serve --frontends N` (frontends/owner_channel.py): the other front ends' way
to the owner, with its token check and its bounds."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator

import msgspec
import pytest

from inferd.frontends import owner_channel
from inferd.frontends.owner_channel import OwnerChannel, OwnerUnreachable, Request
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
