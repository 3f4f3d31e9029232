"""A busy worker's staging slot is filled near the end of its running batch, not as soon as it starts:
the staged batch is cut from what arrived by then, so a light tenant's item that arrives while a heavy
tenant's backlog fills every batch goes in the very next batch (fair order), not behind a staged one."""

from __future__ import annotations

import pytest

from inferd.kinds.batch.policy import STAGE_LEAD_FRACTION, STAGE_LEAD_MIN_S, BatchPolicy, stage_time
from inferd.routing.fairness import TenantShare
from tests.unit.test_batch_runtime import done, runtime

A, B = TenantShare("a"), TenantShare("b")


def test_stage_time_leaves_a_lead_before_the_expected_finish() -> None:
    assert stage_time(10.0, None) == 10.0  # nothing measured yet: stage at once
    assert stage_time(10.0, 0.2) == pytest.approx(10.2 - max(STAGE_LEAD_MIN_S, STAGE_LEAD_FRACTION * 0.2))
    assert stage_time(10.0, 0.02) == pytest.approx(10.02 - STAGE_LEAD_MIN_S)


def test_a_full_batch_for_a_staging_slot_waits_for_its_stage_time() -> None:
    policy = BatchPolicy(4, 0.0)
    assert policy.decide(1.0, 8, 0.5, 0, 1, stage_at=1.5).size == 0
    assert policy.decide(1.0, 8, 0.5, 0, 1, stage_at=1.5).wake_at == 1.5
    assert policy.decide(1.5, 8, 0.5, 0, 1, stage_at=1.5).size == 4
    assert policy.decide(1.0, 8, 0.5, 0, 1).size == 4  # no stage time known: at once


async def test_a_light_tenants_arrival_joins_the_next_batch_while_the_heavy_tenants_backlog_waits() -> None:
    rt = runtime(max_batch=4, workers=1)
    (worker,) = rt.members.connections()
    rt.enqueue([b"a0", b"a1", b"a2", b"a3"], None, tenant=A)
    rt.dispatch_due()
    rt.clock.advance(0.1)
    rt.on_batch_done(worker, done(worker))  # measured: a batch takes 100 ms
    rt.enqueue([f"a{i}".encode() for i in range(4, 12)], None, tenant=A)
    wake_at = rt.dispatch_due()  # a4..a7 run; a8..a11 are a full batch, but not staged yet
    assert len(worker.inflight) == 1
    assert wake_at == pytest.approx(rt.clock.now() + 0.1 - STAGE_LEAD_MIN_S)
    rt.clock.advance(0.05)
    rt.enqueue([b"b0"], None, tenant=B)
    rt.dispatch_due()
    assert len(worker.inflight) == 1, "staged before its time"
    rt.clock.advance(0.05 - STAGE_LEAD_MIN_S + 1e-9)
    rt.dispatch_due()
    staged = list(worker.inflight.values())[1]
    assert b"b0" in [i.payload for i in staged.items] and len(staged.items) == 4
