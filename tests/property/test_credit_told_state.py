"""The credit ledger tells F front ends their state in O(F) (`to_tell` finds the two first holders once):
the state each is told is the same as the rule written out front end by front end (`reference`: idle
only when nothing is held and, of the holders that are this front end or not stale, this one was granted
first), on any sequence of demands, grants, batches received and finished, and time passing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.worker.credits import STALE_HOLD_S, CreditLedger, ToldState

FRONTS = 5

step = st.one_of(
    st.tuples(st.just("report"), st.integers(0, FRONTS - 1), st.integers(0, 40), st.floats(0, 1)),
    st.tuples(st.just("receive"), st.integers(0, FRONTS - 1)),
    st.tuples(st.just("finish")),
    st.tuples(st.just("tell")),
    st.tuples(st.just("wait"), st.floats(0, 2 * STALE_HOLD_S)),
)


def reference(ledger: CreditLedger, front: int) -> ToldState:
    now = ledger.clock.now()
    fronts = ledger._fronts  # the oracle reads the ledger's own records
    holders = [
        (d.holds_since, f == front)
        for f, d in fronts.items()
        if d.outstanding and (f == front or now - d.held_at < STALE_HOLD_S)
    ]
    idle = ledger.idle and (not holders or min(holders)[1])
    return ToldState(idle, ledger.shared, ledger.starts, ledger.idle)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=60))
def test_told_state_is_the_rule_for_every_front_end(steps: list[tuple]) -> None:
    clock = FakeClock()
    ledger = CreditLedger(clock)
    for f in range(FRONTS):
        ledger.join(f)
    for s in steps:
        if s[0] == "report":
            ledger.report(s[1], s[2], s[3])
        elif s[0] == "receive" and ledger.outstanding(s[1]) > 0:
            ledger.received(s[1], 1)
        elif s[0] == "finish" and ledger.held:
            ledger.finished()
        elif s[0] == "wait":
            clock.advance(s[1])
        expected = {f: reference(ledger, f) for f in range(FRONTS)}
        assert {f: ledger.state_for(f) for f in range(FRONTS)} == expected
        if s[0] == "tell":
            told = ledger.to_tell(dict.fromkeys(range(FRONTS)))
            assert {f: state for f, (_, state) in told.items()} == {
                f: reference(ledger, f) for f in told
            }
