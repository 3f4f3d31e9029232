"""Fuzzing the SSE splitter of the upstream relay: on any byte stream cut into any pieces, it gives back the
events the SSE specification defines (lines end with CRLF, LF or CR; a blank line ends an event), the same
events whatever the cuts, each byte exactly once, and only ValueError once an event outgrows its bound."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.api.upstream import SSESplitter, _header, _Relay
from inferd.clock import FakeClock
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(60))

_TERMINATOR = re.compile(rb"\r\n|\n|\r")


def reference_events(stream: bytes) -> list[bytes]:
    """The complete events of `stream` (which must not end in a line terminator), by the spec's line rules:
    an event ends with a blank line (a line terminator right where a line begins)."""
    events, start, line_start = [], 0, 0
    for m in _TERMINATOR.finditer(stream):
        if m.start() == line_start:
            events.append(stream[start : m.end()])
            start = m.end()
        line_start = m.end()
    return events


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({min(p, len(stream)) for p in points})
    return [stream[a:b] for a, b in zip([0, *marks], [*marks, len(stream)], strict=True)]


sse_bytes = st.lists(
    st.sampled_from([b"\n", b"\r", b"\r\n", b"data: ", b"x", b"{}", b":", b"[DONE]", b"\xff"]), max_size=40
).map(b"".join)


@fuzz()
@given(sse_bytes, st.lists(st.integers(0, 200), max_size=12))
@example(b"data: a\r\rdata: b\n\r\nx", [8])
@example(b"data: a\r\n\r\nx", [8, 9, 10])
@example(b"a\r\r\nx", [2])
def test_any_cut_gives_the_events_the_spec_defines(body: bytes, points: list[int]) -> None:
    stream = body + b"x"  # ends in data, so every complete event is decided
    splitter = SSESplitter(1 << 20)
    out = [event for piece in cut(stream, points) for event in splitter.feed(piece)]
    assert out == reference_events(stream)
    assert stream.startswith(b"".join(out))


@fuzz()
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=12), st.integers(1, 64))
def test_raw_bytes_only_raise_value_error_past_the_bound(body: bytes, points: list[int], bound: int) -> None:
    splitter = SSESplitter(bound)
    out: list[bytes] = []
    try:
        for piece in cut(body, points):
            out += splitter.feed(piece)
    except ValueError as exc:
        assert f"exceeds {bound} bytes" in str(exc)
        return
    assert body.startswith(b"".join(out))


def test_cr_only_line_endings_end_events() -> None:
    """A blank line made of bare CRs (allowed by the SSE spec) ends an event; it once grew the buffer to
    its bound and failed the stream."""
    splitter = SSESplitter(1 << 20)
    assert splitter.feed(b"data: 1\r\rdata: 2\r\r") == [b"data: 1\r\r"]
    assert splitter.feed(b"x") == [b"data: 2\r\r"]


def test_mixed_line_endings_end_events() -> None:
    splitter = SSESplitter(1 << 20)
    assert splitter.feed(b"data: 1\n\r\ndata: 2\r\n\nx") == [b"data: 1\n\r\n", b"data: 2\r\n\n"]


def test_an_event_fed_a_byte_at_a_time_is_not_rescanned_from_its_start() -> None:
    """Splitting is linear in the stream: a large event arriving in small pieces is not searched again from
    its first byte at every piece (which took seconds for one 4 MiB event)."""
    splitter = SSESplitter(1 << 23)
    piece = b"x" * 16
    started = time.process_time()
    for _ in range(256 * 1024):  # 4 MiB in 16-byte pieces
        splitter.feed(piece)
    assert splitter.feed(b"\n\n") == [piece * 256 * 1024 + b"\n\n"]
    assert time.process_time() - started < 20


class _Metrics:
    def __init__(self) -> None:
        self.tokens: list[tuple[int, int]] = []
        self.text_events = 0

    def usage(self, prompt: int, completion: int) -> None:
        self.tokens.append((prompt, completion))

    def text_event(self, gap_s: float, first: bool) -> None:
        self.text_events += 1


class _Runtime:
    """What the relay reads of an UpstreamRuntime while it accounts an event."""

    name = "up"

    def __init__(self) -> None:
        self.metrics = _Metrics()
        self.clock = FakeClock()


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=5)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["choices", "usage", "text", "delta", "content", "prompt_tokens", "completion_tokens", "x"]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=15,
)
event_data = st.one_of(
    json_any.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=60),
    st.integers(1, 5000).map(lambda depth: b'{"x":' + b"[" * depth),
)


@fuzz()
@given(event_data, st.booleans(), st.sampled_from([b"data: ", b"data:", b"event: x\ndata: ", b""]))
@example(b'{"x":' + b"[" * 100_000, True, b"data: ")
def test_any_upstream_event_is_accounted_or_passed_through(
    data: bytes, wants_usage: bool, prefix: bytes
) -> None:
    """The relay reads usage and text timing off each event; an event it cannot read passes through as it
    came (an upstream's deeply nested JSON once escaped as RecursionError and broke the client's stream)."""
    rt = _Runtime()
    relay = _Relay(rt, 0.0, wants_usage, None)  # type: ignore[arg-type]
    assert relay._on_event(prefix + data + b"\n\n") in (True, False)
    assert all(isinstance(p, int) and isinstance(c, int) for p, c in rt.metrics.tokens)


def test_an_upstream_event_nested_too_deeply_passes_through_unread() -> None:
    rt = _Runtime()
    relay = _Relay(rt, 0.0, False, None)  # type: ignore[arg-type]
    assert relay._on_event(b'data: {"x":' + b"[" * 100_000 + b"\n\n") is True
    assert rt.metrics.tokens == []


class _Reply:
    """What the relay reads of an upstream reply's headers (aiohttp decodes header bytes as UTF-8 with
    surrogateescape)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.response = self
        self.headers = headers


@fuzz()
@given(st.binary(min_size=1, max_size=40).filter(lambda b: not (set(b) & {0, 10, 13})))
@example("text/plain; charset=\u20ac".encode())
def test_upstream_header_values_pass_through_as_the_bytes_that_came(raw: bytes) -> None:
    """An upstream header value outside latin-1 (a UTF-8 '\u20ac' in Content-Type or Retry-After) once raised
    UnicodeEncodeError on its way to the client: a 500 for a whole answer."""
    reply = _Reply({"content-type": raw.decode("utf-8", "surrogateescape")})
    assert _header(reply, b"content-type") == raw  # type: ignore[arg-type]
