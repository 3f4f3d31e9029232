"""LLMRuntime as a Runtime (inferd.runtime.contract) on a fake clock, against fake worker connections:
its snapshots, the hang watchdog (no step while sequences run; no heartbeat), deadlines that abort
the sequence in its engine, draining, membership events, and the TTFT signal."""

from __future__ import annotations

import asyncio

import pytest

from inferd.clock import FakeClock
from inferd.errors import DeadlineExceeded, WorkerDied
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.kinds.llm.statistics import LLMRuntimeStatistics, LLMWorkerStatistics
from inferd.kinds.llm.stream import TokenStream
from inferd.kinds.llm.watchdog import HANG_MIN_S, HANG_STEP_FACTOR
from inferd.runtime.contract import Runtime
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState
from tests.unit.test_llm_failover import RecordingWriter, adds, drain, step


def make(
    n_workers: int = 2, params: dict | None = None, heartbeat_timeout_s: float = 5.0
) -> tuple[LLMRuntime, list[WorkerConnection], list[WorkerConnection], FakeClock]:
    clock = FakeClock()
    killed: list[WorkerConnection] = []
    config = sim_llm_config(params={"scheduler": {"block_size": 4}, **(params or {})})
    rt = LLMRuntime(config, clock, kill_worker=killed.append, heartbeat_timeout_s=heartbeat_timeout_s)
    workers = []
    for i in range(n_workers):
        w = WorkerConnection(f"sim-llm-{i}.0", "sim-llm", 100 + i, "local", RecordingWriter())  # type: ignore[arg-type]
        rt.add_worker(w)
        workers.append(w)
    return rt, workers, killed, clock


def on(workers: list[WorkerConnection], worker_id: str) -> WorkerConnection:
    return next(w for w in workers if w.worker_id == worker_id)


def heartbeat(clock: FakeClock, *workers: WorkerConnection) -> None:
    """What the hub does on a Heartbeat frame."""
    for w in workers:
        w.last_heartbeat = clock.now()


def sent(w: WorkerConnection, kind: type) -> list:
    return [m for m in w.writer.sent if isinstance(m, kind)]  # type: ignore[attr-defined]


# ---- the contract ------------------------------------------------------------------------------------
def test_statistics_is_a_frozen_runtime_snapshot_with_one_row_per_worker() -> None:
    rt, workers, _, _ = make()
    assert isinstance(rt, Runtime) and rt.kind == "llm" and rt.accepts_workers
    a = rt.submit([1, 2, 3], Generation(max_tokens=4))
    b = rt.submit([4, 5, 6], Generation(max_tokens=4))
    w = on(workers, a.worker_id)
    stats = p.LLMStats(running=1, kv_blocks_used=2, kv_blocks_total=64)
    w_msg = p.StepDeltas(0.01, [p.SeqDelta(a.seq_id, [7])], stats, [a.seq_id])
    rt.on_message(w, w_msg)
    s = rt.statistics()
    assert (s.name, s.kind, s.version, s.ready, s.ready_workers) == ("sim-llm", "llm", 1, True, 2)
    assert (s.queued, s.in_flight) == (1, 1)  # b not yet admitted by its engine; a running
    rows = {row.worker_id: row for row in s.workers}
    assert rows[a.worker_id].load == 1 and rows[b.worker_id].load == 1
    assert rows[a.worker_id].completed == 1 and rows[a.worker_id].state == "ready"
    assert rows[a.worker_id].detail == LLMWorkerStatistics(1, 0, 2, 64, 0, 0, "")
    assert isinstance(s.detail, LLMRuntimeStatistics) and s.detail.streams == 2
    assert s.detail.kv_blocks_used == 2
    assert [c.worker_id for c in rt.members.connections()] == [x.worker_id for x in workers]


async def test_its_membership_changes_at_the_next_arrival_or_departure() -> None:
    rt, workers, _, _ = make(n_workers=1)
    waiter = asyncio.ensure_future(rt.members.changed())
    await asyncio.sleep(0)
    assert not waiter.done()
    rt.on_worker_lost(workers[0], "exit 0")
    await asyncio.wait_for(waiter, 1)
    waiter = asyncio.ensure_future(rt.members.changed())
    await asyncio.sleep(0)
    rt.add_worker(WorkerConnection("sim-llm-0.1", "sim-llm", 7, "local", RecordingWriter()))  # type: ignore[arg-type]
    await asyncio.wait_for(waiter, 1)


