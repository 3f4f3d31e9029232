"""The front ends' channel (frontends/channel.py): a front end's way to any other, on its Unix socket on one
host and over TCP with the join token across hosts, with its token checks and its bounds, and the pings
that tell a hung front end from a slow one."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.cluster.members import Membership, new_member
from inferd.cluster.memory import MemoryStore
from inferd.config import ServerConfig
from inferd.frontends import channel
from inferd.frontends.channel import (
    MAX_HEADER_BYTES,
    PING,
    FrontendChannel,
    Liveness,
    PeerUnreachable,
    encode_request,
    tcp_host,
)
from inferd.frontends.peers import Peers, peers_of
from inferd.frontends.plan import FrontendPlan


# ---- the channel ----------------------------------------------------------------------------------------
@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="inferd-chan-")  # short: a Unix socket path has ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def on(plan: FrontendPlan, **kw: object) -> FrontendChannel:
    """Front end `plan.index`'s channel on one host."""
    return FrontendChannel(plan.token, plan.channel_path(plan.index), **kw)  # type: ignore[arg-type]


async def echo(payload: bytes) -> bytes:
    return payload.upper()


async def test_the_channel_answers_each_kind_with_its_handler_and_refuses_a_wrong_token(
    socket_dir: str,
) -> None:
    plan = FrontendPlan(0, 2, socket_dir, "token")
    owner = on(plan)
    owner.handle("echo", echo, 1.0)
    follower = on(plan.at(1))
    with pytest.raises(PeerUnreachable):  # not listening yet
        await follower.ask(plan.channel_address(0), "echo", b"x", 1.0)
    await owner.open()
    try:
        assert await follower.ask(plan.channel_address(0), "echo", b"abc", 1.0) == b"ABC"
        with pytest.raises(PeerUnreachable, match="without an answer"):
            await follower.ask(plan.channel_address(0), "other", b"abc", 1.0)
        stranger = on(FrontendPlan(1, 2, socket_dir, "wrong"))
        with pytest.raises(PeerUnreachable, match="without an answer"):
            await stranger.ask(plan.channel_address(0), "echo", b"abc", 1.0)
    finally:
        owner.close()


async def test_any_front_end_is_asked_on_its_own_socket(socket_dir: str) -> None:
    plan = FrontendPlan(0, 3, socket_dir, "token")
    channels = [on(plan.at(i)) for i in range(3)]
    for i, c in enumerate(channels):

        async def whoami(payload: bytes, i: int = i) -> bytes:
            return str(i).encode() + payload

        c.handle("who", whoami, 1.0)
        await c.open()
    try:
        for i in range(3):  # front end 1 asks each, itself included
            assert await channels[1].ask(plan.channel_address(i), "who", b"!", 1.0) == f"{i}!".encode()
        assert channels[2].address() == plan.channel_address(2)
    finally:
        for c in channels:
            c.close()


async def test_across_hosts_a_front_end_is_asked_over_tcp_with_the_join_token_only() -> None:
    writer = FrontendChannel("", None, join_token="join")
    writer.handle("echo", echo, 1.0)
    await writer.open(("127.0.0.1", "127.0.0.1"))
    try:
        address = writer.address()
        assert address is not None and address.startswith("127.0.0.1:") and address == writer.tcp_address
        assert await FrontendChannel("", None, join_token="join").ask(address, "echo", b"tcp", 1.0) == b"TCP"
        with pytest.raises(PeerUnreachable, match="without an answer"):  # another cluster's token
            await FrontendChannel("", None, join_token="other").ask(address, "echo", b"tcp", 1.0)
        with pytest.raises(PeerUnreachable, match="no join token"):  # a plan's token never goes over TCP
            await FrontendChannel("join", None).ask(address, "echo", b"tcp", 1.0)
    finally:
        writer.close()


async def test_a_unix_socket_takes_the_plans_token_not_the_join_token(socket_dir: str) -> None:
    plan = FrontendPlan(0, 2, socket_dir, "plan-token")
    owner = on(plan, join_token="join")
    owner.handle("echo", echo, 1.0)
    await owner.open()  # no TCP asked: the Unix socket only
    try:
        assert owner.tcp_address is None and owner.address() == plan.channel_address(0)
        with pytest.raises(PeerUnreachable, match="without an answer"):
            await FrontendChannel("join", None).ask(plan.channel_address(0), "echo", b"x", 1.0)
        assert await on(plan.at(1)).ask(plan.channel_address(0), "echo", b"x", 1.0) == b"X"
    finally:
        owner.close()


async def test_no_join_token_no_tcp_listener() -> None:
    alone = FrontendChannel("", None)
    await alone.open(("127.0.0.1", "127.0.0.1"))
    assert alone.address() is None


