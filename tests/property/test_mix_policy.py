"""The mix policy (kinds/batch/mix.py) as a plain object: the cap's bounds, and staggering that spreads the
finishes of workers that start together."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kinds.batch.mix import MixInput, MixPolicy, stagger

LINE = (0.100, 0.001)  # 100 ms + 1 ms per item: a full batch of 100 costs 200 ms


@settings(max_examples=300, deadline=None)
@given(
    interactive=st.integers(0, 150),
    bulk=st.integers(0, 500),
    since=st.one_of(st.none(), st.floats(0.0, 2.0)),
    others=st.lists(st.floats(0.0, 0.5), max_size=6),
    ratio=st.floats(0.1, 1.0),
)
def test_cap_bounds(interactive, bulk, since, others, ratio) -> None:
    policy = MixPolicy(100, ratio)
    last = None if since is None else 10.0 - since
    cap = policy.cap(MixInput(10.0, interactive, bulk, last, LINE, [10.0 + o for o in others]))
    assert 1 <= cap <= 100
    assert cap >= min(interactive, 100), "the cap never leaves queued interactive work behind"
    active = interactive > 0 or (last is not None and 10.0 - last <= 0.4)
    allowed = int((ratio * 0.2 - 0.1) / 0.001)
    if bulk == 0 or not active or allowed < 50:
        assert cap == 100, "bulk alone, interactive alone, or a cap that would halve batches: full"
    elif interactive <= 100:
        assert cap <= max(interactive, allowed + 1)


def test_stagger_puts_a_worker_that_starts_together_apart() -> None:
    """The other worker finishes 180 ms from now (it just started a capped batch): the best finish for
    this one is as far as possible from 180 ms and from the one after (360 ms): the shortest batch."""
    d = stagger(0.0, 0.140, 0.180, [0.180])
    assert d == 0.140
    # Already half a period apart: keep the full cap.
    assert stagger(0.0, 0.140, 0.180, [0.090]) == 0.180
    # Nobody else busy: the full cap.
    assert stagger(0.0, 0.140, 0.180, []) == 0.180


def test_two_workers_in_sync_drift_apart_and_stay_apart() -> None:
    """Simulate two workers always busy with bulk and an active interactive stream: starting in sync,
    their finishes end up at least a quarter of a batch apart within a few rounds."""
    policy = MixPolicy(100, 0.9)
    finish = [0.0, 0.0]
    gaps = []
    for _ in range(20):
        w = 0 if finish[0] <= finish[1] else 1
        now = finish[w]
        cap = policy.cap(MixInput(now, 1, 500, now, LINE, [finish[1 - w]]))
        finish[w] = now + LINE[0] + LINE[1] * cap
        gaps.append(abs(finish[0] - finish[1]))
    assert min(gaps[6:]) >= 0.045, gaps
