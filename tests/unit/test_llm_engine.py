"""The worker's LLM engine loop around the real scheduler and a zero-cost sim-llm; the front end's stop
string matching and per-request stream slot."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from inferd.clock import MonotonicClock
from inferd.kinds.llm.engine import LLMEngine, scheduler_config
from inferd.kinds.llm.scheduler import LLMScheduler
from inferd.kinds.llm.sim_llm import VOCAB, SimLLM, SimTokenizer, sim_llm_config, sim_llm_tokens
from inferd.kinds.llm.stream import TokenStream
from inferd.kinds.llm.text import StopChecker
from inferd.wire import protocol as p

FREE = {"step_base_ms": 0.0, "per_token_ms": 0.0, "per_context_token_ms": 0.0}


async def run_engine(messages: list[p.Message], params: dict | None = None) -> list[p.StepDeltas]:
    config = sim_llm_config(params={**FREE, **(params or {})})
    model = SimLLM(config)
    model.load()
    sent: list[p.StepDeltas] = []

    async def flush() -> None:
        await asyncio.sleep(0)

    with ThreadPoolExecutor(1) as executor:
        scheduler = LLMScheduler(scheduler_config(config.params), MonotonicClock())
        engine = LLMEngine(model, scheduler, sent.append, flush, executor)  # type: ignore[arg-type]
        for msg in messages:
            engine.submit(msg)  # type: ignore[arg-type]
        engine.stop(finish_running=True)
        await engine.run()
    return sent


def tokens_by_seq(steps: list[p.StepDeltas]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for step in steps:
        for d in step.all_deltas():
            out.setdefault(d.seq_id, []).extend(d.token_ids)
    return out


async def test_engine_streams_the_documented_tokens_for_every_sequence() -> None:
    tok = SimTokenizer()
    prompts = {f"s{i}": (f"prompt number {i} " * (i + 1), i, 5 + i) for i in range(6)}
    adds = [p.AddSequence(sid, tok.encode(text), n, seed) for sid, (text, seed, n) in prompts.items()]
    steps = await run_engine(adds)
    got = tokens_by_seq(steps)
    for sid, (text, seed, n) in prompts.items():
        assert [VOCAB[t] for t in got[sid]] == sim_llm_tokens(text, seed, n)
    finishes = {d.seq_id: d.finish_reason for s in steps for d in s.all_deltas() if d.finish_reason}
    assert finishes == {sid: "length" for sid in prompts}
    assert steps[-1].stats.finished == 6 and steps[-1].stats.running == 0


async def test_abort_ends_the_sequence_and_is_counted() -> None:
    steps = await run_engine([p.AddSequence("a", [1, 2, 3], 500), p.AbortSequence("a")])
    assert [(d.seq_id, d.finish_reason) for s in steps for d in s.all_deltas()] == [("a", "abort")]
    assert steps[-1].stats.aborted == 1 and steps[-1].stats.running == 0


async def test_sequence_the_scheduler_refuses_gets_an_error_delta() -> None:
    steps = await run_engine(
        [p.AddSequence("big", [1] * 10, 100)], params={"scheduler": {"num_blocks": 2, "block_size": 16}}
    )
    (delta,) = [d for s in steps for d in s.all_deltas()]
    assert delta.finish_reason == "error" and delta.error is not None and delta.error[0] == "BadRequest"


def test_stop_checker_holds_back_partial_matches() -> None:
    c = StopChecker(["END"])
    assert c.feed("abc E") == ("abc", False)
    assert c.feed("N") == (" ", False)
    assert c.feed("D more") == ("", True)
    c = StopChecker(["xy"])
    assert c.feed("ax") == ("a", False)
    assert c.feed("z") == ("x", False)
    assert c.rest() == "z"


async def test_token_stream_merges_deltas_while_the_reader_is_slow() -> None:
    s = TokenStream("s", "w", 3)
    s.push([1], None)
    s.push([2, 3], None)
    s.push([4], "length")
    chunk = await s.next()
    assert chunk.token_ids == (1, 2, 3, 4) and chunk.finish_reason == "length"
    assert s.completion_tokens == 4


class FailsOnce(SimLLM):
    """Raises on the first step that carries the sequence 'bad' (a model bug), fine otherwise."""

    def run_step(self, plan, requests):  # type: ignore[no-untyped-def]
        if any(c.seq_id == "bad" for c in plan.chunks):
            raise ValueError("the model could not sample this one")
        return super().run_step(plan, requests)


async def test_a_step_that_raises_ends_its_sequences_with_an_error_and_the_engine_goes_on() -> None:
    config = sim_llm_config(params=FREE)
    model = FailsOnce(config)
    model.load()
    sent: list[p.StepDeltas] = []

    async def flush() -> None:
        await asyncio.sleep(0)

    tok = SimTokenizer()
    with ThreadPoolExecutor(1) as executor:
        scheduler = LLMScheduler(scheduler_config(config.params), MonotonicClock())
        engine = LLMEngine(model, scheduler, sent.append, flush, executor)  # type: ignore[arg-type]
        engine.submit(p.AddSequence("bad", tok.encode("one two"), 4, 1))
        engine.stop(finish_running=True)
        await engine.run()
        engine2 = LLMEngine(model, scheduler, sent.append, flush, executor)  # type: ignore[arg-type]
        engine2.submit(p.AddSequence("good", tok.encode("three four"), 3, 2))
        engine2.stop(finish_running=True)
        await engine2.run()
    finishes = {d.seq_id: d.finish_reason for s in sent for d in s.all_deltas() if d.finish_reason}
    assert finishes == {"bad": "error", "good": "length"}
    assert [VOCAB[t] for t in tokens_by_seq(sent)["good"]] == sim_llm_tokens("three four", 2, 3)


async def test_a_step_that_preempts_says_which_sequences_it_preempted() -> None:
    # 4 blocks of 4 tokens: two sequences of 6-token prompts growing to 16 tokens cannot both keep their KV
    adds = [p.AddSequence(f"s{i}", list(range(1, 7)), 10) for i in range(2)]
    steps = await run_engine(adds, {"scheduler": {"block_size": 4, "num_blocks": 4}})
    preempted = [seq for step in steps for seq in step.preempted]
    assert preempted, "no step preempted: the KV pool was not short"
    assert set(preempted) <= {"s0", "s1"}
    assert all(len(tokens) == 10 for tokens in tokens_by_seq(steps).values())  # recomputed, nothing lost
