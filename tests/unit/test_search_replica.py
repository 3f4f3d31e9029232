"""The replica's call handling: which calls run on its event loop, and its frame splitting."""

from __future__ import annotations

import pytest

from inferd.search.replica import InlinePolicy, split_frames
from inferd.worker import protocol as p


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
