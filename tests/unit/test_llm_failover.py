"""LLMRuntime against fake worker connections (the frames it sends are decoded and inspected):
admission against the engines' waiting bounds, prefix-affinity routing, and failover of streams when
a worker dies; and the engine resuming a sequence from the tokens another worker already produced."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.errors import Overloaded, ShuttingDown, WorkerDied, WorkerUnavailable
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.sim_llm import VOCAB, SimTokenizer, sim_llm_config, sim_llm_tokens
from inferd.kinds.llm.stream import TokenStream
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.unit.test_llm_engine import run_engine, tokens_by_seq

_decode = msgspec.msgpack.Decoder(p.Message)


class RecordingWriter:
    """Stands in for a worker socket: keeps every message the front end sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sent.append(_decode.decode(data[4:]))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def make_runtime(
    n_workers: int = 2, scheduler: dict | None = None, budget: RetryBudget | None = None
) -> tuple[LLMRuntime, list[WorkerConnection]]:
    clock = FakeClock()
    params = {"scheduler": {"block_size": 4, **(scheduler or {})}}
    rt = LLMRuntime(sim_llm_config(params=params), clock, retry_budget=budget, kill_worker=lambda w: None)
    workers = []
    for i in range(n_workers):
        w = WorkerConnection(f"sim-llm-{i}.0", "sim-llm", 100 + i, "local", RecordingWriter())  # type: ignore[arg-type]
        rt.add_worker(w)
        workers.append(w)
    return rt, workers


def adds(w: WorkerConnection) -> list[p.AddSequence]:
    return [m for m in w.writer.sent if isinstance(m, p.AddSequence)]  # type: ignore[attr-defined]


def step(
    rt: LLMRuntime,
    w: WorkerConnection,
    tokens: dict[str, list[int]],
    admitted: list[str] = (),
    finish: str = "",
) -> None:
    deltas = [p.SeqDelta(sid, toks, finish or None) for sid, toks in tokens.items()]
    rt.on_step(w, p.StepDeltas(0.01, deltas, p.LLMStats(), list(admitted)))


def worker_of(rt: LLMRuntime, workers: list[WorkerConnection], stream: TokenStream) -> WorkerConnection:
    return next(w for w in workers if w.worker_id == stream.worker_id)


async def drain(stream: TokenStream) -> list[int]:
    out: list[int] = []
    while True:
        chunk = await stream.next()
        out.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            return out


# ---- admission ---------------------------------------------------------------------------------------
def test_refuses_with_overloaded_when_every_ready_worker_queue_is_full() -> None:
    rt, workers = make_runtime(scheduler={"max_waiting_seqs": 2})
    streams = [rt.submit([1, 2, 3], Generation(max_tokens=4)) for _ in range(4)]
    with pytest.raises(Overloaded) as info:
        rt.submit([1, 2, 3], Generation(max_tokens=4))
    assert info.value.retry_after_s > 0 and "max_waiting_seqs=2" in info.value.message
    assert sum(len(adds(w)) for w in workers) == 4, "the refused request reached a worker"
    assert rt.statistics().detail.rejected == 1
    first = streams[0]
    step(rt, worker_of(rt, workers, first), {}, admitted=[first.seq_id])  # its engine admitted one
    assert rt.submit([1, 2, 3], Generation(max_tokens=4)).worker_id == first.worker_id


def test_waiting_prompt_tokens_bound_the_queue_too() -> None:
    rt, _ = make_runtime(n_workers=1, scheduler={"max_waiting_prompt_tokens": 10})
    rt.submit(list(range(8)), Generation(max_tokens=2))
    with pytest.raises(Overloaded):
        rt.submit(list(range(3)), Generation(max_tokens=2))
    rt.submit(list(range(2)), Generation(max_tokens=2))


def test_first_token_counts_as_admitted_and_an_end_frees_the_seat() -> None:
    rt, (w,) = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": 1})
    s = rt.submit([1, 2], Generation(max_tokens=2))
    with pytest.raises(Overloaded):
        rt.submit([1, 2], Generation(max_tokens=2))
    step(rt, w, {s.seq_id: [5]})  # an engine without the admitted list still counts it off
    rt.submit([1, 2], Generation(max_tokens=2))


def test_no_ready_worker_is_unavailable_not_overloaded() -> None:
    rt, workers = make_runtime(n_workers=1)
    rt.on_worker_lost(workers[0], "exit 9")
    with pytest.raises(WorkerUnavailable):
        rt.submit([1], Generation(max_tokens=1))


# ---- routing -----------------------------------------------------------------------------------------
def test_requests_sharing_a_prefix_go_to_the_worker_that_computed_it() -> None:
    rt, _ = make_runtime()
    prefix = list(range(40))
    a = rt.submit([*prefix, 1], Generation(max_tokens=8, tenant="t"))
    b = rt.submit([*prefix, 2], Generation(max_tokens=8, tenant="t"))
    assert a.worker_id == b.worker_id
    # another tenant's cache is salted apart: its prompts follow their own home worker (rendezvous hash of
    # their salted first block), which may or may not be this one, and keep their own affinity
    c = rt.submit([*prefix, 3], Generation(max_tokens=8, tenant="other"))
    d = rt.submit([*prefix, 4], Generation(max_tokens=8, tenant="other"))
    assert c.worker_id == d.worker_id


