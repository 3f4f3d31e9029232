"""The OpenAI text routes' SSE response (api/completions.py `streamed`) around the LLM service's choices:
a client gone before the body's first byte still gets its sequences aborted in the engine (the body
never ran, so its own `finally` could not), and a stream that ends on its own aborts nothing."""

from __future__ import annotations

from collections.abc import Callable

from inferd.api.completions import CompletionRequest, _completion_chunk, _TextCall, streamed
from inferd.core.call import Call
from inferd.core.disconnect import STAYING
from inferd.wire import protocol as p
from tests.unit.test_llm_failover import make_runtime, step, worker_of


class FakePeer:
    """A connection that has already gone (`gone`) or stays; records what is sent through it."""

    def __init__(self, gone: bool) -> None:
        self.gone = gone
        self.sent: list[bytes] = []
        self.started = False

    def watch(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        if self.gone:
            on_gone()
        return lambda: None

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True

    async def write(self, chunk: bytes) -> None:
        self.sent.append(chunk)

    async def end_stream(self) -> None:
        self.sent.append(b"<end>")


async def send_completion(gone: bool, play: bool) -> tuple[FakePeer, list[p.Message], int]:
    rt, workers = make_runtime(n_workers=1)
    call = Call(error_body=lambda exc, status: b"", departure=STAYING)
    req = CompletionRequest(model="sim-llm", prompt="tell me", max_tokens=2, stream=True)
    text = _TextCall(rt, req, call, "text_completion", "cmpl-1", "tell me", 2)
    choices = await text.start()
    if play:
        (s,) = choices.streams
        step(rt, worker_of(rt, workers, s), {s.seq_id: [0, 1]}, finish="length")
    response = streamed(text, choices, _completion_chunk)
    assert response.header(b"x-inferd-worker") == workers[0].worker_id.encode()
    peer = FakePeer(gone)
    await response.send(peer)  # type: ignore[arg-type]
    return peer, workers[0].writer.sent, rt.client_aborts  # type: ignore[attr-defined]


async def test_a_client_gone_before_the_first_byte_gets_its_sequence_aborted() -> None:
    peer, sent, client_aborts = await send_completion(gone=True, play=False)
    assert not peer.started and peer.sent == []
    assert [type(m) for m in sent] == [p.AddSequence, p.AbortSequence] and client_aborts == 1


async def test_a_stream_that_ends_on_its_own_aborts_nothing() -> None:
    peer, sent, client_aborts = await send_completion(gone=False, play=True)
    assert peer.started and len(peer.sent) == 3 and peer.sent[1:] == [b"data: [DONE]\n\n", b"<end>"]
    assert b'"choices":[{"index":0,"text":"the of","logprobs":null,"finish_reason":"length"}]' in peer.sent[0]
    assert [type(m) for m in sent] == [p.AddSequence] and client_aborts == 0
