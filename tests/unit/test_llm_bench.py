"""`inferd bench-llm`: the workload plan, the report math (nearest-rank p99, TPOT, the goodput rule,
rates over the span), the SSE parser, the sim-llm check, and whole runs against an in-process stub of
/v1/completions that streams sim-llm's documented tokens and misbehaves on command."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from aiohttp import web

from inferd.bench.llm_loadgen import SSEStream, check_sim_stream, run_llm_load
from inferd.bench.llm_report import (
    SLO,
    LLMPhaseReport,
    LLMRecorder,
    StreamTiming,
    meets_slo,
    nearest_rank,
)
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec, PlannedRequest, plan_requests, prompt_text
from inferd.kinds.llm.sim_llm import SimTokenizer, sim_llm_tokens

# --- workload ---


def test_length_parses_fixed_and_uniform_ranges_and_rejects_nonsense() -> None:
    assert LengthDist.parse("128") == LengthDist(128, 128)
    assert LengthDist.parse("32-512") == LengthDist(32, 512)
    assert LengthDist.parse(" 32 : 512 ") == LengthDist(32, 512)
    for bad in ("0", "9-3", "abc", "1-2-3", ""):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_planned_prompts_have_exactly_the_asked_number_of_sim_tokens() -> None:
    spec = LLMLoadSpec(
        rate=50, duration_s=2, prompt_tokens=LengthDist(3, 40), output_tokens=LengthDist(1, 9), seed=4
    )
    plan = plan_requests(spec)
    assert 60 <= len(plan) <= 140
    tok = SimTokenizer()
    for req in plan:
        assert len(tok.encode(req.prompt)) == req.prompt_tokens
        assert 3 <= req.prompt_tokens <= 40 and 1 <= req.max_tokens <= 9
    assert len({r.prompt.split()[0] for r in plan}) == len(plan), "first words are unique"
    assert {r.prompt_tokens for r in plan} != {plan[0].prompt_tokens}, "lengths vary"
    assert plan_requests(spec) == plan, "seeded"
    assert [r.offset_s for r in plan] == sorted(r.offset_s for r in plan)


def test_fixed_lengths_and_max_requests() -> None:
    spec = LLMLoadSpec(rate=100, duration_s=5, prompt_tokens=LengthDist(7, 7), max_requests=10)
    plan = plan_requests(spec)
    assert len(plan) == 10
    assert {r.prompt_tokens for r in plan} == {7} and {r.max_tokens for r in plan} == {128}


def test_invalid_spec_names_the_bad_values() -> None:
    with pytest.raises(ValueError, match=r"rate must be > 0.*url must be"):
        LLMLoadSpec(rate=0, url="https://x")


# --- report math ---


def test_nearest_rank_percentile() -> None:
    assert nearest_rank(list(range(1, 101)), 99) == 99
    assert nearest_rank(list(range(1, 11)), 99) == 10  # under 100 values: p99 is the max
    assert nearest_rank(list(range(1, 100)), 99) == 99
    assert nearest_rank(list(range(200, 0, -1)), 99) == 198
    assert nearest_rank([5.0], 50) == 5.0
    assert nearest_rank([1, 2, 3, 4], 50) == 2
    with pytest.raises(ValueError):
        nearest_rank([], 99)


def test_timing_from_chunk_times_gives_ttft_gaps_and_tpot() -> None:
    t = StreamTiming.from_chunk_times([0.2, 0.25, 0.4, 0.5], end=0.52, output_tokens=5)
    assert t.ttft_s == 0.2 and t.e2e_s == 0.52
    assert t.itls_s == pytest.approx((0.05, 0.15, 0.1))
    assert t.tpot_s == pytest.approx((0.52 - 0.2) / 4)  # 5 tokens (one chunk merged two)
    assert StreamTiming.from_chunk_times([0.3], end=0.31, output_tokens=1).tpot_s is None


def test_goodput_rule_ttft_and_per_request_p99_itl_inclusive_at_the_threshold() -> None:
    slo = SLO(ttft_ms=1500, itl_ms=150)

    def timing(ttft: float, gaps: list[float]) -> StreamTiming:
        return StreamTiming(ttft, ttft + sum(gaps), tuple(gaps), len(gaps) + 1)

    assert meets_slo(timing(1.5, [0.15] * 10), slo)
    assert not meets_slo(timing(1.5001, [0.01] * 10), slo)
    assert meets_slo(timing(0.1, []), slo)  # one token: no gaps to judge
    assert not meets_slo(timing(0.1, [0.01] * 98 + [0.151]), slo)  # under 100 gaps: the max counts
    assert meets_slo(timing(0.1, [0.01] * 99 + [0.151]), slo)  # 100 gaps: one may exceed
    assert meets_slo(timing(0.1, [0.01] * 198 + [0.9, 0.9]), slo)  # 200 gaps: two may exceed
    assert not meets_slo(timing(0.1, [0.01] * 197 + [0.9] * 3), slo)


def test_phase_report_counts_goodput_and_rates_over_the_span() -> None:
    rec = LLMRecorder(SLO(1500, 150), window_start=100.0, window_s=10.0)
    for _ in range(4):
        rec.send_lag(0.001)
    good = StreamTiming.from_chunk_times([0.1, 0.12, 0.14], end=0.15, output_tokens=3)
    slow_first = StreamTiming.from_chunk_times([2.0, 2.01], end=2.02, output_tokens=2)
    rec.ok(good, prompt_tokens=10, ended_at=105.0)
    rec.ok(slow_first, prompt_tokens=20, ended_at=120.0)  # last completion: span 20 s
    rec.error("http_429")
    rec.mismatch("wrong_text")
    p = LLMPhaseReport.from_recorder(rec)
    assert (p.sent, p.ok, p.good) == (4, 2, 1)
    assert p.span_s == 20.0 and p.offered_rps == 0.4
    assert p.goodput_rps == pytest.approx(1 / 20) and p.request_rps == pytest.approx(2 / 20)
    assert p.output_tokens == 5 and p.output_tokens_per_s == pytest.approx(5 / 20)
    assert p.prompt_tokens == 30
    assert p.slo_attainment == 0.25
    assert p.errors == {"http_429": 1} and p.mismatched == 1
    assert p.ttft_ms["max"] == pytest.approx(2000, rel=1e-3) and p.ttft_ms["p50"] == pytest.approx(
        100, rel=1e-3
    )
    assert p.itl_ms["max"] == pytest.approx(20, rel=1e-3)
    assert p.tpot_ms["p50"] == pytest.approx(20, rel=1e-3)  # (0.15 - 0.1) / 2 and (2.02 - 2.0) / 1


def test_span_is_at_least_the_window() -> None:
    rec = LLMRecorder(SLO(), window_start=0.0, window_s=10.0)
    assert LLMPhaseReport.from_recorder(rec).span_s == 10.0


# --- SSE parsing and the sim-llm check ---


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


def chunk(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_sse_stream_parses_events_split_anywhere() -> None:
    body = sse(
        chunk("the"),
        chunk(" of and"),
        chunk(" to", "length"),
        {"choices": [], "usage": {"completion_tokens": 4}},
        "[DONE]",
    )
    for cut in (1, 7, 50, len(body) - 3):
        s = SSEStream(max_chunks=10)
        s.feed(body[:cut], 1.0)
        s.feed(body[cut:], 2.0)
        assert "".join(s.text) == "the of and to"
        assert len(s.chunk_times) == 3 and s.completion_tokens == 4
        assert s.done_at == 2.0 and s.error is None


def test_sse_stream_flags_error_events_bad_json_and_overlong_streams() -> None:
    s = SSEStream(max_chunks=10)
    s.feed(sse(chunk("a"), {"error": {"message": "boom", "code": "ModelError"}}), 1.0)
    assert s.error == "stream_error"
    s = SSEStream(max_chunks=10)
    s.feed(b"data: {not json\n\n", 1.0)
    assert s.error == "bad_response"
    s = SSEStream(max_chunks=2)
    s.feed(sse(chunk("a"), chunk(" b"), chunk(" c")), 1.0)
    assert s.error == "overlong" and len(s.chunk_times) == 2


def test_sim_check_wants_the_documented_words_and_exact_length() -> None:
    req = PlannedRequest(3, 0.0, "alpha bravo charlie", 3, 5)
    words = sim_llm_tokens("alpha bravo charlie", 3, 5)
    assert check_sim_stream(req, " ".join(words), 5) == "ok"
    assert check_sim_stream(req, " ".join(words[:4]), 4) == "wrong_length"
    assert check_sim_stream(req, " ".join([*words[:4], "nope"]), 5) == "wrong_text"
    assert check_sim_stream(req, " ".join(sim_llm_tokens("alpha bravo charlie", 4, 5)), 5) == "wrong_text"


# --- whole runs against a stub /v1/completions ---

Rule = Callable[[int], bool]


def never(i: int) -> bool:
    return False


@dataclass
class StubBehaviour:
    """Which requests (by seed, which the generator sets to the request number) misbehave."""

    first_token_s: float = 0.0
    reject_429: Rule = never
    wrong_token: Rule = never
    error_event: Rule = never
    no_done: Rule = never
    received: list[int] = field(default_factory=list)


def stub_app(b: StubBehaviour) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        i = body["seed"]
        b.received.append(i)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        if b.reject_429(i):
            return web.json_response({"error": {"message": "full"}}, status=429)
        words = sim_llm_tokens(body["prompt"], i, body["max_tokens"])
        if b.wrong_token(i):
            words[-1] = "wrong"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(b.first_token_s)
        for k, word in enumerate(words):
            if b.error_event(i) and k == 1:
                await resp.write(sse({"error": {"message": "model failed", "code": "ModelError"}}))
                break
            await resp.write(sse(chunk(word if k == 0 else " " + word)))
        await resp.write(sse({"choices": [], "usage": {"completion_tokens": len(words)}}))
        if not b.no_done(i):
            await resp.write(sse("[DONE]"))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@dataclass
class Stub:
    url: str
    behaviour: StubBehaviour


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    behaviour = StubBehaviour()
    runner = web.AppRunner(stub_app(behaviour), handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield Stub(f"http://127.0.0.1:{runner.addresses[0][1]}", behaviour)
    await runner.cleanup()


def llm_spec(url: str, **overrides: object) -> LLMLoadSpec:
    base: dict[str, object] = {
        "url": url,
        "rate": 40.0,
        "duration_s": 0.5,
        "arrival": "constant",
        "prompt_tokens": LengthDist(4, 12),
        "output_tokens": LengthDist(2, 6),
        "timeout_s": 5.0,
    }
    return LLMLoadSpec(**(base | overrides))  # type: ignore[arg-type]


async def test_every_stream_is_checked_timed_and_good(stub: Stub) -> None:
    stub.behaviour.first_token_s = 0.02
    report = await run_llm_load(llm_spec(stub.url))
    m = report.measured
    assert report.sent == 20 and sorted(stub.behaviour.received) == list(range(20))
    assert (m.sent, m.ok, m.good, m.mismatched, m.errors) == (20, 20, 20, 0, {})
    assert m.ttft_ms["p50"] >= 20.0  # counted from the intended send time, so never below the stub's delay
    plan = plan_requests(llm_spec(stub.url))
    assert m.output_tokens == sum(r.max_tokens for r in plan)
    assert m.prompt_tokens == sum(r.prompt_tokens for r in plan)


async def test_errors_and_wrong_streams_are_counted_apart_from_good_ones(stub: Stub) -> None:
    b = stub.behaviour
    b.reject_429 = lambda i: i == 1
    b.wrong_token = lambda i: i == 2
    b.error_event = lambda i: i == 3
    b.no_done = lambda i: i == 4
    report = await run_llm_load(llm_spec(stub.url, output_tokens=LengthDist(3, 6)))
    m = report.measured
    assert m.errors == {"http_429": 1, "stream_error": 1, "incomplete": 1}
    assert m.mismatch_kinds == {"wrong_text": 1, "wrong_length": 0, "wrong_id": 0}
    assert (m.ok, m.good) == (16, 16) and report.mismatched_total == 1


async def test_slow_first_tokens_miss_the_ttft_slo(stub: Stub) -> None:
    stub.behaviour.first_token_s = 0.05
    report = await run_llm_load(llm_spec(stub.url, ttft_slo_ms=10.0))
    assert (report.measured.ok, report.measured.good) == (20, 0)


async def test_the_client_deadline_cuts_streams_and_counts_timeouts(stub: Stub) -> None:
    stub.behaviour.first_token_s = 5.0
    report = await run_llm_load(llm_spec(stub.url, duration_s=0.1, timeout_s=0.2))
    assert report.measured.errors == {"timeout": report.measured.sent} and report.measured.sent == 4


def test_prompt_words_never_contain_whitespace() -> None:
    text = prompt_text(1, 2, 50, np.random.default_rng(0))
    assert len(text.split(" ")) == len(text.split()) == 50
