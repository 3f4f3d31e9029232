"""A reload of the config file's [models.NAME.traffic] and [models.NAME.cache] tables
(gateway/model_reload.py through `Gateway.reload`), over a real ModelRegistry, `Traffic` and
`CacheHook` on one FakeClock: what changes live, what a refused file leaves alone, and what waits for
a restart."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from inferd.api.cache_hook import CacheHook
from inferd.clock import FakeClock
from inferd.config import ConfigError, ModelConfig, TensorSpec, load_server_config
from inferd.config.cache import CacheConfig
from inferd.gateway.cache import ResponseCache, request_key
from inferd.gateway.keys import key_digest, new_key
from inferd.gateway.model_reload import ModelSettings
from inferd.gateway.reload import Gateway
from inferd.gateway.traffic_control import Traffic
from inferd.kinds.builtin import builtin_kinds
from inferd.observability.cache_metrics import CacheMetrics
from inferd.observability.traffic_metrics import TrafficMetrics
from inferd.runtime.registry import ModelRegistry

KEY = new_key()
TENANT = f'[tenants.acme]\napi_key_sha256 = ["{key_digest(KEY)}"]\n'
START = (
    "[models.sim]\nmax_wait_ms = 5\n"
    "traffic = { canary = { version = 2, weight = 0.1, steps = [0.1, 0.5], step_interval_s = 60 } }\n"
    "cache = { enabled = true, ttl_s = 60 }\n"
)


@dataclass
class Served:
    """What the registry, Traffic, the cache hook and the reload read and write of a runtime."""

    config: ModelConfig
    kind: str = "batch"

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> int:
        return self.config.version


def own(name: str, version: int) -> ModelConfig:
    """The model's own settings (its model.toml): no traffic table, no cache."""
    return ModelConfig(
        name=name,
        version=version,
        implementation="inferd.models.sim:SimModel",
        version_policy="all",
        default_version=1,
        inputs=[TensorSpec(name="x", datatype="FP32", shape=(1,))],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=(1,))],
    )


class World:
    def __init__(self, tmp_path: Path, file: str = START) -> None:
        self.path = tmp_path / "inferd.toml"
        self.path.write_text(TENANT + file)
        config = load_server_config(self.path, {}, environ={})
        self.clock = FakeClock()
        self.registry = ModelRegistry()
        for version in (1, 2):
            base = own("sim", version).model_dump()
            self.registry.add(Served(ModelConfig(**{**base, **config.model_overrides["sim"]})))  # type: ignore[arg-type]
        self.prom = CollectorRegistry()
        self.traffic = Traffic(
            self.registry, self.clock, TrafficMetrics(self.prom), random.Random(1), lambda: 7.0
        )
        self.cache = CacheHook(self.registry, CacheMetrics(self.prom), self.clock)
        models = ModelSettings(
            self.registry, self.traffic, self.cache, config.model_overrides, own, builtin_kinds()
        )
        self.gateway = Gateway(config, self.registry.names, lambda: 0.0, models=models)

    def reload(self, file: str, tenants: str = TENANT) -> dict[str, Any]:
        self.path.write_text(tenants + file)
        return self.gateway.reload()

    def store(self, version: int = 1) -> ResponseCache[Any]:
        return self.cache.store_for(self.registry.get("sim", version))

    def weight(self, version: int) -> float | None:
        return self.prom.get_sample_value("inferd_traffic_weight", {"model": "sim", "version": str(version)})


def put(store: ResponseCache[Any], text: str) -> None:
    store.store(request_key("", "sim", 1, text), text, 10)


def held(store: ResponseCache[Any], text: str) -> Any:
    return store.lookup(request_key("", "sim", 1, text))