# ---- failover ----------------------------------------------------------------------------------------
async def test_started_stream_resumes_on_another_worker_without_gaps_or_duplicates() -> None:
    rt, workers = make_runtime()
    s = rt.submit([7, 8, 9], Generation(max_tokens=6, seed=3, tenant="t"))
    first = worker_of(rt, workers, s)
    step(rt, first, {s.seq_id: [11]}, admitted=[s.seq_id])
    step(rt, first, {s.seq_id: [12]})
    rt.on_worker_lost(first, "killed by signal 9")
    (second,) = [w for w in workers if w is not first]
    (resume,) = adds(second)
    assert (resume.seq_id, resume.prompt, resume.output, resume.max_tokens) == (
        s.seq_id,
        [7, 8, 9],
        [11, 12],
        6,
    )
    assert (resume.seed, resume.tenant) == (3, "t") and s.worker_id == second.worker_id
    step(rt, second, {s.seq_id: [13, 14]})
    step(rt, second, {s.seq_id: [15, 16]}, finish="length")
    assert await drain(s) == [11, 12, 13, 14, 15, 16]
    assert rt.statistics().detail.moved == 1 and rt.statistics().detail.streams == 0


async def test_unstarted_stream_is_submitted_again_and_late_frames_of_the_dead_worker_are_ignored() -> None:
    rt, workers = make_runtime()
    s = rt.submit([1, 2], Generation(max_tokens=2))
    first = worker_of(rt, workers, s)
    rt.on_worker_lost(first, "exit -9")
    step(rt, first, {s.seq_id: [99]})  # cannot happen on a closed socket, but must not leak through
    (second,) = [w for w in workers if w is not first]
    assert adds(second)[0].output == []
    step(rt, second, {s.seq_id: [4, 5]}, finish="length")
    assert await drain(s) == [4, 5]


async def test_stream_ends_with_worker_died_when_no_worker_is_left() -> None:
    rt, (w,) = make_runtime(n_workers=1)
    s = rt.submit([1, 2], Generation(max_tokens=5))
    step(rt, w, {s.seq_id: [3]})
    rt.on_worker_lost(w, "exit -9")
    assert (await s.next()).token_ids == (3,)
    with pytest.raises(WorkerDied, match="could not be moved"):
        await s.next()
    assert rt.statistics().detail.lost == 1


async def test_stream_ends_with_worker_died_when_the_retry_budget_is_spent() -> None:
    clock = FakeClock()
    rt, workers = make_runtime(budget=RetryBudget(clock, ratio=0.0, min_per_s=0.0))
    s = rt.submit([1, 2], Generation(max_tokens=5))
    rt.on_worker_lost(worker_of(rt, workers, s), "exit -9")
    with pytest.raises(WorkerDied, match="retry budget"):
        await s.next()
    assert all(not adds(w) for w in workers if w.worker_id != s.worker_id)


async def test_stop_ends_every_stream_and_a_worker_lost_afterwards_moves_nothing() -> None:
    rt, workers = make_runtime()
    s = rt.submit([1, 2], Generation(max_tokens=5))
    rt.stop(ShuttingDown("model 'sim-llm' is shutting down"))
    rt.on_worker_lost(worker_of(rt, workers, s), "exit 0")
    with pytest.raises(ShuttingDown, match="shutting down"):
        await s.next()
    assert sum(len(adds(w)) for w in workers) == 1
    assert not rt.ready
    with pytest.raises(WorkerUnavailable, match="shutting down"):
        rt.submit([1, 2], Generation(max_tokens=5))


def test_abort_after_a_move_goes_to_the_new_worker() -> None:
    rt, workers = make_runtime()
    s = rt.submit([1, 2], Generation(max_tokens=5))
    first = worker_of(rt, workers, s)
    rt.on_worker_lost(first, "exit -9")
    rt.abort(s)
    (second,) = [w for w in workers if w is not first]
    assert [m.seq_id for m in second.writer.sent if isinstance(m, p.AbortSequence)] == [s.seq_id]  # type: ignore[attr-defined]


# ---- the engine side of a resume ---------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 5, 8])
async def test_engine_continues_sim_llm_tokens_after_the_resumed_output(k: int) -> None:
    tok = SimTokenizer()
    text, seed, n = "resume me where I stopped", 4, 9
    want = sim_llm_tokens(text, seed, n)
    done = [VOCAB.index(word) for word in want[:k]]
    add = p.AddSequence("r", tok.encode(text), n, seed, output=done)
    steps = await run_engine([add], {"scheduler": {"block_size": 2}})  # output spans blocks
    assert [VOCAB[t] for t in tokens_by_seq(steps)["r"]] == want[k:]
    assert any("r" in s.admitted for s in steps)
    assert [d.finish_reason for s in steps for d in s.all_deltas() if d.finish_reason] == ["length"]


async def test_engine_refuses_a_resume_with_nothing_left_to_generate() -> None:
    steps = await run_engine([p.AddSequence("r", [1, 2], 2, output=[3, 4])])
    (delta,) = [d for s in steps for d in s.all_deltas()]
    assert delta.finish_reason == "error" and delta.error is not None and "nothing left" in delta.error[1]


def test_a_preempted_sequence_gets_a_preempted_event_on_its_trace() -> None:
    class Span:
        def __init__(self) -> None:
            self.events: list[tuple[str, dict]] = []

        def add_event(self, name: str, attributes: dict) -> None:
            self.events.append((name, attributes))

    rt, workers = make_runtime()
    s = rt.submit([1, 2, 3], Generation(max_tokens=4))
    s.trace = Span()  # type: ignore[assignment]
    w = worker_of(rt, workers, s)
    rt.on_step(w, p.StepDeltas(0.01, [], p.LLMStats(), [s.seq_id], [s.seq_id]))
    assert s.trace.events == [("preempted", {"worker_id": w.worker_id})]  # type: ignore[attr-defined]
