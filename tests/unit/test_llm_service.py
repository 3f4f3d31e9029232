"""LlmService (kinds/llm/service.py), the LLM kind's typed service, on a sim-llm LLMRuntime whose
workers are recording connections (the test plays their engines' steps): the parameter checks, the
prompt's tokens and length, the deadline refusal, the quota hook, n choices with seeds all or none,
the text with stop strings, and the aborts the engine sees when the consumer stops early, the caller
leaves, or a choice fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import aclosing

import pytest

from inferd.errors import BadRequest, ClientGone, DeadlineExceeded, ModelError, Overloaded
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.service import (
    DEFAULT_MAX_TOKENS,
    MAX_SEED,
    TOKENIZE_IN_THREAD_CHARS,
    Choices,
    ContextLengthExceeded,
    GenerationRequest,
)
from inferd.kinds.llm.sim_llm import VOCAB, SimTokenizer
from inferd.kinds.llm.stream import TokenStream
from inferd.routing.fairness import BULK, TenantShare
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.unit.test_llm_failover import adds, make_runtime, step, worker_of

WORDS = {w: i for i, w in enumerate(VOCAB)}


def ids(text: str) -> list[int]:
    """The sim model's output token ids of these words."""
    return [WORDS[w] for w in text.split()]


def aborted(workers: list[WorkerConnection]) -> set[str]:
    """The sequences the engines were told to abort."""
    return {m.seq_id for w in workers for m in w.writer.sent if isinstance(m, p.AbortSequence)}  # type: ignore[attr-defined]


def all_adds(workers: list[WorkerConnection]) -> list[p.AddSequence]:
    return [a for w in workers for a in adds(w)]


def play(rt: LLMRuntime, workers: list[WorkerConnection], stream: TokenStream, text: str, finish: str = "") -> None:
    """The stream's engine steps these words (and ends the sequence with `finish`)."""
    step(rt, worker_of(rt, workers, stream), {stream.seq_id: ids(text)}, finish=finish)


