"""The console's frames: chart points from two frames of a real prometheus registry on a virtual clock,
percentiles interpolated as histogram_quantile does, and bounded history."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Counter, Histogram

from inferd.api.console_feed import ConsoleFeed, Frame, quantile_ms, take_frame, take_frame_stepwise
from inferd.clock import FakeClock
from inferd.runtime.contract import RuntimeStatistics


def stats(name: str, queued: int = 0) -> RuntimeStatistics:
    return RuntimeStatistics(name, 1, "batch", True, (), 0, queued, 0)


def setup(history_s: float = 900.0) -> tuple[ConsoleFeed, FakeClock, Counter, Histogram, list[int]]:
    registry = CollectorRegistry()
    requests = Counter("inferd_requests_total", "", ["model", "version", "outcome"], registry=registry)
    latency = Histogram(
        "inferd_request_duration_seconds",
        "",
        ["model", "version", "outcome"],
        buckets=(0.01, 0.02, 0.05, 0.1),
        registry=registry,
    )
    clock = FakeClock()
    queued = [0]
    feed = ConsoleFeed(
        registry, lambda: [stats("sim", queued[0])], clock, clock.now, interval_s=2.0, history_s=history_s
    )
    return feed, clock, requests, latency, queued


def test_points_are_rates_and_percentiles_of_the_interval() -> None:
    feed, clock, requests, latency, queued = setup()
    for _ in range(30):  # before the first frame: not in the interval
        requests.labels("sim", "1", "ok").inc()
        latency.labels("sim", "1", "ok").observe(0.09)
    feed.sample()
    clock.advance(2.0)
    for i in range(100):
        requests.labels("sim", "1", "ok" if i < 98 else "error").inc()
        latency.labels("sim", "1", "ok").observe(0.015)  # all in the (0.01, 0.02] bucket
    queued[0] = 7
    feed.sample()
    series = feed.page()["series"]["sim"]
    assert series["rps"] == [50.0]
    assert series["errors_ps"] == [1.0]
    assert series["p50_ms"] == [15.0]  # halfway through (10, 20] ms
    assert series["p99_ms"] == [19.9]
    assert series["queued"] == [7]
    assert series["fill"] == [None]  # no batch fill histogram: nothing claimed


def test_page_shows_the_registry_samples_and_history_is_bounded() -> None:
    feed, clock, requests, _, _ = setup(history_s=10.0)
    requests.labels("sim", "1", "ok").inc(3)
    for _ in range(20):
        feed.sample()
        clock.advance(2.0)
    page = feed.page()
    assert len(page["series"]["sim"]["t"]) == 5
    assert page["metrics"]["inferd_requests_total"] == [
        {"labels": {"model": "sim", "version": "1", "outcome": "ok"}, "value": 3.0}
    ]
    assert [m["name"] for m in page["models"]] == ["sim"]
    later = page["series"]["sim"]["t"][-2]
    assert len(feed.page(since=later)["series"]["sim"]["t"]) == 1


def test_quantile_of_an_empty_interval_is_none_and_inf_bucket_caps_at_the_last_bound() -> None:
    assert quantile_ms({}, {("m", "0.1"): 0.0, ("m", "+Inf"): 0.0}, "m", 0.5) is None
    after = {("m", "0.1"): 0.0, ("m", "+Inf"): 4.0}
    assert quantile_ms({}, after, "m", 0.99) == 100.0


def test_a_frame_taken_stepwise_is_the_same_frame_and_lets_other_work_run_between_families() -> None:
    feed, clock, requests, latency, _ = setup()
    requests.labels("sim", "1", "ok").inc(4)
    latency.labels("sim", "1", "ok").observe(0.015)
    turns: list[int] = []

    async def other_work() -> None:  # what the front end's loop serves while a frame is taken
        for i in range(3):
            turns.append(i)
            await asyncio.sleep(0)

    async def both() -> Frame:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(other_work())
            frame = await take_frame_stepwise(feed.registry, feed.runtimes(), clock.now())
            assert turns, "the frame was taken in one step: nothing else ran meanwhile"
        return frame

    stepwise = asyncio.run(both())
    assert stepwise == take_frame(feed.registry, feed.runtimes(), clock.now())
    assert {s.name for s in stepwise.derived} >= {"inferd_requests_total", "inferd_request_duration_seconds_bucket"}


def test_run_takes_a_frame_every_interval() -> None:
    registry = CollectorRegistry()
    requests = Counter("inferd_requests_total", "", ["model", "version", "outcome"], registry=registry)
    requests.labels("sim", "1", "ok").inc()
    clock = FakeClock()
    feed = ConsoleFeed(registry, lambda: [stats("sim")], clock, clock.now, interval_s=0.001)

    async def three_points() -> None:
        running = asyncio.ensure_future(feed.run())
        while len(feed.points) < 3:
            clock.advance(2.0)
            await asyncio.sleep(0.001)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running

    asyncio.run(three_points())
    assert len(feed.points) >= 3
    assert all(set(point) == {"sim"} and point["sim"]["rps"] == 0.0 for _, point in feed.points)  # no request since
