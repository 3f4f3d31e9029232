"""Components register their own config tables, validated by their own models."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from inferd.config import TABLES, ConfigError, load_server_config, register_table


class GatewaySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_keys: int = Field(default=10, ge=1)


@pytest.fixture
def gateway_table():
    register_table("test_gateway", GatewaySettings)
    yield
    del TABLES["test_gateway"]


def test_a_registered_table_is_validated_and_read_back(tmp_path: Path, gateway_table: None) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text("[server]\nport = 9000\n[test_gateway]\nmax_keys = 3\n")
    config = load_server_config(path, {}, environ={})
    assert config.table("test_gateway") == GatewaySettings(max_keys=3)
    path.write_text("[test_gateway]\nmax_keys = 0\n")
    with pytest.raises(ConfigError, match=r"\[test_gateway\] table: max_keys"):
        load_server_config(path, {}, environ={})


def test_an_absent_table_gives_the_component_its_defaults(tmp_path: Path, gateway_table: None) -> None:
    assert load_server_config(None, {}, environ={}).table("test_gateway") == GatewaySettings()


def test_an_unknown_table_is_refused_naming_the_known_ones(tmp_path: Path, gateway_table: None) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text("[gatewya]\nmax_keys = 3\n")
    with pytest.raises(ConfigError, match=r"unknown tables \['gatewya'\].*\[test_gateway\]"):
        load_server_config(path, {}, environ={})


def test_a_table_name_is_taken_once(gateway_table: None) -> None:
    with pytest.raises(ValueError, match="already taken"):
        register_table("test_gateway", BaseModel)
    with pytest.raises(ValueError, match="already taken"):
        register_table("server", GatewaySettings)