def test_the_tcp_host_is_the_worker_host_or_that_of_the_id() -> None:
    assert tcp_host("10.0.0.5", "fe-1") == ("10.0.0.5", "10.0.0.5")
    assert tcp_host("0.0.0.0", "10.0.0.7:8000") == ("0.0.0.0", "10.0.0.7")
    assert tcp_host("::", "[fd00::7]:8000") == ("::", "fd00::7")
    assert tcp_host("0.0.0.0", "fe-1") is None  # nobody could reach it: no address to name


class Answered:
    """The answering side of one channel connection: what it wrote back."""

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


async def test_a_front_end_refuses_odd_tokens_oversized_and_unfinished_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owner = FrontendChannel("token", "/nonexistent", max_bytes=1024)
    handled: list[bytes] = []

    async def record(payload: bytes) -> bytes:
        handled.append(payload)
        return payload

    owner.handle("echo", record, 1.0)
    huge_header = b"\x00\x01\x00\x00" + msgspec.msgpack.encode(["echo", "t" * 70_000])
    for request, eof in [
        (encode_request("echo", "tökén", b"x"), True),  # a token that is not ASCII: refused like any other
        (encode_request("echo", "token", b"x" * 2048), True),  # over the bound
        (encode_request("echo", "token", b"x"), False),  # never sent whole
        (msgspec.msgpack.encode(["echo", "token", b"x"]), True),  # no header: not a request of ours
        (huge_header, True),  # a header past MAX_HEADER_BYTES is not read
    ]:
        monkeypatch.setattr(channel, "READ_TIMEOUT_S", 0.05)
        answered = Answered()
        await asyncio.wait_for(owner._answer("token", sent(request, eof), answered), 30)  # type: ignore[arg-type]
        assert (answered.data, answered.closed) == (b"", True)
    assert handled == []
    answered = Answered()
    await owner._answer("token", sent(encode_request("echo", "token", b"x")), answered)  # type: ignore[arg-type]
    assert (answered.data, handled) == (b"x", [b"x"])


