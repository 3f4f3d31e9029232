"""pools/residency.py under any sequence of asks, batches, unloads, load ends and time: the memory held
never exceeds the budget (sizes as measured equal to their estimates), nor the count max_loaded_models,
nor the loads under way max_concurrent_loads; nothing busy or protected by min_resident_s is evicted; a
model is never loaded twice at once; and every load asked ends (started, failed, or given up) once the
models held are let go; and the next wake-up it asks for is never one already due."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.pools.residency import (
    LOADING,
    READY,
    UNLOADING,
    Evict,
    FailLoad,
    Limits,
    Queued,
    Residency,
    StartLoad,
)

MODELS = [(f"m{i}", 1) for i in range(6)]
SIZES = {key: float(10 * (i + 1)) for i, key in enumerate(MODELS)}

ask = st.tuples(st.just("ask"), st.sampled_from(MODELS), st.sampled_from([0.0, 1.0, 5.0]))
advance = st.tuples(st.just("advance"), st.sampled_from([0.1, 0.5, 2.0]))
batch = st.tuples(st.just("batch"), st.sampled_from(MODELS))
loaded = st.tuples(st.just("loaded"), st.integers(0, 5))
unloaded = st.tuples(st.just("unloaded"), st.integers(0, 5))
op = st.one_of(  # weighted by repetition: asks, load ends, batches and time are the common events
    ask, ask, ask, advance, advance, batch, batch, loaded, loaded, unloaded, unloaded,
    st.tuples(st.just("done"), st.sampled_from(MODELS)),
    st.tuples(st.just("failed"), st.integers(0, 5)),
    st.tuples(st.just("unload"), st.sampled_from(MODELS)),
)


class Driver:
    """Carries out the policy's decisions as a pool worker would, checking them as they come."""

    def __init__(self, r: Residency, clock: FakeClock) -> None:
        self.r = r
        self.clock = clock
        self.loading: list[tuple[str, int]] = []
        self.unloading: list[tuple[str, int]] = []
        self.running: dict[tuple[str, int], int] = {}
        self.open: set[tuple[str, int]] = set()
        """Loads asked that have not ended yet (queued or joined)."""

    def step(self) -> None:
        now = self.clock.now()
        protected_s = self.r.limits.min_resident_s
        evictable = {  # the rule, restated: ready, no batch held, loaded for min_resident_s
            k for k, res in self.r.held.items()
            if res.state == READY and not self.running.get(k) and now >= res.since + protected_s
        }
        for action in self.r.step():
            if isinstance(action, StartLoad):
                assert action.key not in self.loading
                self.loading.append(action.key)
                self.open.discard(action.key)
            elif isinstance(action, Evict):
                assert action.key in evictable, f"evicted {action.key}: busy or protected"
                assert self.running.get(action.key, 0) == 0
                self.unloading.append(action.key)
            else:
                assert isinstance(action, FailLoad)
                self.open.discard(action.key)
        self.check()

    def check(self) -> None:
        limits = self.r.limits
        assert self.r.used_mb() <= limits.budget_mb + 1e-9
        if limits.max_loaded_models is not None:
            assert len(self.r.held) <= limits.max_loaded_models
        assert sum(1 for res in self.r.held.values() if res.state == LOADING) <= limits.max_concurrent_loads
        wake = self.r.next_at()
        assert wake is None or wake > self.clock.now(), "a wake-up already due: the planner would spin"

    def apply(self, operation: tuple) -> None:
        kind = operation[0]
        if kind == "ask":
            key, wait_s = operation[1], operation[2]
            if isinstance(self.r.ask(key, SIZES[key], wait_s), Queued):
                self.open.add(key)
        elif kind == "advance":
            self.clock.advance(operation[1])
        elif kind == "batch" and operation[1] in self.r.held and self.r.held[operation[1]].state == READY:
            self.running[operation[1]] = self.running.get(operation[1], 0) + 1
            self.r.busy(operation[1])
        elif kind == "done" and self.running.get(operation[1], 0) > 0:
            self.running[operation[1]] -= 1
            self.r.idle(operation[1])
        elif kind in ("loaded", "failed") and self.loading:
            key = self.loading.pop(operation[1] % len(self.loading))
            if kind == "failed":
                self.r.load_failed(key)
            elif not self.r.loaded(key, SIZES[key]):
                self.unloading.append(key)
        elif kind == "unloaded" and self.unloading:
            key = self.unloading[operation[1] % len(self.unloading)]
            if self.running.get(key, 0) == 0:  # it drains first
                self.unloading.remove(key)
                self.r.unloaded(key)
        elif kind == "unload":
            decided = self.r.unload(operation[1])
            if decided is True:
                self.unloading.append(operation[1])
            elif isinstance(decided, FailLoad):
                self.open.discard(operation[1])
        self.step()

    def settle(self) -> None:
        """Let everything finish and age: every load asked must end."""
        for _ in range(200):
            for key in list(self.running):
                while self.running[key]:
                    self.running[key] -= 1
                    self.r.idle(key)
            while self.loading:
                key = self.loading.pop()
                if not self.r.loaded(key, SIZES[key]):
                    self.unloading.append(key)
            for key in self.unloading:
                self.r.unloaded(key)
            self.unloading.clear()
            self.clock.advance(1.0)
            self.step()
            if not self.open and not self.loading and not self.unloading:
                break
        assert not self.open, f"loads asked that never ended: {self.open}"
        assert all(res.state != UNLOADING for res in self.r.held.values())


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(op, min_size=30, max_size=120),
    budget=st.sampled_from([60.0, 100.0, 250.0]),
    cap=st.sampled_from([None, 1, 3]),
    concurrent=st.sampled_from([1, 2]),
    min_resident_s=st.sampled_from([0.0, 1.0, 3.0]),
)
def test_the_budget_and_the_caps_hold_and_nothing_busy_or_protected_is_evicted(
    ops: list[tuple], budget: float, cap: int | None, concurrent: int, min_resident_s: float
) -> None:
    clock = FakeClock()
    limits = Limits(budget, max_loaded_models=cap, max_concurrent_loads=concurrent, min_resident_s=min_resident_s)
    driver = Driver(Residency(limits, clock), clock)
    for operation in ops:
        driver.apply(operation)
    driver.settle()
