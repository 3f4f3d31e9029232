"""until_disconnect, the one client-disconnect watch of the front end, and its callers: the streaming
response, and the infer path's wait for its items (kinds/batch/service.py, watching through `Peer.watch`). Over ASGI's receive() (AsgiPeer) and over a peer that
knows of the disconnect itself, as the front door's connection does (a callback, no task)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferd.api.asgi import StreamingResponse
from inferd.api.peer import AsgiPeer
from inferd.clock import FakeClock
from inferd.core.disconnect import ClientGone, until_disconnect
from inferd.kinds.batch.service import BatchService


class FakeClient:
    """receive() as a server gives it: `http.request` messages, then `http.disconnect` on call number
    `leave_on` (None: the client never leaves, the call blocks until cancelled). With `gate`, the leaving
    call first waits for the gate to open."""

    def __init__(self, leave_on: int | None, gate: asyncio.Event | None = None) -> None:
        self.leave_on = leave_on
        self.gate = gate
        self.calls = 0
        self.waiting = asyncio.Event()
        self.cancelled = False

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        if self.leave_on is None or self.calls == self.leave_on:
            self.waiting.set()
            try:
                if self.leave_on is None:
                    await asyncio.get_running_loop().create_future()
                if self.gate is not None:
                    await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"", "more_body": False}


class Work:
    """A piece of work that finishes when `done` is set (never, unless a test sets it)."""

    def __init__(self, value: object = None) -> None:
        self.value = value
        self.done = asyncio.Event()
        self.cancelled = False

    async def run(self) -> object:
        try:
            await self.done.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self.value


def other_tasks(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not current and t not in before and not t.done()]


async def test_disconnect_after_n_receives_cancels_work_that_never_finishes() -> None:
    before = set(asyncio.all_tasks())
    client, work = FakeClient(leave_on=3), Work()
    with pytest.raises(ClientGone):
        await until_disconnect(AsgiPeer(client.receive), work.run())
    assert work.cancelled
    assert client.calls == 3
    assert other_tasks(before) == []


async def test_work_that_finishes_first_returns_its_value_and_stops_the_watch() -> None:
    before = set(asyncio.all_tasks())
    client, work = FakeClient(leave_on=None), Work("answer")

    async def finish_once_watched() -> object:
        await client.waiting.wait()  # the watch is reading receive()
        work.done.set()
        return await work.run()

    assert await until_disconnect(AsgiPeer(client.receive), finish_once_watched()) == "answer"
    await asyncio.sleep(0)  # the cancelled watcher ends on the loop's next turn
    assert client.cancelled, "the watcher's receive() was left running"
    assert not work.cancelled
    assert other_tasks(before) == []


async def test_a_future_is_cancelled_when_the_client_leaves() -> None:
    client = FakeClient(leave_on=1)
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(ClientGone):
        await until_disconnect(AsgiPeer(client.receive), reply)
    assert reply.cancelled()


async def test_a_receive_failure_counts_as_the_client_gone() -> None:
    async def broken() -> dict[str, Any]:
        raise OSError("connection reset")

    work = Work()
    with pytest.raises(ClientGone):
        await until_disconnect(AsgiPeer(broken), work.run())
    assert work.cancelled


class KnowingPeer:
    """A peer told of the disconnect by its connection (as api/exchange.Exchange is): watches are
    callbacks it calls when `leave` is called."""

    def __init__(self) -> None:
        self.watchers: list[Any] = []
        self.gone = False
        self.watched = 0

    def leave(self) -> None:
        self.gone = True
        for on_gone in list(self.watchers):
            on_gone()

    def watch(self, on_gone: Any) -> Any:
        self.watched += 1
        if self.gone:
            asyncio.get_running_loop().call_soon(on_gone)
            return lambda: None
        self.watchers.append(on_gone)
        return lambda: self.watchers.remove(on_gone)


async def test_work_done_first_leaves_no_watch_and_no_task() -> None:
    before = set(asyncio.all_tasks())
    peer = KnowingPeer()
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(reply.set_result, 7)
    assert await until_disconnect(peer, reply) == 7  # type: ignore[arg-type]
    assert peer.watched == 1 and peer.watchers == []
    assert other_tasks(before) == []


async def test_a_client_that_left_before_the_watch_is_still_seen() -> None:
    peer, work = KnowingPeer(), Work()
    peer.leave()
    with pytest.raises(ClientGone):
        await until_disconnect(peer, work.run())  # type: ignore[arg-type]
    assert work.cancelled


async def test_a_knowing_peer_cancels_the_work_when_the_client_leaves() -> None:
    peer, work = KnowingPeer(), Work()
    asyncio.get_running_loop().call_later(0.001, peer.leave)
    with pytest.raises(ClientGone):
        await until_disconnect(peer, work.run())  # type: ignore[arg-type]
    assert work.cancelled and peer.watchers == []


async def test_cancelling_the_caller_cancels_the_work_and_is_not_client_gone() -> None:
    before = set(asyncio.all_tasks())
    client, work = FakeClient(leave_on=None), Work()
    caller = asyncio.ensure_future(until_disconnect(AsgiPeer(client.receive), work.run()))
    await client.waiting.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert work.cancelled
    assert client.cancelled
    assert other_tasks(before) == []


async def test_caller_cancelled_as_the_client_leaves_stays_a_cancellation() -> None:
    gate = asyncio.Event()
    client, work = FakeClient(leave_on=1, gate=gate), Work()
    caller = asyncio.ensure_future(until_disconnect(AsgiPeer(client.receive), work.run()))
    await client.waiting.wait()
    gate.set()  # the watcher sees the disconnect on its next step...
    caller.cancel()  # ...and the caller is cancelled in the same step
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert work.cancelled


# ---- callers ------------------------------------------------------------------------------------------------
class Body:
    """A streaming body: `chunks`, then (if `then_wait`) waits forever; records that it was closed."""

    def __init__(self, chunks: list[bytes], then_wait: bool) -> None:
        self.chunks = chunks
        self.then_wait = then_wait
        self.closed = False

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            for chunk in self.chunks:
                yield chunk
            if self.then_wait:
                await asyncio.get_running_loop().create_future()
        finally:
            self.closed = True


async def test_streaming_response_cancels_and_closes_its_body_when_the_client_leaves() -> None:
    before = set(asyncio.all_tasks())
    gate = asyncio.Event()
    client, body = FakeClient(leave_on=1, gate=gate), Body([b"data: 1\n\n"], then_wait=True)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            gate.set()  # the client leaves once it has the first event

    response = StreamingResponse(body.stream())
    ended: list[bool] = []
    response.on_close(lambda: ended.append(True))
    await response.send(AsgiPeer(client.receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n"
    assert body.closed
    assert ended == [True]
    assert other_tasks(before) == []


async def test_streaming_response_sends_the_whole_body_and_stops_watching() -> None:
    client, body = FakeClient(leave_on=None), Body([b"a", b"b"], then_wait=False)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await StreamingResponse(body.stream()).send(AsgiPeer(client.receive, send))
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b", b""]
    assert sent[-1]["more_body"] is False
    assert body.closed


class FakeRuntime:
    """A batch runtime that queues `items` as they are (their replies settled by the test)."""

    def __init__(self, items: list[Any]) -> None:
        self.clock = FakeClock()
        self.items = items
        self.withdrawn: list[Any] = []
        self.service = BatchService(self)

    def enqueue(self, payloads: list[Any], deadline: Any, priority: int, tenant: Any) -> list[Any]:
        assert len(payloads) == len(self.items)
        return self.items

    def withdraw(self, items: list[Any]) -> None:
        self.withdrawn.extend(items)
        for item in items:
            item.reply.cancel()

    def expire(self, items: list[Any]) -> None:
        raise AssertionError("no deadline was set")


class Item:
    def __init__(self) -> None:
        self.reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()


async def test_infer_wait_answered_quickly_leaves_no_watch() -> None:
    peer, items = KnowingPeer(), [Item(), Item()]
    rt = FakeRuntime(items)
    for n, item in enumerate(items):
        asyncio.get_running_loop().call_soon(item.reply.set_result, f"r{n}")
    results = await rt.service.infer([b"a", b"b"], deadline=None, gone=peer.watch)
    assert results == ["r0", "r1"]
    assert peer.watched == 1 and peer.watchers == []
    assert rt.withdrawn == []


async def test_infer_wait_withdraws_its_items_when_the_client_leaves() -> None:
    client, items = FakeClient(leave_on=2), [Item(), Item()]
    rt = FakeRuntime(items)
    with pytest.raises(ClientGone):
        await rt.service.infer([b"a", b"b"], deadline=None, gone=AsgiPeer(client.receive).watch)
    assert rt.withdrawn == items
    assert all(item.reply.cancelled() for item in items)
