"""llama.cpp's thread count follows the cores other processes leave free (kinds/llm/llama_threads.py)."""

from __future__ import annotations

from pathlib import Path

from inferd.kinds.llm.llama_threads import CpuWatch, ThreadPolicy


def test_a_light_load_keeps_every_core_and_a_taken_core_is_given_up() -> None:
    policy = ThreadPolicy(usable_cores=2)
    assert [policy.decide(0.3) for _ in range(3)] == [2, 2, 2]  # the front end and a light client
    assert policy.decide(0.9) == 2  # one busy look is smoothed away
    assert [policy.decide(0.1) for _ in range(3)] == [2, 2, 2]
    assert [policy.decide(1.1) for _ in range(3)] == [2, 1, 1]  # a hog on one core: give it up
    assert [policy.decide(0.1) for _ in range(4)][-1] == 2  # the hog is gone: every core again


def test_threads_stay_within_one_and_the_usable_cores() -> None:
    policy = ThreadPolicy(usable_cores=4, smoothing=1.0)
    assert policy.decide(0.0) == 4
    assert policy.decide(10.0) == 1
    assert policy.decide(-1.0) == 4


def test_the_watch_counts_the_machines_busy_time_less_its_own(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    watch = CpuWatch(str(stat))
    stat.write_text("cpu  100 0 100 1000 0 0 0 0 0 0\n")
    assert watch.sample() is None  # the first look has nothing to compare with
    hz = watch.ticks_per_s
    stat.write_text(f"cpu  {100 + 10 * hz} 0 100 1000 0 0 0 0 0 0\n")  # 10 busy seconds since
    others = watch.sample()
    assert others is not None and others > 0  # (10 s, less this process's own CPU) over the interval
    stat.write_text("garbage\n")
    assert watch.sample() is None
