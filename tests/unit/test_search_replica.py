"""The replica's call handling: which calls run on its event loop, and its frame splitting."""

from __future__ import annotations

import asyncio

import pytest

from inferd.kinds.search.replica import InlinePolicy, Replica, split_frames
from inferd.wire import protocol as p


def test_short_reads_run_inline_and_writes_never_do() -> None:
    policy = InlinePolicy(max_s=0.005)
    assert policy.inline("search") and policy.inline("get")
    assert not policy.inline("apply") and not policy.inline("snapshot") and not policy.inline("unvectored")


def test_a_read_that_grew_slow_moves_to_the_thread_and_back() -> None:
    policy = InlinePolicy(max_s=0.005, alpha=0.5)
    policy.observe("search", 0.001)
    assert policy.inline("search")
    policy.observe("search", 0.050)  # estimate 0.0255
    assert not policy.inline("search")
    assert policy.inline("get")  # per op
    for _ in range(5):
        policy.observe("search", 0.001)
    assert policy.inline("search")


def test_frames_are_split_whole_and_a_partial_one_is_kept() -> None:
    one, two = p.encode_frame(p.ShardCall(1, "search", b"x")), p.encode_frame(p.ShardCall(2, "get", b"yy"))
    buf = bytearray(one + two[:5])
    frames = split_frames(buf)
    assert [p.decode_message(f) for f in frames] == [p.ShardCall(1, "search", b"x")]
    assert bytes(buf) == two[:5]
    buf += two[5:]
    assert [p.decode_message(f) for f in split_frames(buf)] == [p.ShardCall(2, "get", b"yy")]
    assert buf == bytearray()


def test_a_frame_over_the_limit_is_refused() -> None:
    with pytest.raises(p.ProtocolError):
        split_frames(bytearray(p.encode_frame(p.ShardCall(1, "search", b"x" * 100))), max_bytes=50)


class FakeWriter:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def is_closing(self) -> bool:
        return False

    async def drain(self) -> None:
        return None


async def test_a_chunk_of_inline_reads_yields_the_loop_between_slices_and_keeps_arrival_order() -> None:
    writer = FakeWriter()
    replica = Replica("w")
    replica.links[0] = writer  # type: ignore[assignment]
    replica.inline_slice_s = 0.0  # every inline read uses up a slice
    reader = asyncio.StreamReader()
    calls = 20
    reader.feed_data(b"".join(p.encode_frame(p.ShardCall(i, "search", b"")) for i in range(1, calls + 1)))
    reader.feed_data(p.encode_frame(p.Drain()))
    seen: list[int] = []

    async def other_task() -> None:  # a heartbeat's stand-in: how far the reads got each time it ran
        while replica.completed < calls:
            seen.append(replica.completed)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(other_task())
    assert await replica._receive(0, reader) == "drained"
    await watcher
    replica._thread.shutdown(wait=False)
    assert any(0 < n < calls for n in seen)  # it ran while the chunk's reads were being answered
    replies = [p.decode_message(f[4:]) for f in writer.frames]
    assert [r.call_id for r in replies] == list(range(1, calls + 1))  # in arrival order
    assert all(r.error == ("Internal", "no shard assigned yet") for r in replies)


async def test_inline_reads_within_a_slice_run_back_to_back() -> None:
    writer = FakeWriter()
    replica = Replica("w")
    replica.links[0] = writer  # type: ignore[assignment]
    replica.inline_slice_s = 3600.0
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(p.encode_frame(p.ShardCall(i, "search", b"")) for i in range(1, 11)))
    reader.feed_data(p.encode_frame(p.Drain()))
    seen: list[int] = []

    async def other_task() -> None:
        seen.append(replica.completed)

    watcher = asyncio.create_task(other_task())
    assert await replica._receive(0, reader) == "drained"
    await watcher
    replica._thread.shutdown(wait=False)
    assert seen == [10]  # no yield: the whole chunk was answered before the other task ran