# ---- draining ----------------------------------------------------------------------------------------
async def test_a_draining_worker_gets_no_new_sequence_and_finishes_its_live_ones() -> None:
    rt, workers, _, _ = make()
    s = rt.submit([1, 2], Generation(max_tokens=2))
    w = on(workers, s.worker_id)
    (other,) = [x for x in workers if x is not w]
    rt.drain_worker(w)
    assert w.state is WorkerState.DRAINING and sent(w, p.Drain)
    later = [rt.submit([9, i], Generation(max_tokens=2)) for i in range(3)]
    assert all(x.worker_id == other.worker_id for x in later)
    step(rt, w, {s.seq_id: [3, 4]}, finish="length")  # its engine finishes what it holds
    assert await drain(s) == [3, 4]
    assert rt.statistics().workers[0].load == 0


# ---- the hang watchdog -------------------------------------------------------------------------------
def test_a_worker_that_steps_no_more_while_sequences_run_is_killed_and_its_streams_move() -> None:
    rt, workers, killed, clock = make(params={"hang_timeout_s": 2.0})
    s = rt.submit([1, 2], Generation(max_tokens=8))
    w = on(workers, s.worker_id)
    (other,) = [x for x in workers if x is not w]
    step(rt, w, {s.seq_id: [3]}, admitted=[s.seq_id])
    clock.advance(1.9)
    heartbeat(clock, *workers)  # its event loop is fine: only the device call never returns
    rt.check_workers()
    assert killed == []
    clock.advance(0.2)
    heartbeat(clock, *workers)
    rt.check_workers()
    assert killed == [w] and "hung: no engine step for 2.1s" in w.failure
    assert rt.submit([5], Generation(max_tokens=1)).worker_id == other.worker_id  # none while it dies
    rt.on_worker_lost(w, "killed by the watchdog")  # what the broken connection then reports
    resume = adds(other)[-1]
    assert (resume.seq_id, resume.output) == (s.seq_id, [3])
    assert rt.statistics().detail.hung_workers == 1


def test_an_idle_worker_is_never_hung_and_busy_time_counts_from_its_first_sequence() -> None:
    rt, workers, killed, clock = make(n_workers=1, params={"hang_timeout_s": 2.0})
    clock.advance(60.0)  # idle, no step for a minute: fine
    heartbeat(clock, *workers)
    rt.check_workers()
    rt.submit([1, 2], Generation(max_tokens=8))
    clock.advance(1.5)
    heartbeat(clock, *workers)
    rt.check_workers()
    assert killed == []


def test_a_silent_worker_is_killed_after_the_heartbeat_timeout() -> None:
    rt, workers, killed, clock = make(heartbeat_timeout_s=5.0)
    clock.advance(4.9)
    heartbeat(clock, workers[1])
    rt.check_workers()
    assert killed == []
    clock.advance(0.2)
    rt.check_workers()
    assert killed == [workers[0]] and workers[0].failure.startswith("went silent: no heartbeat for 5.1s")
    rt.check_workers()
    assert killed == [workers[0]], "a worker being killed is killed once"


def test_the_default_hang_timeout_follows_the_slowest_recent_step() -> None:
    rt, workers, _, _ = make(n_workers=1)
    assert rt.statistics().detail.hang_timeout_s == HANG_MIN_S
    rt.on_step(workers[0], p.StepDeltas(2.0, [], p.LLMStats()))
    rt.on_step(workers[0], p.StepDeltas(0.01, [], p.LLMStats()))
    assert rt.statistics().detail.hang_timeout_s == HANG_STEP_FACTOR * 2.0


def test_a_hang_timeout_that_is_not_seconds_is_refused() -> None:
    from inferd.config import ConfigError

    with pytest.raises(ConfigError, match="hang_timeout_s"):
        make(params={"hang_timeout_s": "soon"})


