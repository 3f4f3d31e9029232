"""What an owner front end started again serves (cluster/saved.py, from the cluster store): each saved
model's versions, default and worker slots at their indexes, a running rolling update ended where its
default was; the config's when a saved version cannot be loaded, the state is not a front end's, the
store does not answer, or three owners in a row died before they ran with it."""

from __future__ import annotations

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.cluster.saved import LOCAL_TTL_S, Restored, SavedModel, load, restore, save, take
from inferd.cluster.served import ModelServed, ServedState
from inferd.cluster.store import StoreUnavailable
from inferd.config import ConfigError, ModelConfig, TensorSpec
from inferd.runtime.registry import ModelRegistry
from inferd.worker.supervisor import Supervisor


def config(name: str, version: int, **more: object) -> ModelConfig:
    return ModelConfig(
        name=name,
        version=version,
        implementation="inferd.models.sim:SimModel",
        inputs=[TensorSpec(name="x", datatype="FP32", shape=(1,))],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=(1,))],
        **more,
    )


def repository(*present: tuple[str, int]) -> object:
    def load_version(model: str, version: int | None) -> ModelConfig:
        if (model, version) not in present:
            raise ConfigError(f"{model} has no version {version} in the repository")
        return config(model, version or 1, max_batch_size=7)

    return load_version


async def served_as(store: MemoryStore, saved: dict[str, SavedModel], frontend: str = "0") -> None:
    """The store as a holder leaves it: the served document and the front end's slots."""
    models = {n: ModelServed(m.versions, m.default, m.updating) for n, m in saved.items()}
    await store.write("served", msgspec.msgpack.encode(ServedState(models=models)))
    await save(store, frontend, {n: m.slots for n, m in saved.items()})


async def test_the_state_round_trips_through_the_store_and_a_garbled_or_missing_one_is_empty() -> None:
    store = MemoryStore(FakeClock())
    assert await load(store, "0") == ({}, 0)
    saved = {"sim": SavedModel([1, 2], 2, {1: [0], 2: [1, 2]}, [1, 2, 2])}
    await served_as(store, saved)
    assert await load(store, "0") == (saved, 0)
    assert await load(store, "1") == ({}, 0)  # it never ran: its config's workers, and it follows the rest
    await save(store, "1", {})
    assert await load(store, "1") == ({"sim": SavedModel([1, 2], 2, {}, [1, 2, 2])}, 0)  # ran with no slots
    await store.write("served", b"\x93garbled")
    assert await load(store, "0") == ({}, 0)


async def test_the_slots_of_a_front_end_gone_for_good_expire() -> None:
    """`local/<frontend>` lives LOCAL_TTL_S after its last write: ids that never come back (a Kubernetes
    pod's address) do not pile up; one that comes back in time serves its slots."""
    clock = FakeClock()
    store = MemoryStore(clock)
    saved = {"sim": SavedModel([1], 1, {1: [0]}, [])}
    await served_as(store, saved)
    await save(store, "gone", {"sim": {1: [0]}})
    clock.advance(LOCAL_TTL_S / 2)
    assert await load(store, "gone") == (saved, 0)
    clock.advance(LOCAL_TTL_S / 2 + 1)
    assert await load(store, "gone") == ({}, 0)
    assert await store.read_prefix("local/") == {}


async def test_owners_that_die_before_they_run_with_a_state_are_counted_up_to_three() -> None:
    store = MemoryStore(FakeClock())
    saved = {"sim": SavedModel([2], 2, {2: [2, 3]})}
    await served_as(store, saved)
    assert [await take(store, "0") for _ in range(4)] == [saved, saved, saved, {}]  # three died before they ran
    await save(store, "0", {"sim": {2: [2, 3]}})  # a front end runs (with the config's versions, or the saved)
    assert await take(store, "0") == saved
    assert (await load(store, "0"))[1] == 1  # counted until this one runs


async def test_a_store_that_does_not_answer_at_start_leaves_the_config() -> None:
    class Down(MemoryStore):
        async def read(self, doc: str) -> None:
            raise StoreUnavailable("down")

    assert await take(Down(FakeClock()), "0") == {}


def test_a_finished_update_is_served_again_with_its_slots() -> None:
    models = [config("sim", 1), config("other", 1)]
    saved = {"sim": SavedModel([2], 2, {2: [2, 3]})}
    r = restore(models, saved, repository(("sim", 2)))
    assert [(m.name, m.version, m.max_batch_size) for m in r.models] == [("sim", 2, 7), ("other", 1, 100)]
    assert r.defaults == {"sim": 2}
    assert r.slots == {("sim", 2): [2, 3]}  # "other" is not in the file: as configured


