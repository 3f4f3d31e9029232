"""An LLM worker joined to several front ends (worker/fronts.py SequenceOwners): each step's tokens,
ends, admissions and preemptions go back to the front end that sent the sequence, under its own id,
and to no other; the single tokens travel in the compact columns (decoded_ids / decoded_tokens)."""

from __future__ import annotations

from inferd.wire import protocol as p
from inferd.worker.fronts import SequenceOwners


class FakeLink:
    def __init__(self, index: int) -> None:
        self.index = index
        self.sent: list[p.Message] = []

    def send(self, msg: p.Message) -> None:
        self.sent.append(msg)


def test_each_front_end_gets_only_its_own_sequences_under_its_own_ids() -> None:
    links = {0: FakeLink(0), 1: FakeLink(1)}
    owners = SequenceOwners(lambda: links)  # type: ignore[arg-type,return-value]
    ids = {}
    for index, seq_id in [(0, "a"), (1, "a"), (1, "b")]:  # both front ends use the id "a"
        msg = owners.inbound(links[index], p.AddSequence(seq_id, [1, 2, 3], 4))  # type: ignore[arg-type]
        ids[(index, seq_id)] = msg.seq_id
    assert len(set(ids.values())) == 3
    stats = p.LLMStats(running=3)
    owners.send(
        p.StepDeltas(
            0.02,
            [p.SeqDelta(ids[(1, "b")], [9], "length"), p.SeqDelta("7/gone", [5], None)],
            stats,
            admitted=[ids[(0, "a")], ids[(1, "b")]],
            preempted=[ids[(1, "a")]],
            decoded_ids=[ids[(0, "a")], ids[(1, "a")], "7/gone"],
            decoded_tokens=[10, 11, 12],
        )
    )
    (first,), (second,) = links[0].sent, links[1].sent
    assert isinstance(first, p.StepDeltas) and isinstance(second, p.StepDeltas)
    assert (first.decoded_ids, first.decoded_tokens, first.deltas) == (["a"], [10], [])
    assert (first.admitted, first.preempted) == (["a"], [])
    assert (second.decoded_ids, second.decoded_tokens) == (["a"], [11])
    assert [(d.seq_id, d.token_ids, d.finish_reason) for d in second.deltas] == [("b", [9], "length")]
    assert (second.admitted, second.preempted) == (["b"], ["a"])
    assert first.stats == second.stats == stats
    # "b" ended: an abort of its link no longer names it; the live ones are still owned
    assert [m.seq_id for m in owners.release(1)] == [ids[(1, "a")]]
    assert [m.seq_id for m in owners.release(0)] == [ids[(0, "a")]]


def test_all_deltas_expands_the_single_tokens() -> None:
    msg = p.StepDeltas(
        0.0, [p.SeqDelta("x", [3], "stop")], p.LLMStats(), decoded_ids=["y"], decoded_tokens=[4]
    )
    decoded = p.decode_message(memoryview(p.encode_frame(msg))[4:])
    assert isinstance(decoded, p.StepDeltas)
    assert [(d.seq_id, d.token_ids, d.finish_reason) for d in decoded.all_deltas()] == [
        ("y", [4], None),
        ("x", [3], "stop"),
    ]