# ---- deadlines ---------------------------------------------------------------------------------------
async def test_a_sequence_past_its_deadline_fails_and_is_aborted_in_its_engine() -> None:
    rt, workers, _, clock = make()
    s = rt.submit([1, 2], Generation(max_tokens=100, deadline=clock.now() + 0.5))
    keep = rt.submit([1, 3], Generation(max_tokens=100))
    w = on(workers, s.worker_id)
    step(rt, w, {s.seq_id: [5, 6]}, admitted=[s.seq_id])
    clock.advance(0.4)
    rt.expire_deadlines()
    assert not sent(w, p.AbortSequence)
    clock.advance(0.2)
    rt.expire_deadlines()
    assert [m.seq_id for m in sent(w, p.AbortSequence)] == [s.seq_id]
    assert (await s.next()).token_ids == (5, 6)  # what it had, then the error
    with pytest.raises(DeadlineExceeded, match="ran past its deadline"):
        await s.next()
    detail = rt.statistics().detail
    assert (detail.deadline_aborts, detail.streams, detail.client_aborts) == (1, 1, 0)
    rt.abort(keep)


# ---- the TTFT signal -----------------------------------------------------------------------------------
def test_ttft_p90_covers_the_recent_first_tokens_only() -> None:
    rt, workers, _, clock = make(n_workers=1)
    (w,) = workers
    assert rt.statistics().detail.ttft_s is None
    for i in range(10):  # first tokens after 0.1 .. 1.0 s
        s = rt.submit([1, i], Generation(max_tokens=4))
        clock.advance(0.1 * (i + 1))
        step(rt, w, {s.seq_id: [3]})
        step(rt, w, {s.seq_id: [4]})  # later tokens are not first tokens
    detail = rt.statistics().detail
    assert detail.ttft_samples == 10 and detail.ttft_s == pytest.approx(0.9)
    clock.advance(31.0)
    assert rt.statistics().detail.ttft_s is None


def one(seq_id: str, token: int, columns: bool) -> p.StepDeltas:
    """A step that gives `seq_id` one token: in the columns, or as a SeqDelta."""
    if columns:
        return p.StepDeltas(0.01, [], p.LLMStats(), decoded_ids=[seq_id], decoded_tokens=[token])
    return p.StepDeltas(0.01, [p.SeqDelta(seq_id, [token])], p.LLMStats())


async def test_single_token_columns_stream_as_single_token_deltas_do() -> None:
    """A step's tokens sent in StepDeltas' columns reach the stream exactly as the same tokens sent as
    SeqDeltas: admitted off the queue on the first one, ignored from a worker the sequence is not on."""
    seen = []
    for columns in (False, True):
        rt, workers, _, clock = make()
        stream = rt.submit([1, 2, 3], Generation(max_tokens=3))
        worker = on(workers, stream.worker_id)
        other = next(w for w in workers if w is not worker)

        assert rt.placement.live[stream.seq_id].waiting
        rt.on_step(other, one(stream.seq_id, 99, columns))  # not its worker: ignored
        clock.advance(0.5)
        rt.on_step(worker, one(stream.seq_id, 5, columns))
        assert not rt.placement.live[stream.seq_id].waiting
        rt.on_step(worker, one(stream.seq_id, 6, columns))
        rt.on_step(worker, p.StepDeltas(0.01, [p.SeqDelta(stream.seq_id, [7], "length")], p.LLMStats()))
        chunk = await stream.next()
        seen.append((chunk, list(stream.generated), stream.seq_id in rt.placement.live, rt.ttft.p90()))
    assert seen[0] == seen[1]
    assert (seen[0][0].token_ids, seen[0][0].finish_reason, seen[0][2]) == ((5, 6, 7), "length", False)
    assert seen[0][3] == (0.5, 1)


async def test_a_stream_hands_out_its_tokens_once_then_its_error() -> None:
    stream = TokenStream("s", "w", 3)
    stream.push_token(1)
    stream.push_token(2)
    assert (await stream.next()).token_ids == (1, 2)
    waiter = asyncio.ensure_future(stream.next())
    await asyncio.sleep(0)
    assert not waiter.done()  # nothing new: it waits
    stream.push_token(3)
    stream.fail(WorkerDied("gone"))
    chunk = await waiter
    assert (chunk.token_ids, chunk.finish_reason) == ((3,), None)
    with pytest.raises(WorkerDied):
        await stream.next()
    assert stream.generated == [1, 2, 3]