def test_the_config_version_after_a_rollback_keeps_the_saved_slots_not_the_configs() -> None:
    r = restore([config("sim", 1)], {"sim": SavedModel([1], 1, {1: [4, 5]})}, None)
    assert [m.version for m in r.models] == [1] and r.slots == {("sim", 1): [4, 5]}
    launcher = Supervisor("unix:/nowhere", "token", "INFO")  # never run
    r.add_slots(launcher, [(m, 2) for m in r.models])
    assert [s.index for s in launcher.slots] == [4, 5]  # 2 workers, not the config's 2 plus these 2


def test_an_update_past_its_first_new_worker_is_finished_with_as_many_workers() -> None:
    # 1 -> 2 over 3 workers: one new worker ready (default 2), one old retired and gone, two old live
    saved = {"sim": SavedModel([1, 2], 2, {1: [1, 2], 2: [3]}, [1, 2, 3])}
    r = restore([config("sim", 1)], saved, repository(("sim", 2)))
    assert [m.version for m in r.models] == [2] and r.defaults == {"sim": 2}
    assert r.slots == {("sim", 2): [3, 4, 5]}  # the new one kept; new indexes, never an old worker's id


def test_an_update_before_its_first_new_worker_is_undone() -> None:
    saved = {"sim": SavedModel([1, 2], 1, {1: [0, 1], 2: [2]}, [1, 2, 2])}
    r = restore([config("sim", 1)], saved, repository(("sim", 2)))
    assert [m.version for m in r.models] == [1] and r.defaults == {"sim": 1}
    assert r.slots == {("sim", 1): [0, 1]}  # the new version's starting worker is not taken back


def test_a_default_moved_between_configured_versions_is_restored() -> None:
    models = [config("sim", 1), config("sim", 2)]
    r = restore(models, {"sim": SavedModel([1, 2], 1, {1: [0], 2: [1]})}, None)
    assert r.models == models and r.defaults == {"sim": 1}
    assert r.slots == {("sim", 1): [0], ("sim", 2): [1]}


@pytest.mark.parametrize(
    "saved",
    [
        SavedModel([2, 2], 2, {2: [0]}),
        SavedModel([2], 3, {2: [0]}),
        SavedModel([2], 2, {3: [0]}),
        SavedModel([1, 2], 2, {1: [0], 2: [0]}),
        SavedModel([1, 2], 2, {1: [0], 2: [1]}, [1, 3, 1]),
        SavedModel([1, 2], 2, {1: [0], 2: [1]}, [2, 2, 1]),
        SavedModel([1, 2, 3], 3, {1: [0], 2: [1]}, [1, 2, 1]),
        SavedModel([1, 2], 2, {1: [0], 2: [1]}, [1, 2, 10**6]),
    ],
    ids=[
        "twice",
        "default",
        "slots",
        "one index twice",
        "update",
        "update to itself",
        "default elsewhere",
        "workers",
    ],
)
def test_a_state_no_owner_writes_leaves_the_config(saved: SavedModel) -> None:
    models = [config("sim", 1)]
    assert saved.problem() is not None
    assert restore(models, {"sim": saved}, repository(("sim", 2), ("sim", 3))) == Restored(models)


@pytest.mark.parametrize("load_version", [None, repository()], ids=["no repository", "version removed"])
def test_a_saved_version_that_cannot_be_loaded_leaves_the_config(load_version: object) -> None:
    models = [config("sim", 1)]
    r = restore(models, {"sim": SavedModel([2], 2, {2: [1]})}, load_version)  # type: ignore[arg-type]
    assert r == Restored(models)


async def test_an_owner_started_again_takes_its_saved_slots_and_default() -> None:
    models = [config("sim", 1)]
    store = MemoryStore(FakeClock())
    await served_as(store, {"sim": SavedModel([2], 2, {2: [1]})})
    restored = restore(models, await take(store, "0"), repository(("sim", 2)))
    assert [m.version for m in restored.models] == [2]
    assert (await load(store, "0"))[1] == 1  # counted until this owner runs

    launcher, registry = Supervisor("unix:/nowhere", "token", "INFO"), ModelRegistry()  # never run
    restored.add_slots(launcher, [(m, 2) for m in restored.models])
    assert [(s.model, s.index, s.version) for s in launcher.slots] == [("sim", 1, 2)]  # the saved index
    assert launcher.served == {("sim", 2)}
    launcher.add("sim", 1, 2)  # a scale-up after: the next index
    assert [s.index for s in launcher.slots] == [1, 2]
    for m in restored.models:
        registry.add(_Runtime(m))  # type: ignore[arg-type]
    restored.set_defaults(registry)
    assert registry.default_version("sim") == 2


class _Runtime:
    def __init__(self, config: ModelConfig) -> None:
        self.config, self.name, self.version = config, config.name, config.version
