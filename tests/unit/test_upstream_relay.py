"""The pieces of the openai-upstream relay that need no network: cutting a byte stream into whole SSE
events, and the request as sent upstream."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.api.upstream import SSESplitter, client_wants_usage, upstream_payload

events = st.lists(
    st.builds(
        lambda body, crlf: f"data: {json.dumps(body)}" + ("\r\n\r\n" if crlf else "\n\n"),
        st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=3),
        st.booleans(),
    ),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(events, st.lists(st.integers(0, 400), max_size=10))
def test_any_split_of_the_stream_gives_back_the_same_whole_events(evs: list[str], cuts: list[int]) -> None:
    stream = "".join(evs).encode()
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    splitter = SSESplitter(1 << 20)
    out = [event for piece in pieces for event in splitter.feed(piece)]
    assert out == [e.encode() for e in evs]


def test_an_event_that_never_ends_is_an_error_not_a_growing_buffer() -> None:
    splitter = SSESplitter(64)
    splitter.feed(b"data: " + b"x" * 50)
    with pytest.raises(ValueError, match="exceeds 64 bytes"):
        splitter.feed(b"x" * 50)


def test_streams_ask_upstream_for_usage_and_name_the_upstream_model() -> None:
    req = {"model": "front-name", "prompt": "hi", "stream": True, "stream_options": {"x": 1}}
    sent = json.loads(upstream_payload(req, "org/upstream-model", stream=True))
    assert sent == {**req, "model": "org/upstream-model", "stream_options": {"x": 1, "include_usage": True}}
    assert not client_wants_usage(req)
    assert client_wants_usage({"stream_options": {"include_usage": True}})


def test_non_streaming_requests_go_up_unchanged_but_for_the_model() -> None:
    req = {"model": "front-name", "messages": [], "n": 2, "logprobs": True}
    assert json.loads(upstream_payload(req, "up", stream=False)) == {**req, "model": "up"}