class Departure:
    """A caller that leaves when the test says so."""

    def __init__(self) -> None:
        self.on_gone: list[Callable[[], None]] = []
        self.unwatched = 0

    def watch(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        self.on_gone.append(on_gone)

        def unwatch() -> None:
            self.unwatched += 1
            self.on_gone.remove(on_gone)

        return unwatch

    def leave(self) -> None:
        for cb in self.on_gone:
            cb()


async def generate(rt: LLMRuntime, deadline: float | None = None, **fields: object) -> Choices:
    return await rt.service.generate(GenerationRequest(**{"prompt": "say it", **fields}), deadline=deadline)  # type: ignore[arg-type]


# ---- the answer ----------------------------------------------------------------------------------------
async def test_collect_gives_each_choice_its_text_and_finish_with_the_usage_and_worker() -> None:
    rt, workers = make_runtime()
    task = asyncio.ensure_future(rt.service.collect(GenerationRequest("one two three", max_tokens=4), deadline=None))
    await asyncio.sleep(0)  # it runs up to the wait for the tokens
    (live,) = rt.placement.live.values()
    play(rt, workers, live.stream, "the of")
    play(rt, workers, live.stream, "and to", finish="length")
    done = await task
    assert done.texts == [("the of and to", "length")]
    assert (done.prompt_tokens, done.completion_tokens) == (3, 4)
    assert done.worker_id == live.stream.worker_id
    assert aborted(workers) == set() and rt.client_aborts == 0  # it ended on its own: nothing to abort


async def test_n_choices_sample_with_seed_plus_i_and_stream_each_in_its_own_order() -> None:
    rt, workers = make_runtime()
    choices = await generate(rt, n=3, seed=7, max_tokens=2, temperature=0.5, top_p=0.9)
    sent = sorted(all_adds(workers), key=lambda a: int(a.seq_id.rpartition("-")[2]))  # "m-9" before "m-10"
    assert [a.seed for a in sent] == [7, 8, 9]
    assert {(a.max_tokens, a.temperature, a.top_p) for a in sent} == {(2, 0.5, 0.9)}
    assert len(choices) == 3 and [s.seq_id for s in choices.streams] == [a.seq_id for a in sent]
    for i, s in enumerate(choices.streams):
        play(rt, workers, s, VOCAB[i])
        play(rt, workers, s, VOCAB[i + 10], finish="length")
    async with aclosing(choices.stream()) as pieces:
        got = [piece async for piece in pieces]
    for i in range(3):
        mine = [(text, finish) for j, text, finish in got if j == i]
        assert "".join(t for t, _ in mine) == f"{VOCAB[i]} {VOCAB[i + 10]}" and mine[-1][1] == "length"
    assert (choices.prompt_tokens, choices.completion_tokens) == (2, 6)


async def test_unseeded_choices_and_a_negative_seed_leave_the_seed_to_the_backend() -> None:
    rt, workers = make_runtime()
    await generate(rt, n=2, max_tokens=2)
    await generate(rt, n=2, max_tokens=2, seed=-1)
    assert [a.seed for a in all_adds(workers)] == [None] * 4


async def test_a_stop_string_ends_the_text_before_it_and_aborts_the_sequence() -> None:
    rt, workers = make_runtime()
    choices = await generate(rt, max_tokens=8, stops=("and",))
    (s,) = choices.streams
    play(rt, workers, s, "the of")
    play(rt, workers, s, "and to")
    assert await choices.collect() == [("the of ", "stop")]
    assert aborted(workers) == {s.seq_id} and rt.client_aborts == 0  # not the client's doing


async def test_the_chain_to_the_scheduler_gets_the_calls_deadline_priority_and_tenant() -> None:
    rt, workers = make_runtime()
    deadline = rt.clock.now() + 5.0
    choices = await rt.service.generate(
        GenerationRequest("x y", max_tokens=3, ignore_eos=True),
        deadline=deadline,
        priority=BULK,
        share=TenantShare("acme", 3.0),
    )
    gen = rt.placement.live[choices.streams[0].seq_id].gen
    assert (gen.deadline, gen.priority, gen.tenant, gen.weight, gen.ignore_eos) == (deadline, BULK, "acme", 3.0, True)
    (add,) = all_adds(workers)
    assert (add.tenant, add.weight, add.priority, add.ignore_eos) == ("acme", 3.0, BULK, True)


# ---- the prompt and its length ---------------------------------------------------------------------------
async def test_without_max_tokens_a_completion_stops_at_16_and_a_chat_answer_fills_the_context() -> None:
    rt, workers = make_runtime()
    await generate(rt, prompt="a b c")
    await generate(rt, prompt="a b c", chat=True)
    assert [a.max_tokens for a in all_adds(workers)] == [DEFAULT_MAX_TOKENS, rt.max_model_len - 3]


async def test_token_ids_are_taken_as_they_are_and_a_long_prompt_is_tokenized_the_same() -> None:
    rt, workers = make_runtime()
    await generate(rt, prompt=[5, 6, 7], max_tokens=1)
    long = "a " + "x" * TOKENIZE_IN_THREAD_CHARS  # tokenized in a thread: two words
    await generate(rt, prompt=long, max_tokens=1)
    first, second = all_adds(workers)
    assert first.prompt == [5, 6, 7]
    assert second.prompt == SimTokenizer().encode(long) and len(second.prompt) == 2


async def test_an_empty_prompt_and_one_past_the_context_are_refused_before_anything_is_sent() -> None:
    rt, workers = make_runtime()
    with pytest.raises(BadRequest, match="the prompt is empty: it holds no tokens"):
        await generate(rt, prompt="   ")
    with pytest.raises(BadRequest, match="the messages is empty: it holds no tokens"):
        await generate(rt, prompt="", chat=True)
    with pytest.raises(ContextLengthExceeded, match=r"requested 2049 tokens \(2 in the prompt, 2047 in the"):
        await generate(rt, prompt="a b", max_tokens=rt.max_model_len - 1)
    assert all_adds(workers) == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 0}, "n must be between 1 and 16, got 0"),
        ({"n": 17}, "n must be between 1 and 16, got 17"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"temperature": 2.5}, "temperature must be between 0 and 2, got 2.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"seed": MAX_SEED + 1}, f"seed must be at most {MAX_SEED} \\(or negative for none\\), got {MAX_SEED + 1}"),
    ],
)
async def test_a_bad_parameter_is_a_bad_request_naming_it(fields: dict, message: str) -> None:
    rt, workers = make_runtime()
    with pytest.raises(BadRequest, match=f"^{message}$"):
        await generate(rt, **fields)
    assert all_adds(workers) == []


