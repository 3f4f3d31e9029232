"""One ModelStreamInfer stream's bookkeeping (grpc_edge/stream.py StreamRequests), with fake answers and
a fake writer: answers by id in any order, exactly one last response per request, the in-flight bound,
errors that leave the stream going, writes that never overlap, a half-close that still gets every
answer, a cancelled stream that cancels every request's work, the drain; and `reply_responses`, a
chain's reply as the stream's responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
import pytest

from inferd.core.call import Call
from inferd.core.disconnect import STAYING
from inferd.errors import DeadlineExceeded
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.reply import GrpcReply
from inferd.grpc_edge.stream import FINAL, Response, StreamRequests, error_response, reply_responses


def answered(request: pb.ModelInferRequest, text: str = "") -> pb.ModelStreamInferResponse:
    response = pb.ModelStreamInferResponse()
    response.infer_response.id = request.id
    response.infer_response.model_name = text
    return response


class Requests:
    """The client's side of the stream: requests sent one by one, then a half-close."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()

    def send(self, rid: str) -> None:
        self.queue.put_nowait(pb.ModelInferRequest(id=rid, model_name="m"))

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[pb.ModelInferRequest]:
        while (request := await self.queue.get()) is not None:
            yield request


class Fakes:
    """Answers held until released (`release[id]`), an answer per piece count, a writer that records."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.pieces: dict[str, int] = {}
        self.written: list[pb.ModelStreamInferResponse] = []
        self.got_write = asyncio.Event()
        self.cancelled: list[str] = []
        self.closed: list[str] = []
        self.writing = 0
        self.most_writing = 0
        self.answering = asyncio.Event()
        """Set once an answer has begun (its request read and admitted)."""

    def hold(self, rid: str) -> None:
        self.release[rid] = asyncio.Event()

    async def answer(self, request: pb.ModelInferRequest) -> AsyncIterator[Response]:
        rid = request.id
        self.answering.set()
        try:
            if rid.startswith("boom"):
                raise RuntimeError("a defect")
            n = self.pieces.get(rid, 1)
            for i in range(n):
                if rid in self.release:
                    await self.release[rid].wait()
                yield answered(request, f"piece {i}"), i == n - 1
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.closed.append(rid)

    async def write(self, response: pb.ModelStreamInferResponse) -> None:
        self.writing += 1
        self.most_writing = max(self.most_writing, self.writing)
        await asyncio.sleep(0)  # a write that waits for the transport
        self.writing -= 1
        self.written.append(response)
        self.got_write.set()

    async def until_written(self, count: int) -> None:
        while len(self.written) < count:
            self.got_write.clear()
            await self.got_write.wait()

    def ids(self) -> list[str]:
        return [r.infer_response.id for r in self.written]


async def test_answers_go_out_by_id_in_the_order_they_are_ready() -> None:
    fakes, requests = Fakes(), Requests()
    fakes.hold("slow")
    stream = StreamRequests(8, fakes.answer, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("slow")
    requests.send("fast")
    await fakes.until_written(1)
    assert fakes.ids() == ["fast"] and stream.in_flight == 1
    fakes.release["slow"].set()
    requests.close()
    await run
    assert fakes.ids() == ["fast", "slow"] and stream.in_flight == 0
    assert sorted(fakes.closed) == ["fast", "slow"] and not fakes.cancelled


async def test_a_request_past_the_bound_is_refused_at_once_and_its_room_comes_back() -> None:
    fakes, requests = Fakes(), Requests()
    for rid in ("a", "b"):
        fakes.hold(rid)
    stream = StreamRequests(2, fakes.answer, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    for rid in ("a", "b", "c"):
        requests.send(rid)
    await fakes.until_written(1)
    (refused,) = fakes.written
    assert refused.infer_response.id == "c" and stream.in_flight == 2
    assert refused.infer_response.parameters[FINAL].bool_param
    message = refused.error_message
    assert message.startswith("[StatusCode.RESOURCE_EXHAUSTED] the stream has 2 requests in flight")
    assert "grpc_stream_max_in_flight" in message and message.endswith("(request 'c')")
    fakes.release["a"].set()
    await fakes.until_written(2)
    assert stream.in_flight == 1
    requests.send("d")  # the room "a" freed
    await fakes.until_written(3)
    assert fakes.ids() == ["c", "a", "d"] and not fakes.written[2].error_message
    fakes.release["b"].set()
    requests.close()
    await run
    assert fakes.ids() == ["c", "a", "d", "b"] and stream.in_flight == 0


async def test_the_room_is_free_once_the_last_response_is_made_before_it_is_written() -> None:
    fakes, requests = Fakes(), Requests()
    seen: list[int] = []

    async def write(response: pb.ModelStreamInferResponse) -> None:
        seen.append(stream.in_flight)
        await fakes.write(response)

    fakes.pieces["a"] = 3
    stream = StreamRequests(1, fakes.answer, write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("a")
    requests.close()
    await run
    assert seen == [1, 1, 0] and len(fakes.written) == 3
    assert [r.infer_response.parameters[FINAL].bool_param for r in fakes.written] == [False, False, True]


async def test_an_answer_that_raises_is_an_internal_error_and_the_stream_goes_on() -> None:
    fakes, requests = Fakes(), Requests()
    stream = StreamRequests(4, fakes.answer, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("boom-1")
    requests.send("ok")
    requests.close()
    await run
    by_id = {r.infer_response.id: r for r in fakes.written}
    assert by_id["boom-1"].error_message.startswith("[StatusCode.INTERNAL] internal error (id ")
    assert by_id["ok"].error_message == "" and len(fakes.written) == 2 and stream.in_flight == 0


async def test_an_answer_without_a_last_response_still_ends_its_request() -> None:
    fakes, requests = Fakes(), Requests()

    async def unfinished(request: pb.ModelInferRequest) -> AsyncIterator[Response]:
        yield answered(request), False

    stream = StreamRequests(4, unfinished, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("x")
    requests.close()
    await run
    assert fakes.ids() == ["x", "x"] and stream.in_flight == 0
    assert "[StatusCode.INTERNAL] its answer ended without a last response" in fakes.written[1].error_message


async def test_writes_never_overlap() -> None:
    fakes, requests = Fakes(), Requests()
    for i in range(6):
        fakes.pieces[f"r{i}"] = 4
    stream = StreamRequests(8, fakes.answer, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    for i in range(6):
        requests.send(f"r{i}")
    requests.close()
    await run
    assert len(fakes.written) == 24 and fakes.most_writing == 1


async def test_a_cancelled_stream_cancels_every_request_in_flight() -> None:
    fakes, requests = Fakes(), Requests()
    for rid in ("a", "b"):
        fakes.hold(rid)
    stream = StreamRequests(4, fakes.answer, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("a")
    requests.send("b")
    requests.send("c")
    await fakes.until_written(1)  # "c" answered; "a" and "b" wait
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert sorted(fakes.cancelled) == ["a", "b"] and sorted(fakes.closed) == ["a", "b", "c"]
    assert stream.in_flight == 0 and fakes.ids() == ["c"]


def test_error_response_names_the_status_the_request_and_its_metadata() -> None:
    request = pb.ModelInferRequest(id="r7", model_name="sim", model_version="2")
    response = error_response(request, grpc.StatusCode.NOT_FOUND, "unknown model 'x'", [("retry-after", "1")])
    assert response.error_message == "[StatusCode.NOT_FOUND] unknown model 'x' (request 'r7')"
    answer = response.infer_response
    assert (answer.id, answer.model_name, answer.model_version) == ("r7", "sim", "2")
    assert answer.parameters["retry-after"].string_param == "1"
    anonymous = error_response(pb.ModelInferRequest(), grpc.StatusCode.INTERNAL, "oops")
    assert anonymous.error_message == "[StatusCode.INTERNAL] oops"


async def test_a_drained_stream_reads_no_more_and_ends_once_what_it_read_is_answered() -> None:
    fakes, requests = Fakes(), Requests()
    fakes.hold("a")
    stream = StreamRequests(4, fakes.answer, fakes.write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("a")
    await fakes.answering.wait()  # "a" read and admitted; the reader waits for the next request
    stream.drain()
    requests.send("late")  # sent after the drain began: never read
    await asyncio.sleep(0)
    assert not run.done()  # "a" is still owed its answer
    fakes.release["a"].set()
    await run
    assert fakes.ids() == ["a"] and stream.in_flight == 0 and requests.queue.qsize() == 1


async def test_a_drain_while_a_request_is_being_admitted_keeps_that_request() -> None:
    fakes, requests = Fakes(), Requests()
    refusals: list[pb.ModelStreamInferResponse] = []

    async def write(response: pb.ModelStreamInferResponse) -> None:
        if response.error_message:  # the refusal's write: the drain comes while the reader is busy
            stream.drain()
            refusals.append(response)
        await fakes.write(response)

    fakes.hold("a")
    stream = StreamRequests(1, fakes.answer, write)
    run = asyncio.create_task(stream.run(requests))
    requests.send("a")
    requests.send("b")  # past the bound: refused, and the drain begins during that write
    requests.send("c")
    await fakes.until_written(1)
    fakes.release["a"].set()
    await run
    assert [r.infer_response.id for r in refusals] == ["b"] and fakes.ids() == ["b", "a"]
    assert requests.queue.qsize() == 1  # "c" never read


def make_call() -> Call:
    return Call(lambda exc, status: b"", STAYING)


async def collect(call: Call, request: pb.ModelInferRequest, reply: GrpcReply) -> list[tuple[pb.ModelStreamInferResponse, bool]]:
    return [r async for r in reply_responses(call, request, reply)]


async def test_a_reply_becomes_the_stream_s_responses() -> None:
    request = pb.ModelInferRequest(id="r", model_name="m")
    refused = GrpcReply(None, [(b"retry-after", b"1")], 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota")
    ((error, last),) = await collect(make_call(), request, refused)
    assert last and error.error_message == "[StatusCode.RESOURCE_EXHAUSTED] over quota (request 'r')"
    assert error.infer_response.parameters["retry-after"].string_param == "1"
    unary = GrpcReply(pb.ModelInferResponse(id="r", model_name="m"))
    ((answer, last),) = await collect(make_call(), request, unary)
    assert last and answer.infer_response.id == "r" and not answer.error_message


async def test_a_streamed_reply_s_error_after_its_pieces_is_its_last_response() -> None:
    closed: list[str] = []

    async def pieces() -> AsyncIterator[tuple[pb.ModelInferResponse, bool]]:
        yield pb.ModelInferResponse(id="r"), False
        raise DeadlineExceeded("the request ran past its deadline")

    call, request = make_call(), pb.ModelInferRequest(id="r")
    reply = GrpcReply(pieces(), streamed=True)
    reply.on_close(lambda: closed.append(call.outcome))
    out = await collect(call, request, reply)
    assert [last for _, last in out] == [False, True] and not out[0][0].error_message
    assert out[1][0].error_message.startswith("[StatusCode.DEADLINE_EXCEEDED] the request ran past its deadline")
    assert closed == ["deadline"]  # accounted with the error's outcome, once the reply closed


async def test_a_streamed_reply_cut_by_the_stream_s_end_is_counted_cancelled() -> None:
    closed: list[str] = []

    async def pieces() -> AsyncIterator[tuple[pb.ModelInferResponse, bool]]:
        for _ in range(3):
            yield pb.ModelInferResponse(id="r"), False

    call = make_call()
    reply = GrpcReply(pieces(), streamed=True)
    reply.on_close(lambda: closed.append(call.outcome))
    async with aclosing(reply_responses(call, pb.ModelInferRequest(id="r"), reply)) as responses:
        async for _ in responses:
            break  # the stream went away after the first piece
    assert closed == ["cancelled"]
