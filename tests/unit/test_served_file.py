"""What an owner front end started again serves (frontends/served_file.py): the saved versions, default
and worker slots where they differ from the config's, else the config's; the config's when a saved
version cannot be loaded or the file is garbled."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ConfigError, ModelConfig, TensorSpec
from inferd.frontends.plan import FrontendPlan
from inferd.frontends.served_file import Restored, SavedModel, load, restore, restore_for, save
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


def test_the_file_round_trips_and_a_garbled_or_missing_one_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "served.json"
    assert load(path) == {}
    saved = {"sim": SavedModel([1, 2], 2, {1: [0], 2: [1, 2]})}
    save(path, saved)
    assert load(path) == saved
    assert [p.name for p in tmp_path.iterdir()] == ["served.json"]  # no temporary file left
    path.write_text('{"sim": {"versions": "two"}}')
    assert load(path) == {}


def test_a_finished_update_is_served_again_with_its_slots() -> None:
    models = [config("sim", 1), config("other", 1)]
    saved = {"sim": SavedModel([2], 2, {2: [2, 3]}), "other": SavedModel([1], 1, {1: [0, 5]})}
    r = restore(models, saved, repository(("sim", 2)))
    assert [(m.name, m.version, m.max_batch_size) for m in r.models] == [("sim", 2, 7), ("other", 1, 100)]
    assert r.defaults == {"sim": 2}
    assert r.slots == {("sim", 2): [2, 3]}  # "other" is as configured: its survivors keep their slots


def test_an_update_in_progress_keeps_both_versions_and_each_ones_slots() -> None:
    saved = {"sim": SavedModel([1, 2], 2, {1: [1], 2: [2]})}
    r = restore([config("sim", 1)], saved, repository(("sim", 2)))
    assert sorted(m.version for m in r.models) == [1, 2]
    assert r.defaults == {"sim": 2}
    assert r.slots == {("sim", 1): [1], ("sim", 2): [2]}


def test_a_default_moved_between_configured_versions_is_restored() -> None:
    models = [config("sim", 1), config("sim", 2)]
    r = restore(models, {"sim": SavedModel([1, 2], 1, {1: [0], 2: [1]})}, None)
    assert r.models == models and r.defaults == {"sim": 1}
    unchanged = restore(models, {"sim": SavedModel([1, 2], 2, {1: [0], 2: [1]})}, None)
    assert unchanged == Restored(models)


@pytest.mark.parametrize("load_version", [None, repository()], ids=["no repository", "version removed"])
def test_a_saved_version_that_cannot_be_loaded_leaves_the_config(load_version: object) -> None:
    models = [config("sim", 1)]
    r = restore(models, {"sim": SavedModel([2], 2, {2: [1]})}, load_version)  # type: ignore[arg-type]
    assert r == Restored(models)


def test_only_the_owner_of_several_front_ends_restores(tmp_path: Path) -> None:
    models = [config("sim", 1)]
    plan = FrontendPlan(0, 2, str(tmp_path), "token")
    save(Path(plan.served_path()), {"sim": SavedModel([2], 2, {2: [1]})})
    load_version = repository(("sim", 2))
    assert restore_for(None, models, load_version) == Restored(models)
    assert restore_for(plan.at(1), models, load_version) == Restored(models)
    restored = restore_for(plan, models, load_version)
    assert [m.version for m in restored.models] == [2]

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
