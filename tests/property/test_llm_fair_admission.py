"""Tenants' shares of LLM admission under arbitrary interleavings (hypothesis).

The engine's waiting queue (inferd.kinds.llm.waiting): FIFO per tenant; a tenant that starts waiting is
admitted within one turn of each tenant already waiting, however long their backlogs; under a backlog
from every tenant, admissions per weight stay within one turn of each other.

The front end's waiting room (inferd.kinds.llm.placement): never over its bound; a tenant within its share is
never refused; only tenants over their share give up sequences.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.errors import Overloaded
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.sequence import Sequence
from inferd.kinds.llm.stream import TokenStream
from inferd.kinds.llm.waiting import WaitingClass
from tests.unit.test_llm_failover import make_runtime, step

TENANTS = ("a", "b", "c")
weights_st = st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=3, max_size=3)
ops_st = st.lists(st.tuples(st.sampled_from(["add", "add", "admit"]), st.sampled_from(TENANTS)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(weights_st, ops_st)
def test_fifo_per_tenant_and_a_newcomer_waits_at_most_one_turn_per_waiting_tenant(
    weights: list[float], ops: list[tuple[str, str]]
) -> None:
    w = dict(zip(TENANTS, weights, strict=True))
    waiting = WaitingClass()
    added: dict[str, list[str]] = {t: [] for t in TENANTS}
    admitted: dict[str, list[str]] = {t: [] for t in TENANTS}
    newcomers: dict[str, tuple[str, int]] = {}
    """A tenant's first sequence after an empty lane -> (its id, how many tenants waited then)."""
    waited: dict[str, int] = {}
    for n, (op, tenant) in enumerate(ops):
        if op == "add":
            seq = Sequence(f"{tenant}{n}", (1,), 1, tenant=tenant, weight=w[tenant])
            if len(added[tenant]) == len(admitted[tenant]):
                others = sum(len(added[t]) > len(admitted[t]) for t in TENANTS)
                newcomers[tenant] = (seq.seq_id, others)
                waited[seq.seq_id] = 0
            waiting.add(seq)
            added[tenant].append(seq.seq_id)
            continue
        head = waiting.head()
        if head is None:
            continue
        waiting.pop(head)
        admitted[head.tenant].append(head.seq_id)
        for seq_id in list(waited):
            if seq_id == head.seq_id:
                del waited[seq_id]
            else:
                waited[seq_id] += 1
        for tenant_, (seq_id, others) in newcomers.items():
            if seq_id in waited:
                assert waited[seq_id] <= others, (tenant_, seq_id, waited[seq_id], others)
    for t in TENANTS:
        assert admitted[t] == added[t][: len(admitted[t])], "FIFO within a tenant"
    assert len(waiting) == sum(len(added[t]) - len(admitted[t]) for t in TENANTS)


@settings(max_examples=100, deadline=None)
@given(weights_st, st.integers(1, 60))
def test_admissions_per_weight_stay_within_one_turn_under_a_backlog(weights: list[float], turns: int) -> None:
    w = dict(zip(TENANTS, weights, strict=True))
    waiting = WaitingClass()
    for i in range(200):
        for t in TENANTS:
            waiting.add(Sequence(f"{t}{i}", (1,), 1, tenant=t, weight=w[t]))
    got = dict.fromkeys(TENANTS, 0)
    for _ in range(turns):
        head = waiting.head()
        assert head is not None
        waiting.pop(head)
        got[head.tenant] += 1
        for i in TENANTS:
            for j in TENANTS:
                assert got[i] / w[i] - got[j] / w[j] <= 1 / w[i] + 1 / w[j] + 1e-9, (got, w)


room_ops = st.lists(
    st.tuples(st.sampled_from(["submit", "submit", "submit", "admit"]), st.sampled_from(TENANTS)),
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(weights_st, st.integers(1, 8), room_ops)
def test_the_waiting_room_is_bounded_and_shared_by_weight(
    weights: list[float], room: int, ops: list[tuple[str, str]]
) -> None:
    w = dict(zip(TENANTS, weights, strict=True))
    rt, (worker,) = make_runtime(n_workers=1, scheduler={"max_waiting_seqs": room})
    waiting: dict[str, list[TokenStream]] = {t: [] for t in TENANTS}
    for op, tenant in ops:
        if op == "admit":
            if waiting[tenant]:
                step(rt, worker, {}, admitted=[waiting[tenant].pop(0).seq_id])
            continue
        held = {t: len(v) for t, v in waiting.items() if v}
        active = {t: w[t] for t in held} | {tenant: w[tenant]}
        share = room * w[tenant] / sum(active.values())
        over = {t for t in held if held[t] > room * w[t] / sum(active.values())}
        full = sum(held.values()) >= room
        try:
            stream = rt.submit([1, 2], Generation(max_tokens=2, tenant=tenant, weight=w[tenant]))
        except Overloaded:
            assert full and held.get(tenant, 0) + 1 > share, (held, tenant, share)
            continue
        assert not full or held.get(tenant, 0) + 1 <= share, (held, tenant, share)
        for t, streams in waiting.items():
            gone = [s for s in streams if s.ended]
            assert not gone or t in over, f"{t} gave way within its share: {held}, {w}"
            waiting[t] = [s for s in streams if not s.ended]
        waiting[tenant].append(stream)
        assert sum(len(v) for v in waiting.values()) <= room
    assert rt.statistics().queued == sum(len(v) for v in waiting.values())
