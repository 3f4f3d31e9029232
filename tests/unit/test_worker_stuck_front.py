"""A worker serving several front ends is never held up by one that stopped reading (worker/stuck.py):
the drain watch (a plain object on a fake clock) says when a link is stuck, a link says so from its own
write buffer and is cut off, and the LLM engine's flush waits only for front ends that hold up nobody
else."""

from __future__ import annotations

import asyncio

import pytest

from inferd.clock import FakeClock
from inferd.wire import protocol as p
from inferd.worker.fronts import FINISH_POLL_S, FrontLink, SequenceOwners
from inferd.worker.stuck import LINK_HARD_LIMIT_BYTES, LINK_HIGH_WATER_BYTES, DrainWatch, positive_seconds

AFTER_S = 10.0


# ---- the drain watch ------------------------------------------------------------------------------------
def test_an_empty_buffer_is_never_stuck() -> None:
    clock, watch = FakeClock(), DrainWatch(AFTER_S)
    for _ in range(100):
        assert not watch.observe(clock.now(), 0, 5_000)
        clock.advance(1.0)


def test_a_buffer_that_does_not_move_is_stuck_only_after_the_threshold() -> None:
    clock, watch = FakeClock(), DrainWatch(AFTER_S)
    assert not watch.observe(clock.now(), 800, 1_000)  # non-empty from here on, nothing goes out
    clock.advance(AFTER_S - 0.5)
    assert not watch.observe(clock.now(), 800, 1_000)
    clock.advance(0.5)
    assert watch.observe(clock.now(), 800, 1_000)
    assert watch.stuck_for_s(clock.now()) == pytest.approx(AFTER_S)


def test_more_written_to_a_buffer_that_does_not_drain_is_no_progress() -> None:
    clock, watch = FakeClock(), DrainWatch(AFTER_S)
    sent = buffered = 1_000
    stuck = []
    for _ in range(12):  # a heartbeat a second lands in the buffer, none leaves it
        stuck.append(watch.observe(clock.now(), buffered, sent))
        clock.advance(1.0)
        sent += 40
        buffered += 40
    assert stuck.index(True) == 10


def test_a_buffer_that_shrinks_is_making_progress() -> None:
    clock, watch = FakeClock(), DrainWatch(AFTER_S)
    buffered = 10_000_000
    for _ in range(30):  # a slow reader: a little leaves the buffer between looks, 30 s in all
        assert not watch.observe(clock.now(), buffered, 20_000_000)
        clock.advance(1.0)
        buffered -= 100


def test_bytes_passed_on_count_as_progress_even_when_the_buffer_grew() -> None:
    clock, watch = FakeClock(), DrainWatch(AFTER_S)
    sent, buffered = 1_000, 500
    for _ in range(30):  # each second 300 bytes more are written and 200 go out: the buffer grows
        assert not watch.observe(clock.now(), buffered, sent)
        clock.advance(1.0)
        sent += 300
        buffered += 100


def test_draining_resets_the_count() -> None:
    clock, watch = FakeClock(), DrainWatch(AFTER_S)
    assert not watch.observe(clock.now(), 800, 1_000)
    clock.advance(AFTER_S - 1)
    assert not watch.observe(clock.now(), 0, 1_000)  # it all went out
    assert watch.stuck_for_s(clock.now()) == 0.0
    assert not watch.observe(clock.now(), 300, 1_300)  # a new message waits: counted from now
    clock.advance(AFTER_S - 1)
    assert not watch.observe(clock.now(), 300, 1_300)
    clock.advance(1)
    assert watch.observe(clock.now(), 300, 1_300)


def test_the_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stuck_after_s"):
        DrainWatch(0)
    with pytest.raises(ValueError, match="positive"):
        positive_seconds("-1")
    assert positive_seconds("2.5") == 2.5


# ---- a link over a fake connection --------------------------------------------------------------------
class FakeTransport:
    def __init__(self) -> None:
        self.buffered = 0
        self.high = 65536
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 65536 if high is None else high

    def abort(self) -> None:
        self.aborted = True
        self.buffered = 0


