"""Versions side by side: model.toml's version_policy and [versions.N] tables, typed kinds, and the registry
that maps a model name and version to its runtime."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from inferd.config import ConfigError, ModelConfig
from inferd.errors import NotFound
from inferd.kinds.repository import load_model_folder, load_model_version
from inferd.runtime.registry import ModelRegistry


def write_model(root: Path, toml: str, versions: tuple[int, ...] = ()) -> Path:
    folder = root / "m"
    folder.mkdir()
    (folder / "model.toml").write_text(toml)
    for v in versions:
        (folder / str(v)).mkdir()
        (folder / str(v) / "model.py").write_text("from inferd import Model\nclass Model(Model):\n    pass\n")
    return folder


CODE_MODEL = """
max_batch_size = 8
[[inputs]]
name = "X"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "Y"
datatype = "FP32"
shape = [2]
"""


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("", [3]),
        ('version_policy = "latest"', [3]),
        ('version_policy = "all"', [3, 2, 1]),
        ("version_policy = { latest = 2 }", [3, 2]),
        ("version_policy = { specific = [1, 3] }", [3, 1]),
    ],
)
def test_version_policy_picks_the_served_versions(tmp_path: Path, policy: str, served: list[int]) -> None:
    folder = write_model(tmp_path, policy + "\n" + CODE_MODEL, versions=(1, 2, 3))
    assert [c.version for c in load_model_folder(folder)] == served


def test_a_specific_version_that_does_not_exist_is_refused_with_the_available_ones(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "version_policy = { specific = [4] }\n" + CODE_MODEL, versions=(1, 2))
    with pytest.raises(ConfigError, match=r"\[4\].*available: \[1, 2\]"):
        load_model_folder(folder)


def test_versions_table_overrides_settings_and_params_of_a_builtin(tmp_path: Path) -> None:
    folder = write_model(
        tmp_path,
        'builtin = "sim"\nversion_policy = "all"\ndefault_version = 1\n[params]\nbase_ms = 5.0\n'
        "[versions.1]\n[versions.2]\nmax_wait_ms = 2.0\n[versions.2.params]\nper_item_ms = 0.5\n",
    )
    v2, v1 = load_model_folder(folder)
    assert (v1.version, v2.version) == (1, 2)
    assert v1.params["base_ms"] == v2.params["base_ms"] == 5.0
    assert v1.params["per_item_ms"] == 0.1 and v2.params["per_item_ms"] == 0.5
    assert v1.max_wait_ms == 10.0 and v2.max_wait_ms == 2.0
    assert v1.default_version == v2.default_version == 1
    assert load_model_version(folder, 2) == v2


def test_a_default_version_that_is_not_served_is_a_start_up_error(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "default_version = 1\n" + CODE_MODEL, versions=(1, 2))
    with pytest.raises(ConfigError, match="default_version = 1 is not served"):
        load_model_folder(folder)


def test_a_builtin_implies_its_kind_and_a_different_kind_is_refused(tmp_path: Path) -> None:
    folder = write_model(tmp_path, 'builtin = "sim-llm"\nkind = "batch"\n')
    with pytest.raises(ConfigError, match='builtin = "sim-llm" is a llm model, but kind = "batch"'):
        load_model_folder(folder)
    (folder / "model.toml").write_text('builtin = "sim-llm"\nkind = "llm"\n')
    assert load_model_folder(folder)[0].kind == "llm"


def test_platform_stays_an_alias_of_the_kind() -> None:
    base = {"name": "x", "implementation": "a:B", "inputs": [{"name": "A", "datatype": "FP32"}]}
    base["outputs"] = base["inputs"]
    assert ModelConfig(**base).kind == "batch"
    text = {"name": "x", "implementation": "a:B"}
    assert ModelConfig(**text, platform="openai_upstream").kind == "upstream"
    assert ModelConfig(**text, platform="inferd_llm").kind == "llm"


@dataclass
class FakeRuntime:
    name: str
    version: int
    config: ModelConfig
    kind: ClassVar[str] = "batch"


def fake(name: str, version: int, default: int | None = None) -> FakeRuntime:
    config = ModelConfig(
        name=name,
        version=version,
        default_version=default,
        implementation="a:B",
        inputs=[{"name": "A", "datatype": "FP32"}],
        outputs=[{"name": "A", "datatype": "FP32"}],
    )
    return FakeRuntime(name, version, config)


def test_registry_resolves_versions_and_the_default() -> None:
    reg = ModelRegistry()
    for rt in (fake("a", 1), fake("a", 2), fake("b", 1, default=1)):
        reg.add(rt)  # type: ignore[arg-type]
    assert reg.get("a").version == 2  # the highest, unless pinned
    assert reg.get("a", "1").version == 1 and reg.get("a", 1).version == 1
    reg.set_default("a", 1)
    assert reg.get("a").version == 1
    assert [(r.name, r.version) for r in reg] == [("a", 1), ("a", 2), ("b", 1)]
    reg.remove("a", 1)
    assert reg.get("a").version == 2  # its pin went with it
    with pytest.raises(NotFound, match=r"served models: \['a', 'b'\]"):
        reg.get("nope")
    with pytest.raises(NotFound, match=r"served versions: \[2\]"):
        reg.get("a", "7")
    with pytest.raises(ValueError, match="twice"):
        reg.add(fake("b", 1))  # type: ignore[arg-type]


def test_llm_models_have_no_tensors_and_refuse_batch_settings(tmp_path: Path) -> None:
    folder = write_model(tmp_path, 'builtin = "sim-llm"\n')
    (llm,) = load_model_folder(folder)
    assert llm.kind == "llm" and llm.inputs == () and llm.outputs == ()
    (folder / "model.toml").write_text('builtin = "sim-llm"\nmax_batch_size = 8\n')
    with pytest.raises(ConfigError, match=r"\['max_batch_size'\] are batch-model settings.*max_num_seqs"):
        load_model_folder(folder)


def test_a_batch_model_without_tensors_is_refused_with_the_fix(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "max_batch_size = 8\n", versions=(1,))
    with pytest.raises(ConfigError, match=r"add \[\[inputs\]\] and \[\[outputs\]\]"):
        load_model_folder(folder)


def test_each_kind_checks_its_typed_params_at_start() -> None:
    from inferd.kinds.repository import builtin_config
    from inferd.server import builtin_kinds

    kinds = builtin_kinds()
    assert kinds.check(builtin_config("sim-llm")).name == "llm"
    with pytest.raises(ConfigError, match=r"params of llm model 'sim-llm': scheduler\.max_num_seqs"):
        kinds.check(builtin_config("sim-llm", params={"scheduler": {"max_num_seqs": 0}}))
    odd = builtin_config("sim").model_copy(update={"kind": "vector"})
    with pytest.raises(
        ConfigError,
        match=r"unknown model kind \"vector\": use one of \['batch', 'llm', 'search', 'upstream'\]",
    ):
        kinds.check(odd)
    with pytest.raises(ConfigError, match=r"params of search model 'docs': shards"):
        kinds.check(builtin_config("search", name="docs").model_copy(update={"params": {"shards": 0}}))
