"""PoolState.queued: the loads waiting on a pool worker to start, named in its PoolState (worker/holdings.py)
so that every front end sees a model coming there; a field added to protocol 6 at the end, with a
default, so that workers and front ends with and without it still read each other's PoolState."""

from __future__ import annotations

import msgspec

from inferd.models.sim import sim_config
from inferd.pools.residency import Limits
from inferd.wire import protocol as p
from inferd.worker.holdings import Holdings


class OldHeldModel(msgspec.Struct):
    model: str
    version: int
    state: str
    memory_mb: float
    idle_s: float = 0.0
    evictable: bool = False


class OldPoolState(msgspec.Struct, tag="pool_state"):
    """PoolState as protocol 6 first shipped it (before `queued`)."""

    budget_mb: float
    used_mb: float
    models: list[OldHeldModel] = []
    loads: dict[str, int] = {}
    evictions: dict[str, int] = {}
    waiting_loads: int = 0


def body(frame: bytes) -> bytes:
    return frame[4:]  # past the length prefix


def test_a_pool_state_with_its_queued_loads_round_trips() -> None:
    state = p.PoolState(
        1000.0, 300.0, [p.HeldModel("b", 1, "loading", 300.0)], {"b": 2}, {"c": 1}, waiting_loads=2,
        queued=[p.QueuedLoad("a", 1, 120.0), p.QueuedLoad("d", 3, 80.0)],
    )
    assert p.decode_message(body(p.encode_frame(state))) == state


def test_an_old_pool_state_decodes_with_none_queued() -> None:
    """From a worker without the field: its loads waiting are a count only."""
    old = OldPoolState(1000.0, 300.0, [OldHeldModel("b", 1, "loading", 300.0)], waiting_loads=1)
    decoded = p.decode_message(msgspec.msgpack.encode(old))
    assert isinstance(decoded, p.PoolState)
    assert decoded.queued == [] and decoded.waiting_loads == 1
    assert decoded.models == [p.HeldModel("b", 1, "loading", 300.0)]


def test_an_old_front_end_reads_a_new_pool_state() -> None:
    """An older front end's decoder ignores the field it does not know."""
    new = p.PoolState(1000.0, 0.0, waiting_loads=1, queued=[p.QueuedLoad("a", 1, 120.0)])
    old = msgspec.msgpack.decode(body(p.encode_frame(new)), type=OldPoolState)
    assert (old.budget_mb, old.used_mb, old.waiting_loads) == (1000.0, 0.0, 1)


def config_json(name: str, memory_mb: float) -> bytes:
    config = sim_config(name, base_ms=0.0, per_item_ms=0.0)
    return config.model_copy(update={"pool": "p", "memory_mb": memory_mb}).model_dump_json().encode()


def test_the_pool_worker_names_its_queued_loads_in_order() -> None:
    """Loads asked and not started (here: none has started, the planner has not run) are listed with the
    room each will take; a second ask of one joins it (listed once); an unload gives one up."""
    told: list[p.Message] = []
    holdings = Holdings("pw", None, told.append, lambda *a: None)  # type: ignore[arg-type,return-value]
    holdings.configure(Limits(budget_mb=1000.0, max_concurrent_loads=1))
    for name, size in (("a", 120.0), ("b", 80.0), ("a", 120.0)):
        assert holdings.ask(p.LoadModel(name, 1, config_json(name, size))) is None
    state = holdings.state()
    assert state.queued == [p.QueuedLoad("a", 1, 120.0), p.QueuedLoad("b", 1, 80.0)]
    assert state.waiting_loads == 2 and state.models == []
    holdings.unload(("a", 1))
    assert holdings.state().queued == [p.QueuedLoad("b", 1, 80.0)]