class FakeWriter:
    """A connection whose peer reads nothing until the test says so (`drained`)."""

    def __init__(self) -> None:
        self.transport = FakeTransport()
        self.waiting = asyncio.Event()
        self.drained = asyncio.Event()
        self.closed_cleanly = False

    def write(self, data: bytes) -> None:
        self.transport.buffered += len(data)

    def is_closing(self) -> bool:
        return self.transport.aborted

    def close(self) -> None:
        self.closed_cleanly = not self.transport.aborted  # closed, not cut off (abort) first
        self.transport.aborted = True

    async def drain(self) -> None:
        if self.transport.buffered > self.transport.high:
            self.waiting.set()
            await self.drained.wait()


def link(index: int, stuck_after_s: float = AFTER_S, lifeline: bool = False) -> tuple[FrontLink, FakeWriter]:
    writer = FakeWriter()
    front = FrontLink.joined(index, f"front-{index}", writer, stuck_after_s, lifeline)  # type: ignore[arg-type]
    return front, writer


def test_a_link_raises_its_high_water_mark_and_is_cut_off_once_stuck() -> None:
    clock = FakeClock()
    front, writer = link(0, stuck_after_s=3.0)
    assert writer.transport.high == LINK_HIGH_WATER_BYTES
    front.send(p.Heartbeat(running=0, completed_batches=0))
    assert front.buffered() > 0
    stuck = []
    for _ in range(4):
        stuck.append(front.cut_off_if_stuck(clock.now()))
        clock.advance(1.0)
    assert stuck == [False, False, False, True]
    assert writer.transport.aborted and front.closed
    front.send(p.Heartbeat(running=0, completed_batches=0))  # a link cut off sends nothing more
    assert front.buffered() == 0


def test_a_link_buffering_more_than_its_credits_allow_is_cut_off_at_once() -> None:
    front, writer = link(0)
    writer.transport.buffered = LINK_HARD_LIMIT_BYTES
    front.send(p.Heartbeat(running=0, completed_batches=0))
    assert writer.transport.aborted and front.closed


def test_frames_sent_together_go_out_in_one_write_in_order() -> None:
    front, writer = link(0)
    writes: list[bytes] = []
    writer.write = lambda data: writes.append(bytes(data))  # type: ignore[method-assign]
    done, credit = p.BatchDone(7, 0.02, outputs=[{"OUTPUT0": b"x"}]), p.Credit(1, True, False, 0)
    with front.together():
        front.send(done)
        front.send(credit)
        assert writes == []  # held until the end
    assert writes == [p.encode_frame(done) + p.encode_frame(credit)]
    assert front.sent_bytes == len(writes[0])
    front.send(credit)  # outside: at once, as before
    assert writes[1] == p.encode_frame(credit)


def test_frames_held_for_a_link_cut_off_meanwhile_are_dropped() -> None:
    front, writer = link(0)
    with front.together():
        front.send(p.Heartbeat(running=0, completed_batches=0))
        front.cut_off("test")
    assert writer.transport.buffered == 0 and front.sent_bytes == 0


def test_frames_sent_together_past_the_hard_limit_cut_the_link_off() -> None:
    front, writer = link(0)
    writer.transport.buffered = LINK_HARD_LIMIT_BYTES
    with front.together():
        front.send(p.Heartbeat(running=0, completed_batches=0))
        assert not front.closed
    assert writer.transport.aborted and front.closed


async def test_the_engine_does_not_wait_for_a_front_end_far_behind_while_another_keeps_up() -> None:
    (slow, slow_writer), (ok, ok_writer) = link(0), link(1)
    owners = SequenceOwners(lambda: {0: slow, 1: ok})
    slow_writer.transport.buffered = LINK_HIGH_WATER_BYTES + 1
    ok_writer.transport.buffered = 1000
    await asyncio.wait_for(owners.flush(), 5)  # returns without slow's drain (nobody drains it)
    assert slow_writer.transport.aborted and slow.closed
    assert not ok_writer.transport.aborted and not ok.closed


async def test_a_sole_front_end_far_behind_holds_the_engine_back_until_it_reads() -> None:
    front, writer = link(0)
    owners = SequenceOwners(lambda: {0: front})
    writer.transport.buffered = LINK_HIGH_WATER_BYTES + 1
    flushing = asyncio.create_task(owners.flush())
    await asyncio.wait_for(writer.waiting.wait(), 5)
    assert not flushing.done() and not writer.transport.aborted  # backpressure, not a cut
    writer.drained.set()
    await asyncio.wait_for(flushing, 5)
    assert not front.closed


