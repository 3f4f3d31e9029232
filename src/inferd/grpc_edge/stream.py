"""ModelStreamInfer: many requests on one bidirectional stream, each answered by its id, in any order.

    read      the client's requests, one after the other, as they come (until it half-closes, or the
              server stops: `drain`, and the stream ends once what was read is answered)
    admit     at most `limit` (cfg.grpc_stream_max_in_flight) of the stream's requests in flight; past it
              a request is answered at once with an error response (RESOURCE_EXHAUSTED, naming the bound)
    answer    each admitted request in a task of the stream's TaskGroup, through the same chain as a
              unary call (its own Call): one response, or one per text piece for a streamed LLM request
    write     every response, one at a time (a stream's writes never overlap)

Every response carries `parameters.triton_final_response`: false, then true on its request's last one.
A request leaves the count when its last response is made, before it is written, so a client that sends
its next request once it has read an answer always finds the room it freed.

Errors: a request's error never ends the stream. It is one `ModelStreamInferResponse` whose
`error_message` is `[StatusCode.NAME] message (request 'ID')` (`[StatusCode.NAME] message` when the
request has no id): tritonclient hands it to the stream's callback as an InferenceServerException whose
text names the status, as a unary call's does. Its `infer_response` carries the request's id and model
too, and the error's metadata (retry-after, x-ratelimit-*) as string parameters, for clients that match
answers by id.

Cancellation: when the client cancels the stream (or its channel closes) grpcio cancels the handler,
and the TaskGroup every request's task: a batch request's wait withdraws its queued items, an LLM
request's choices abort their sequences in the engines. A client that half-closes gets every answer
still owed before the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing

import grpc

from inferd.api.middleware import internal
from inferd.core.call import Call
from inferd.errors import ServingError
from inferd.grpc_edge.errors import error_reply
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.reply import GrpcReply

log = logging.getLogger("inferd.grpc")

FINAL = "triton_final_response"
"""The parameter of every response of a stream that says whether it is its request's last (Triton's;
tritonclient's `enable_empty_final_response` relies on it)."""

Response = tuple[pb.ModelStreamInferResponse, bool]
"""A response of a request, and whether it is the request's last."""
Answer = Callable[[pb.ModelInferRequest], AsyncIterator[Response]]
"""A request's responses, the last one flagged; errors come as error responses, never raised (but
CancelledError)."""
Write = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]


def error_response(
    request: pb.ModelInferRequest,
    code: grpc.StatusCode,
    details: str,
    metadata: Sequence[tuple[str, str]] = (),
) -> pb.ModelStreamInferResponse:
    """A request's error on a stream (the form the module docstring documents)."""
    where = f" (request {request.id!r})" if request.id else ""
    response = pb.ModelStreamInferResponse(error_message=f"[{code}] {details}{where}")
    answer = response.infer_response
    answer.id = request.id
    answer.model_name = request.model_name
    answer.model_version = request.model_version
    answer.parameters[FINAL].bool_param = True  # an error is its request's last response
    for name, value in metadata:
        answer.parameters[name].string_param = value
    return response


def _internal(request: pb.ModelInferRequest, details: str) -> pb.ModelStreamInferResponse:
    return error_response(request, grpc.StatusCode.INTERNAL, details)


def refusal(request: pb.ModelInferRequest, limit: int) -> pb.ModelStreamInferResponse:
    """The answer of a request past the stream's bound."""
    return error_response(
        request,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the stream has {limit} requests in flight, its most (grpc_stream_max_in_flight): send this one "
        "again once one of them is answered",
    )


async def reply_responses(
    call: Call, request: pb.ModelInferRequest, reply: GrpcReply
) -> AsyncIterator[Response]:
    """A request's reply as the stream's responses: an error reply's error response; a unary reply's
    one response; a streamed reply's pieces (an LLM's), then, if one fails after the first, its error
    as the request's last response (the call accounted with that error's outcome; "cancelled" when the
    stream ends first). The streamed reply is closed at the end, however it ends (its `on_close`
    callbacks: accounting, the LLM sequences aborted)."""
    if reply.code is not None:
        yield error_response(request, reply.code, reply.details, reply.trailers()), True
        return
    if not reply.streamed:
        yield pb.ModelStreamInferResponse(infer_response=reply.message), True
        return
    ended = False
    try:
        async with aclosing(reply.message) as pieces:
            try:
                async for response, last in pieces:
                    ended = last
                    yield pb.ModelStreamInferResponse(infer_response=response), last
            except ServingError as exc:  # after the first piece: its error ends the request
                ended = True
                failed = error_reply(call, exc)
                code = failed.code or grpc.StatusCode.INTERNAL  # an error reply always has its code
                yield error_response(request, code, failed.details, failed.trailers()), True
            except Exception as exc:
                ended = True
                yield _internal(request, internal(call, exc).message), True
    finally:
        if not ended:  # the stream was cancelled before the request's last response
            call.outcome = "cancelled"
        reply.close()


class StreamRequests:
    """One stream's requests: each admitted one answered in its own task, at most `limit` at a time;
    the responses written one at a time."""

    __slots__ = ("_answer", "_draining", "_in_flight", "_limit", "_reader", "_write", "_writing")

    def __init__(self, limit: int, answer: Answer, write: Write) -> None:
        self._limit = limit
        self._answer = answer
        self._write = write
        self._writing = asyncio.Lock()
        self._in_flight = 0
        self._draining = False
        self._reader: asyncio.Task[None] | None = None
        """The task reading the client's requests while it waits for one (None: it is not waiting)."""

    @property
    def in_flight(self) -> int:
        """The requests admitted whose last response is not made yet."""
        return self._in_flight

    async def run(self, requests: AsyncIterable[pb.ModelInferRequest]) -> None:
        """Every request answered: returns once the client has sent its last request (or `drain` was
        called) and every answer is written. Cancelled, it cancels every request's task (their work
        withdrawn or aborted) and raises CancelledError."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._read(aiter(requests), tasks))

    def drain(self) -> None:
        """Read no more requests (the server is stopping): the stream ends once the requests already
        read are answered."""
        self._draining = True
        if self._reader is not None:  # waiting for a request: none is lost by stopping the wait
            self._reader.cancel()

    async def _read(self, requests: AsyncIterator[pb.ModelInferRequest], tasks: asyncio.TaskGroup) -> None:
        while not self._draining:
            self._reader = asyncio.current_task()
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            finally:
                self._reader = None
            if self._in_flight >= self._limit:
                await self._send(refusal(request, self._limit))
                continue
            self._in_flight += 1
            tasks.create_task(self._one(request))

    async def _one(self, request: pb.ModelInferRequest) -> None:
        counted = True
        try:
            async with aclosing(self._answer(request)) as responses:
                while counted:
                    try:
                        response, last = await anext(responses)
                    except StopAsyncIteration:  # an answer without its last response (a defect)
                        response, last = _internal(request, "its answer ended without a last response"), True
                    except Exception as exc:  # an answer that raised (a defect): an error, the stream goes on
                        error_id = f"{id(exc):x}"
                        log.exception("internal error %s on a stream's request %r", error_id, request.id)
                        response, last = _internal(request, f"internal error (id {error_id})"), True
                    response.infer_response.parameters[FINAL].bool_param = last
                    if last:  # the room is free before the client can read the answer
                        counted = False
                        self._in_flight -= 1
                    await self._send(response)
        finally:
            if counted:
                self._in_flight -= 1

    async def _send(self, response: pb.ModelStreamInferResponse) -> None:
        async with self._writing:
            await self._write(response)