def test_a_reload_changes_the_canary_weight_and_the_cache_ttl_on_the_next_requests(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.clock.advance(60.0)
    w.traffic.choose("sim", None, lambda _: None)  # the canary moves to its second step
    assert w.traffic.statistics().splits[0].step == 1 and w.weight(2) == 0.5
    put(w.store(), "old")
    w.clock.advance(20.0)
    put(w.store(), "new")

    answer = w.reload(
        "[models.sim]\nmax_wait_ms = 5\n"
        "traffic = { canary = { version = 2, steps = [0.3, 0.6], step_interval_s = 60 } }\n"
        "cache = { enabled = true, ttl_s = 15 }\n"
    )

    assert answer["changed"]["traffic"] == {"sim": "canary split replaced: v1 0.7, v2 0.3, steps restart"}
    assert (
        answer["changed"]["cache"]["sim:1"].startswith("on, ttl_s 15")
        and "1 answers dropped" in answer["changed"]["cache"]["sim:1"]
    )
    assert answer["changed"]["needs_restart"] == [] and answer["changed"]["tenants"]["changed"] == []
    (split,) = w.traffic.statistics().splits
    assert (split.step, split.weights, split.state) == (0, {1: 0.7, 2: 0.3}, "active")
    assert w.weight(2) == 0.3
    assert w.registry.get("sim", 2).config.traffic.canary.steps == (0.3, 0.6)  # type: ignore[union-attr]
    # "old" was computed 20 s ago: past the new 15 s ttl; "new" has 15 s left, then goes
    assert held(w.store(), "old") is None and held(w.store(), "new") == "new"
    w.clock.advance(15.0)
    assert held(w.store(), "new") is None
    put(w.store(), "later")
    w.clock.advance(14.0)
    assert held(w.store(), "later") == "later"
    (event,) = w.traffic.statistics().history[-1:]
    assert (event.event, event.version, event.at) == ("reloaded", 2, 7.0)


@pytest.mark.parametrize(
    ("file", "error"),
    [
        (
            '[models.sim]\ntraffic = { ab = { arms = { "1" = 0.5, "2" = 0.4 } } }\n',
            "must be non-negative shares that sum to 1",
        ),
        ("[models.sim]\ntraffic = { canary = { version = 3 } }\n", r"canary version 3 is not served"),
        ("[models.sim]\ntraffic = { shadow = { version = 7 } }\n", r"shadow version 7 is not served"),
        ('[models.sim]\ntraffic = { fallback = "nope" }\n', "nope"),
        ("[models.nope]\nmax_wait_ms = 1\n", r"unknown models \['nope'\]; served: \['sim'\]"),
        ("[models.sim]\ncache = { enabled = true, ttl_s = -1 }\n", "cache.ttl_s"),
        ("[models.sim]\ncache = { enabled = true, ttl = 5 }\n", "cache.ttl"),
    ],
)
def test_a_bad_models_table_refuses_the_whole_file_and_nothing_changes(
    tmp_path: Path, file: str, error: str
) -> None:
    w = World(tmp_path)
    put(w.store(), "kept")
    configs = [rt.config for rt in w.registry]
    split = w.traffic.splits["sim"]
    gate = w.gateway.current()
    with pytest.raises(ConfigError, match=error):
        w.reload(file, tenants="[tenants.other]\napi_key_sha256 = []\n")  # a valid tenant change, refused too
    assert [rt.config for rt in w.registry] == configs and all(
        a is b for a, b in zip([rt.config for rt in w.registry], configs, strict=True)
    )
    assert w.traffic.splits["sim"] is split and w.weight(2) == 0.1
    assert w.gateway.current() is gate
    assert held(w.store(), "kept") == "kept"


def test_an_unchanged_traffic_table_keeps_a_rolled_back_canary_and_a_changed_one_restarts_it(
    tmp_path: Path,
) -> None:
    rollback = (
        "rollback = { max_error_ratio = 0.1, short_window_s = 10, long_window_s = 30, min_requests = 10 }"
    )
    file = f"[models.sim]\n[models.sim.traffic]\ncanary = {{ version = 2, weight = 0.5 }}\n{rollback}\n"
    w = World(tmp_path, file)
    v1, v2 = w.registry.get("sim", 1), w.registry.get("sim", 2)
    for _ in range(40):
        w.clock.advance(1.0)
        w.traffic.observe(v1, "ok", 0.01)
        w.traffic.observe(v2, "model_error", 0.01)
    assert w.traffic.statistics().splits[0].state == "rolled_back"

    same = w.reload(file + "shadow = { version = 2 }\n")  # only the shadow changed
    assert same["changed"]["traffic"] == {"sim": "split unchanged (shadow or fallback changed)"}
    assert w.traffic.statistics().splits[0].state == "rolled_back"
    assert w.registry.get("sim").config.traffic.shadow is not None  # read per request by the shadows
    history = [e.event for e in w.traffic.statistics().history]

    w.reload(file.replace("weight = 0.5", "weight = 0.2"))
    (split,) = w.traffic.statistics().splits
    assert (split.state, split.weights) == ("active", {1: 0.8, 2: 0.2})
    assert [e.event for e in w.traffic.statistics().history] == [*history, "reloaded"]  # history kept


def test_turning_the_cache_off_drops_the_models_answers(tmp_path: Path) -> None:
    w = World(tmp_path)
    put(w.store(), "a")
    put(w.store(), "b")
    answer = w.reload("[models.sim]\nmax_wait_ms = 5\ncache = { enabled = false }\n")
    assert answer["changed"]["cache"] == {
        "sim:1": "off (2 answers dropped)",
        "sim:2": "off (0 answers dropped)",
    }
    assert not w.registry.get("sim", 1).config.cache.enabled
    assert w.cache.statistics() == ()  # no store holds an answer of sim any more
    # the traffic table left the file: the model's own setting (none) is back, and the split is gone
    assert answer["changed"]["traffic"] == {
        "sim": "split removed: unversioned requests go to the default version"
    }
    assert w.traffic.statistics().splits == () and w.weight(2) == 0.0 and w.weight(1) == 1.0


def test_smaller_bounds_evict_the_least_recently_used() -> None:
    clock = FakeClock()
    store: ResponseCache[Any] = ResponseCache(CacheConfig(enabled=True), clock)
    for text in ("a", "b", "c"):
        put(store, text)
    held(store, "a")  # now the most recently used
    assert store.reconfigure(CacheConfig(enabled=True, max_entries=2)) == 1
    assert held(store, "b") is None and held(store, "a") == "a" and held(store, "c") == "c"


def test_settings_that_need_a_restart_are_reported_and_not_applied(tmp_path: Path) -> None:
    w = World(tmp_path)
    before = w.registry.get("sim", 1).config
    answer = w.reload(START.replace("max_wait_ms = 5", "max_wait_ms = 50\nworkers = 3"))
    assert answer["changed"]["needs_restart"] == ["models.sim.max_wait_ms", "models.sim.workers"]
    assert answer["changed"]["traffic"] == {} and answer["changed"]["cache"] == {}
    assert w.registry.get("sim", 1).config is before and before.max_wait_ms == 5
    again = w.reload(START.replace("max_wait_ms = 5", "max_wait_ms = 50\nworkers = 3"))
    assert again["changed"]["needs_restart"] == [
        "models.sim.max_wait_ms",
        "models.sim.workers",
    ]  # still waiting
    assert w.reload(START)["changed"]["needs_restart"] == []  # back to what runs
