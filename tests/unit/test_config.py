"""Configuration errors say how to fix them."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ConfigError, load_server_config
from inferd.kinds.repository import apply_overrides, load_model_folder, load_repository
from inferd.models.sim import sim_config

ROOT = Path(__file__).resolve().parents[2]


def test_repository_serves_highest_version(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    for v in ("1", "3", "2"):
        (folder / v).mkdir(parents=True)
        (folder / v / "model.py").write_text("")
    (folder / "model.toml").write_text(
        'max_batch_size = 4\n[[inputs]]\nname="I"\ndatatype="FP32"\n[[outputs]]\nname="O"\ndatatype="FP32"\n'
    )
    (cfg,) = load_model_folder(folder)
    assert cfg.version == 3 and cfg.implementation.endswith("3/model.py:Model")


def test_example_repository_loads() -> None:
    names = {m.name: m for m in load_repository(ROOT / "examples" / "model_repo")}
    assert set(names) == {"scale", "sim"}
    assert names["sim"].params["base_ms"] == 20.0


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("max_batch_size = 0\n", "max_batch_size"),
        ("max_batch_size = 10\nmax_queue_size = 5\n", "raise max_queue_size"),
        ("preferred_batch_sizes = [500]\n", "lower it or raise max_batch_size"),
        ("default_timeout_ms = -1\n", "default_timeout_ms"),
        ("workers = -1\n", "workers"),
        ("max_wait_ms = 'soon'\n", "max_wait_ms"),
    ],
)
def test_bad_model_config_is_refused_with_a_fix(tmp_path: Path, toml: str, message: str) -> None:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text("")
    (folder / "model.toml").write_text(
        toml + '[[inputs]]\nname="I"\ndatatype="FP32"\n[[outputs]]\nname="O"\ndatatype="FP32"\n'
    )
    with pytest.raises(ConfigError, match=message):
        load_model_folder(folder)


def test_missing_pieces_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a folder"):
        load_repository(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"has no model\.toml"):
        load_repository(tmp_path)


def test_server_config_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(
        "[server]\nport = 9000\nworkers = 2\n[models.sim]\nmax_wait_ms = 30\n[models.sim.params]\nbase_ms = 5\n"
    )
    cfg = load_server_config(path, {"port": 9100, "host": None})
    assert cfg.port == 9100 and cfg.workers == 2
    (sim,) = apply_overrides([sim_config()], cfg.model_overrides)
    assert sim.max_wait_ms == 30 and sim.params["base_ms"] == 5 and sim.params["per_item_ms"] == 0.1
    path.write_text("[server]\nworkers = -1\n")
    with pytest.raises(ConfigError, match="workers"):
        load_server_config(path, {})
    with pytest.raises(ConfigError, match="unknown models"):
        apply_overrides([sim_config()], {"nope": {"max_wait_ms": 1}})


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[server]\nretry_budget_ratio = 5\n", "retry_budget_ratio"),
        ("[server]\nheartbeat_timeout_s = -1\n", "heartbeat_timeout_s"),
        ("[server]\nworkers = 100000\n", "workers"),
        ("[server]\nadmin_token = 'x'\n", "INFERD_ADMIN_TOKEN"),
    ],
)
def test_absurd_server_settings_are_refused(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(table)
    with pytest.raises(ConfigError, match=message):
        load_server_config(path, {}, environ={})


def test_absurd_model_timeouts_are_refused() -> None:
    with pytest.raises(ConfigError, match="batch_timeout_s"):
        apply_overrides([sim_config()], {"sim": {"batch_timeout_s": -3}})
    with pytest.raises(ConfigError, match="max_attempts"):
        apply_overrides([sim_config()], {"sim": {"max_attempts": 1000}})


def test_admin_token_comes_from_the_environment() -> None:
    cfg = load_server_config(None, {}, environ={"INFERD_ADMIN_TOKEN": "s3cret"})
    assert cfg.admin_token is not None and cfg.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in cfg.model_dump_json()
