"""Tenants' shares of LLM admission: a worker's waiting room is shared by weight at the front end (a
tenant within its share displaces the newest waiting sequences of a tenant over its share), and the
engine's scheduler admits its waiting tenants in weighted fair order."""

from __future__ import annotations

import pytest

from inferd.clock import FakeClock
from inferd.errors import Overloaded
from inferd.kinds.llm import BULK, LLMScheduler, SchedulerConfig, SeqOutput
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.sequence import Sequence
from inferd.kinds.llm.waiting import WaitingClass
from inferd.wire import protocol as p
from tests.unit.test_llm_failover import adds, make_runtime, step


def gen(tenant: str, weight: float = 1.0, priority: int = 0) -> Generation:
    return Generation(max_tokens=2, tenant=tenant, weight=weight, priority=priority)


async def test_a_tenant_within_its_share_displaces_the_flooding_tenants_newest_waiting_sequence() -> None:
    rt, (w,) = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": 4})
    flood = [rt.submit([1, 2, 3], gen("a")) for _ in range(4)]
    with pytest.raises(Overloaded):
        rt.submit([1, 2, 3], gen("a"))  # a alone holds the whole room: its share
    b1 = rt.submit([4, 5, 6], gen("b"))
    assert flood[3].ended and not any(s.ended for s in flood[:3])
    with pytest.raises(Overloaded, match="tenant 'a' holds more than its share"):
        await flood[3].next()
    sent = w.writer.sent  # type: ignore[attr-defined]
    abort = next(i for i, m in enumerate(sent) if isinstance(m, p.AbortSequence))
    assert sent[abort].seq_id == flood[3].seq_id
    assert [m.seq_id for m in sent[abort + 1 :]] == [b1.seq_id], "the abort goes before b's sequence"
    rt.submit([4, 5, 6], gen("b"))  # b's share is 2 of 4
    assert flood[2].ended and not flood[1].ended
    with pytest.raises(Overloaded):
        rt.submit([4, 5, 6], gen("b"))  # a third would take b past its share: b is refused, a keeps 2
    assert not flood[1].ended
    assert rt.statistics().detail.rejected == 4  # a's 5th, two displaced, b's 3rd


def test_weights_set_the_shares_of_the_room() -> None:
    rt, (w,) = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": 4})
    flood = [rt.submit([1, 2], gen("a")) for _ in range(4)]
    b = [rt.submit([3, 4], gen("b", weight=3.0)) for _ in range(3)]  # b's share: 3 of 4
    with pytest.raises(Overloaded):
        rt.submit([3, 4], gen("b", weight=3.0))
    assert [s.ended for s in flood] == [False, True, True, True]
    assert [m.weight for m in adds(w) if m.seq_id in {s.seq_id for s in b}] == [3.0] * 3


def test_admitted_sequences_leave_the_room_to_whoever_comes_next() -> None:
    rt, (w,) = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": 2})
    a = [rt.submit([1, 2], gen("a")) for _ in range(2)]
    step(rt, w, {}, admitted=[a[0].seq_id, a[1].seq_id])
    rt.submit([1, 2], gen("a"))
    rt.submit([1, 2], gen("a"))
    assert not any(s.ended for s in a)  # running sequences are never displaced


def test_prompt_tokens_are_shared_too() -> None:
    rt, _ = make_runtime(n_workers=1, scheduler={"max_waiting_prompt_tokens": 12})
    flood = [rt.submit(list(range(4)), gen("a")) for _ in range(3)]
    rt.submit(list(range(6)), gen("b"))  # b's share of the tokens: 6; a's newest two make room
    assert [s.ended for s in flood] == [False, True, True]
    rt.submit([1, 2], gen("b"))  # free room is anyone's
    with pytest.raises(Overloaded):
        rt.submit([1], gen("b"))  # none left, and b is at its share


def test_bulk_never_displaces_interactive() -> None:
    rt, _ = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": 2})
    a = [rt.submit([1, 2], gen("a")) for _ in range(2)]
    with pytest.raises(Overloaded):
        rt.submit([1, 2], gen("b", priority=BULK))  # interactive holds the room: bulk's class has none
    assert not any(s.ended for s in a)


# ---- the engine's admission order -------------------------------------------------------------------
def run_until_idle(sched: LLMScheduler, steps: int = 200) -> list[str]:
    """Step with a model that samples token 1 everywhere; returns the admission order."""
    order: list[str] = []
    for _ in range(steps):
        if not sched.has_work():
            return order
        plan = sched.schedule()
        order += plan.admitted
        sched.apply(plan, {c.seq_id: SeqOutput(token=1) for c in plan.chunks if c.samples})
    raise AssertionError("the scheduler did not go idle")


def scheduler(max_num_seqs: int = 1) -> LLMScheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=4, num_blocks=64)
    return LLMScheduler(cfg, FakeClock())


def test_a_light_tenant_is_admitted_ahead_of_a_heavy_tenants_backlog() -> None:
    sched = scheduler()
    for i in range(8):
        sched.add(f"a{i}", [1, 2, 3], 2, tenant="a")
    plan = sched.schedule()  # a0 takes the only seat
    sched.apply(plan, {})
    sched.add("b0", [4, 5, 6], 2, tenant="b")
    order = run_until_idle(sched)
    assert order.index("b0") <= 1, order  # at most the one a that tied with it goes first
    assert [s for s in order if s.startswith("a")] == [f"a{i}" for i in range(1, 8)]  # FIFO per tenant


def test_admissions_follow_the_weights_under_a_backlog() -> None:
    sched = scheduler()
    for i in range(12):
        sched.add(f"a{i}", [1, 2], 1, tenant="a", weight=1.0)
        sched.add(f"b{i}", [3, 4], 1, tenant="b", weight=3.0)
    first = run_until_idle(sched)[:12]
    assert sum(s.startswith("b") for s in first) == 9, first


def test_a_preempted_sequence_goes_back_ahead_of_every_tenant_without_a_charge() -> None:
    waiting = WaitingClass()
    seqs = {name: Sequence(name, (1,), 1, tenant=name[0]) for name in ("a0", "a1", "b0", "b1", "p0")}
    for name in ("a0", "a1", "b0", "b1"):
        waiting.add(seqs[name])
    waiting.put_back(seqs["p0"])
    assert [s.seq_id for s in waiting.in_order()] == ["p0", "a0", "b0", "a1", "b1"]
    order = []
    while (head := waiting.head()) is not None:
        waiting.pop(head)
        order.append(head.seq_id)
    assert order == ["p0", "a0", "b0", "a1", "b1"] and not waiting