async def test_a_request_with_a_wrong_token_is_refused_before_its_payload_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger gets the header read, at most MAX_HEADER_BYTES, never the payload: the refusal comes
    while the payload is still being sent (no end of it ever arrives here), not at READ_TIMEOUT_S."""
    monkeypatch.setattr(channel, "READ_TIMEOUT_S", 3600.0)
    owner = FrontendChannel("token", "/nonexistent", max_bytes=64 * 2**20)
    owner.handle("echo", lambda payload: asyncio.sleep(0, payload), 1.0)
    request = encode_request("echo", "wrong", b"x" * 2**20)
    assert len(request) - 2**20 <= MAX_HEADER_BYTES
    answered = Answered()
    await asyncio.wait_for(owner._answer("token", sent(request, eof=False), answered), 30)  # type: ignore[arg-type]
    assert (answered.data, answered.closed) == (b"", True)


# ---- liveness: a hung front end told from a slow one -----------------------------------------------------
def test_a_front_end_is_hung_once_it_answered_no_ping_for_hung_after_s() -> None:
    clock = FakeClock()
    live = Liveness(clock, every_s=1.0, hung_after_s=3.0)
    clock.advance(2.0)
    assert not live.hung() and live.ping_timeout_s() == 1.0  # a ping answered after 3 s is too late
    live.heard()
    clock.advance(2.9)
    assert not live.hung()  # silence counts from the last answer, not from the wait's start
    clock.advance(0.1)
    assert live.hung() and live.silent_s() == pytest.approx(3.0) and live.ping_timeout_s() == 0.0


async def test_a_front_end_answers_pings_itself(socket_dir: str) -> None:
    plan = FrontendPlan(0, 2, socket_dir, "token")
    owner = on(plan)  # no handler registered: the channel answers pings from its event loop
    await owner.open()
    try:
        assert await on(plan.at(1)).ask(plan.channel_address(0), PING, b"", 1.0) == b"pong"
    finally:
        owner.close()


async def test_a_slow_answer_of_a_front_end_that_answers_pings_is_waited_for(socket_dir: str) -> None:
    plan, clock = FrontendPlan(0, 2, socket_dir, "token"), FakeClock()
    owner, released = on(plan), asyncio.Event()

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
    follower = on(plan.at(1), clock=clock, ping_every_s=0.001, hung_after_s=3.0)
    start = clock.now()
    await owner.open()
    try:
        assert await asyncio.wait_for(follower.ask_watched(plan.channel_address(0), "slow", b"", 60.0), 30) == b"done"
    finally:
        owner.close()
    assert clock.now() - start >= 10.0  # it waited past hung_after_s: the front end answered pings


async def test_a_hung_front_end_fails_the_wait_well_before_its_timeout(socket_dir: str) -> None:
    plan = FrontendPlan(1, 2, socket_dir, "token")
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # takes connections, never reads: stopped
    hung.bind(plan.channel_path(0))
    hung.listen(64)
    follower = on(plan, ping_every_s=0.05, hung_after_s=0.3)
    try:
        with pytest.raises(PeerUnreachable, match=r"no ping .* it is hung"):
            await asyncio.wait_for(follower.ask_watched(plan.channel_address(0), "slow", b"", 600.0), 30)  # not 600 s
    finally:
        hung.close()
    assert follower._watchers == {} and follower._watching == {}  # nothing left behind


async def test_a_dead_front_end_fails_the_wait_at_once_as_unreachable(socket_dir: str) -> None:
    plan = FrontendPlan(1, 2, socket_dir, "token")
    follower = on(plan, hung_after_s=600.0)
    with pytest.raises(PeerUnreachable, match="FileNotFoundError"):  # nothing listens: no ping wait
        await asyncio.wait_for(follower.ask_watched(plan.channel_address(0), "slow", b"", 600.0), 30)


async def test_watched_asks_pending_at_once_share_one_watcher_per_front_end(socket_dir: str) -> None:
    plan, clock = FrontendPlan(0, 2, socket_dir, "token"), FakeClock()
    owner, released, pings = on(plan), asyncio.Event(), []

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
    follower = on(plan.at(1), clock=clock, ping_every_s=0.001, hung_after_s=3.0)
    await owner.open()
    try:
        asks = [follower.ask_watched(plan.channel_address(0), "slow", str(i).encode(), 60.0) for i in range(20)]
        answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
    finally:
        owner.close()
    assert answers == [str(i).encode() for i in range(20)]  # each its own answer
    assert 10 <= len(pings) < 20  # one ping at a time for all 20 (a watcher each would send 20 at a time)
    assert follower._watchers == {}  # nobody waits: it stopped


# ---- where each front end is reached (frontends/peers.py) ----------------------------------------------
def test_a_front_end_is_found_by_its_socket_on_one_host_and_by_its_record_across_hosts(socket_dir: str) -> None:
    config = ServerConfig()
    plan = FrontendPlan(1, 3, socket_dir, "token")
    one_host = Peers(config, plan, None, 1024)
    assert one_host.address("0") == plan.channel_address(0) and one_host.address("2") == plan.channel_address(2)
    assert one_host.address("3") is None and one_host.address("fe-a") is None  # no such front end
    members = Membership(MemoryStore(FakeClock()), new_member("fe-b", "10.0.0.2:8000", {}), FakeClock())
    members.members = {
        "fe-a": msgspec.structs.replace(new_member("fe-a", "10.0.0.1:8000", {}), channel="10.0.0.1:40123"),
        "fe-c": new_member("fe-c", "10.0.0.3:8000", {}),  # not listening yet: no address
        "fe-d": msgspec.structs.replace(
            new_member("fe-d", "10.0.0.4:8000", {}), host="other-host", channel="unix:/tmp/x/frontend-0.sock"
        ),  # on another host, its Unix socket only: no address from here
        "fe-e": msgspec.structs.replace(new_member("fe-e", "10.0.0.5:8000", {}), channel="unix:/tmp/y.sock"),
    }
    hosts = Peers(config, None, members, 1024)
    assert hosts.address("fe-a") == "10.0.0.1:40123"
    assert hosts.address("fe-c") is None and hosts.address("fe-gone") is None
    assert hosts.address("fe-d") is None and hosts.address("fe-e") == "unix:/tmp/y.sock"  # fe-e: this host
    assert peers_of(config, None, None, 1024) is None  # alone: nobody to ask


async def test_a_front_end_on_a_shared_store_writes_where_it_listens_into_its_record() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    members = Membership(store, new_member("fe-a", "127.0.0.1:8000", {}), clock)
    await members.join()
    config = ServerConfig(join_token="join", worker_host="127.0.0.1")
    peers = Peers(config, None, members, 1024)
    await peers.open()
    try:
        address = peers.channel.address()
        assert address is not None and address.startswith("127.0.0.1:")
        assert (await members.refresh())["fe-a"].channel == address
    finally:
        peers.close()


async def test_no_tcp_where_the_worker_port_would_be_encrypted_or_plain_off_loopback_unasked(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    members = Membership(MemoryStore(clock), new_member("fe-a", "10.0.0.1:8000", {}), clock)
    await members.join()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    for config in (
        ServerConfig(join_token="join", worker_host="10.0.0.1"),  # off loopback, plain, no --insecure
        ServerConfig(join_token="join", worker_host="127.0.0.1", worker_ssl_certfile=cert, worker_ssl_keyfile=key),
    ):
        peers = Peers(config, None, members, 1024)
        await peers.open()
        assert peers.channel.tcp_address is None and peers.channel.address() is None
        peers.close()
    plain = Peers(ServerConfig(join_token="join", worker_host="127.0.0.1"), None, members, 1024)
    await plain.open()  # the same on loopback, plain: it listens
    assert plain.channel.tcp_address is not None
    plain.close()