async def test_the_engine_waits_for_nobody_below_the_high_water_mark() -> None:
    (a, a_writer), (b, b_writer) = link(0), link(1)
    owners = SequenceOwners(lambda: {0: a, 1: b})
    a_writer.transport.buffered = b_writer.transport.buffered = LINK_HIGH_WATER_BYTES
    await asyncio.wait_for(owners.flush(), 5)
    assert not a.closed and not b.closed


async def test_a_session_ending_lets_its_last_messages_go_out_then_closes() -> None:
    front, writer = link(0)
    front.send(p.Heartbeat(running=0, completed_batches=0))
    front.closed = True  # detached: it sends nothing more, but what it holds still goes out
    finishing = asyncio.create_task(front.finish(timeout_s=30))
    for _ in range(5):  # a few of its polls: it waits for all of it, well under the high-water mark too
        await asyncio.sleep(FINISH_POLL_S)
    assert front.buffered() > 0 and not finishing.done() and not writer.is_closing()
    writer.transport.buffered = 0  # the front end read it
    await asyncio.wait_for(finishing, 5)
    assert writer.closed_cleanly


async def test_a_session_ending_with_nothing_held_closes_at_once() -> None:
    """Nothing buffered: closed without waiting (a TLS transport told a high-water mark of 0 pauses
    writing even when empty, and a wait for it to drain then lasted until the peer closed)."""
    front, writer = link(0)
    await asyncio.wait_for(front.finish(timeout_s=30), 1)
    assert writer.closed_cleanly


async def test_a_session_ending_cuts_off_a_front_end_that_reads_none_of_its_last_messages() -> None:
    front, writer = link(0)
    front.send(p.Heartbeat(running=0, completed_batches=0))
    await asyncio.wait_for(front.finish(timeout_s=0.05), 5)  # nobody drains it
    assert writer.transport.aborted and front.closed


async def test_a_local_workers_own_front_end_is_waited_for_never_cut_off() -> None:
    """The lifeline (a local worker's first front end, whose going ends the worker): far behind while
    another keeps up, or stuck, it is waited for: cutting it off would end the worker for every front end."""
    clock = FakeClock()
    (owner, owner_writer), (other, _) = link(0, stuck_after_s=1.0, lifeline=True), link(1)
    owners = SequenceOwners(lambda: {0: owner, 1: other})
    owner_writer.transport.buffered = LINK_HIGH_WATER_BYTES + 1
    flushing = asyncio.create_task(owners.flush())
    await asyncio.wait_for(owner_writer.waiting.wait(), 5)
    assert not flushing.done() and not owner_writer.transport.aborted
    for _ in range(5):
        assert not owner.cut_off_if_stuck(clock.now())
        clock.advance(1.0)
    owner_writer.transport.buffered = 0
    owner_writer.drained.set()
    await asyncio.wait_for(flushing, 5)
    assert not owner.closed and not other.closed


async def test_when_one_of_the_links_behind_drains_the_others_still_behind_are_cut_off() -> None:
    """Every link behind: the engine waits; once one drains (it keeps up again), the step goes on and
    those still behind are cut off instead of waited for."""
    (a, a_writer), (b, b_writer) = link(0), link(1)
    owners = SequenceOwners(lambda: {0: a, 1: b})
    a_writer.transport.buffered = b_writer.transport.buffered = LINK_HIGH_WATER_BYTES + 1
    flushing = asyncio.create_task(owners.flush())
    await asyncio.wait_for(a_writer.waiting.wait(), 5)
    a_writer.transport.buffered = 0
    a_writer.drained.set()
    await asyncio.wait_for(flushing, 5)  # not held until b drains
    assert b_writer.transport.aborted and b.closed and not a.closed


def test_a_left_link_is_done_only_once_its_batches_and_sequences_are_back() -> None:
    # The heartbeat ends a left link's session when this says so: it once did as soon as the front end
    # answered Drain, dropping the batches still on the device (the front end counted them lost).
    front, _ = link(0)
    front.took()
    assert not front.has_left(holds_sequences=False)  # not left
    front.leaving = True
    assert not front.has_left(holds_sequences=False)  # no answer to its Drain yet: it may still send work
    front.answered_drain = True
    assert not front.has_left(holds_sequences=False)  # a batch of its is still on the worker
    front.answered()
    assert front.has_left(holds_sequences=False)
    assert not front.has_left(holds_sequences=True)  # an engine's sequence of its still runs
