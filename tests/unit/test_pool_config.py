"""The `[pools.NAME]` tables and a pooled model's settings: each mistake refused at start, naming the key
and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from inferd.config import ConfigError, ModelConfig, load_server_config
from inferd.config.pools import PoolConfig, pool_refusals

TENSORS = {"inputs": [{"name": "x", "datatype": "FP32"}], "outputs": [{"name": "y", "datatype": "FP32"}]}


def model(**over: object) -> ModelConfig:
    return ModelConfig(**{"name": "m", "implementation": "inferd.models.sim:SimModel", **TENSORS, **over})


def test_pools_tables_are_read(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text("[pools.gpu]\nworkers = 2\nmemory_budget_mb = 4000\nmax_loaded_models = 3\n")
    config = load_server_config(path, {}, environ={})
    assert config.pools == {"gpu": PoolConfig(workers=2, memory_budget_mb=4000, max_loaded_models=3)}
    assert config.pools["gpu"].min_resident_s == 5.0 and config.pools["gpu"].max_concurrent_loads == 1


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("workers = 1", "memory_budget_mb"),
        ("memory_budget_mb = 0", "memory_budget_mb"),
        ("memory_budget_mb = 10\nworkers = -1", "workers"),
        ("memory_budget_mb = 10\nbudget = 3", "budget"),
    ],
)
def test_a_bad_pool_table_is_refused_naming_the_key(tmp_path: Path, table: str, key: str) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(f"[pools.p]\n{table}\n")
    with pytest.raises(ConfigError, match=f"pools.p.{key}"):
        load_server_config(path, {}, environ={})


def test_a_bad_pool_name_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text('[pools."-x"]\nmemory_budget_mb = 10\n')
    with pytest.raises(ConfigError, match="pools"):
        load_server_config(path, {}, environ={})


def test_a_pooled_model_needs_memory_mb() -> None:
    with pytest.raises(ValidationError, match="needs memory_mb"):
        model(pool="p")
    assert model(pool="p", memory_mb=300).memory_mb == 300


@pytest.mark.parametrize("size", [0, -5])
def test_memory_mb_must_be_positive(size: float) -> None:
    with pytest.raises(ValidationError, match="memory_mb"):
        model(memory_mb=size)


@pytest.mark.parametrize(("over", "named"), [({"workers": 2}, "workers"), ({"autoscale": {}}, "autoscale")])
def test_a_pooled_model_has_no_workers_of_its_own(over: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=f"no workers of its own.*remove {named}"):
        model(pool="p", memory_mb=10, **over)


def test_pool_on_an_llm_model_is_refused() -> None:
    with pytest.raises(ValidationError, match="only batch models are loaded on a pool"):
        ModelConfig(name="l", kind="llm", implementation="x:Y", pool="p")


def test_memory_mb_and_cold_queue_size_on_an_llm_model_are_refused() -> None:
    with pytest.raises(ValidationError, match="memory_mb"):
        ModelConfig(name="l", kind="llm", implementation="x:Y", memory_mb=10)
    with pytest.raises(ValidationError, match="cold_queue_size"):
        ModelConfig(name="l", kind="llm", implementation="x:Y", cold_queue_size=10)


def test_an_unknown_pool_is_refused_with_the_pools_defined() -> None:
    [refusal] = pool_refusals([model(pool="q", memory_mb=10)], {"p": PoolConfig(memory_budget_mb=100)})
    assert "pool = 'q' is not defined (pools defined: [pools.p])" in refusal
    [refusal] = pool_refusals([model(pool="q", memory_mb=10)], {})
    assert "pools defined: none" in refusal


def test_a_model_over_its_pools_budget_is_refused_with_both_sizes() -> None:
    [refusal] = pool_refusals([model(pool="p", memory_mb=150)], {"p": PoolConfig(memory_budget_mb=100)})
    assert "memory_mb = 150 is above the memory_budget_mb = 100 of pool 'p'" in refusal
    assert pool_refusals([model(pool="p", memory_mb=100), model()], {"p": PoolConfig(memory_budget_mb=100)}) == []