# ---- refusals before submitting ----------------------------------------------------------------------------
async def test_a_deadline_already_passed_is_refused_before_anything_is_scheduled() -> None:
    rt, workers = make_runtime()
    with pytest.raises(DeadlineExceeded, match="the request's deadline passed before its prompt was scheduled"):
        await generate(rt, deadline=rt.clock.now())
    with pytest.raises(DeadlineExceeded, match="before its messages was scheduled"):
        await generate(rt, deadline=rt.clock.now() - 1.0, chat=True)
    assert all_adds(workers) == []


async def test_the_reservation_gets_prompt_plus_n_times_max_tokens_and_then_the_streams() -> None:
    rt, workers = make_runtime()
    seen: list[tuple[int, Sequence[TokenStream]]] = []

    async def reserve(tokens: int, streams: Sequence[TokenStream]) -> None:
        assert len(streams) == 0 and all_adds(workers) == []  # reserved before anything is submitted
        seen.append((tokens, streams))

    choices = await rt.service.generate(GenerationRequest("a b c", n=2, max_tokens=5), deadline=None, reserve=reserve)
    ((tokens, streams),) = seen
    assert tokens == 3 + 2 * 5 and list(streams) == choices.streams  # what the refund reads at the end

    async def refuse(tokens: int, streams: Sequence[TokenStream]) -> None:
        raise Overloaded("over the tenant's tokens", 1.0)

    with pytest.raises(Overloaded, match="over the tenant's tokens"):
        await rt.service.generate(GenerationRequest("a b c", max_tokens=5), deadline=None, reserve=refuse)
    assert len(all_adds(workers)) == 2


async def test_choices_are_submitted_all_or_none() -> None:
    rt, workers = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": 2})
    with pytest.raises(Overloaded):
        await generate(rt, n=3, max_tokens=2)
    accepted = all_adds(workers)
    assert len(accepted) == 2, "the first two choices were sent before the third was refused"
    assert aborted(workers) == {a.seq_id for a in accepted} and rt.placement.live == {}
    assert rt.client_aborts == 0


# ---- the aborts at the end ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
async def test_a_consumer_that_stops_early_aborts_every_choice_as_the_clients_leaving(n: int) -> None:
    rt, workers = make_runtime()
    choices = await generate(rt, n=n, max_tokens=8)
    for s in choices.streams:
        play(rt, workers, s, "the of")
    async with aclosing(choices.stream()) as pieces:
        async for _ in pieces:
            break
    assert aborted(workers) == {s.seq_id for s in choices.streams} and rt.client_aborts == n


async def test_a_cancelled_consumer_aborts_every_choice_as_the_clients_leaving() -> None:
    rt, workers = make_runtime()
    choices = await generate(rt, max_tokens=8)
    task = asyncio.ensure_future(choices.collect())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert aborted(workers) == {choices.streams[0].seq_id} and rt.client_aborts == 1


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_caller_that_leaves_ends_the_wait_with_client_gone_and_aborts_every_choice(streamed: bool, n: int) -> None:
    rt, workers = make_runtime()
    caller = Departure()
    choices = await generate(rt, n=n, max_tokens=8)

    async def read() -> object:
        if not streamed:
            return await choices.collect(caller.watch)
        async with aclosing(choices.stream(caller.watch)) as pieces:
            return [piece async for piece in pieces]

    task = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    play(rt, workers, choices.streams[0], "the")
    await asyncio.sleep(0)
    assert not task.done() and aborted(workers) == set()
    caller.leave()
    with pytest.raises(ClientGone):
        await task
    assert aborted(workers) == {s.seq_id for s in choices.streams} and rt.client_aborts == n
    assert caller.unwatched == 1


async def test_a_failed_choice_ends_the_stream_and_aborts_the_others_not_as_the_clients_leaving() -> None:
    rt, workers = make_runtime()
    choices = await generate(rt, n=2, max_tokens=8)
    bad, good = choices.streams
    play(rt, workers, good, "the")
    w = worker_of(rt, workers, bad)
    rt.on_step(w, p.StepDeltas(0.01, [p.SeqDelta(bad.seq_id, [], "error", ("ModelError", "boom"))], p.LLMStats(), []))
    with pytest.raises(ModelError):
        async with aclosing(choices.stream()) as pieces:
            async for _ in pieces:
                pass
    assert aborted(workers) == {good.seq_id} and rt.client_aborts == 0
