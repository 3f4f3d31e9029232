"""Fuzzing the config loaders: any config file (`inferd serve --config`) and any model folder (model.toml and
its version folders) either loads or raises ConfigError saying what is wrong; never another error."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.config import ConfigError, load_server_config
from inferd.kinds.repository import load_model_folder
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(90))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else "inf")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def to_toml(doc: dict[str, Any]) -> str:
    """Top-level scalars first, then one [table] per dict (nested dicts inline)."""
    lines = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for key, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(key)}]")
            lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


toml_text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)
leaf = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(),
    toml_text,
    st.sampled_from(["latest", "all", "sim", "sim-llm", "minilm", "openai-upstream", "batch", "llm", "FP32"]),
)
value = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(toml_text, inner, max_size=3),
    max_leaves=12,
)

SERVER_KEYS = [
    "port",
    "workers",
    "host",
    "max_body_bytes",
    "log_level",
    "admin_port",
    "worker_port",
    "models",
    "model_repo",
    "ray_address",
    "admin_token",
    "join_token",
    "heartbeat_timeout_s",
]
MODEL_KEYS = [
    "name",
    "builtin",
    "class",
    "kind",
    "platform",
    "version_policy",
    "default_version",
    "max_batch_size",
    "max_queue_size",
    "max_wait_ms",
    "workers",
    "inputs",
    "outputs",
    "params",
    "versions",
    "preferred_batch_sizes",
    "default_timeout_ms",
    "max_timeout_ms",
    "autoscale",
]


def tables(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.one_of(st.sampled_from(keys), toml_text), value, max_size=5)


server_docs = st.fixed_dictionaries(
    {},
    optional={
        "server": st.one_of(tables(SERVER_KEYS), value),
        "models": st.one_of(
            st.dictionaries(st.sampled_from(["sim", "x"]), tables(MODEL_KEYS), max_size=2), value
        ),
        "autoscaler": value,
        "extra": value,
    },
)


def load_server(text: str | bytes, environ: dict[str, str] | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inferd.toml"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        try:
            load_server_config(path, {}, environ or {})
        except ConfigError as exc:
            assert str(exc)


@fuzz()
@given(server_docs)
@example({"server": {"port": "x"}})
@example({"server": 5})  # type: ignore[dict-item]
@example({"server": [1, 2]})  # type: ignore[dict-item]
@example({"models": "sim"})  # type: ignore[dict-item]
def test_server_config_files_load_or_raise_config_error(doc: dict[str, Any]) -> None:
    load_server(to_toml(doc))


@fuzz()
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
@example(b"\xff\xfe[server]\n")
@example("[server]\nport = 8000\n[server]\n")
def test_raw_server_config_files_load_or_raise_config_error(text: str | bytes) -> None:
    load_server(text)


model_docs = tables(MODEL_KEYS)
folder_names = st.lists(
    st.sampled_from(["1", "2", "10", "0", "01", "x", "\u00b2", "\u0661", "99999999999999999999"]), max_size=3
)


def load_folder(toml: str | bytes, folders: list[str], with_code: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        model.mkdir()
        (model / "model.toml").write_bytes(toml.encode() if isinstance(toml, str) else toml)
        for name in folders:
            (model / name).mkdir(exist_ok=True)
            if with_code:
                (model / name / "model.py").write_text("")
        try:
            load_model_folder(model)
        except ConfigError as exc:
            assert str(exc)


@fuzz()
@given(model_docs, folder_names, st.booleans())
@example({"builtin": "sim", "versions": {"\u00b2": {}}}, [], False)
@example({"builtin": "sim"}, ["\u00b2"], False)
@example({"builtin": "sim", "version_policy": {"specific": ["x"]}}, [], False)
@example({"builtin": "sim", "version_policy": {"specific": [1.5]}}, [], False)
@example({"builtin": "sim", "versions": {"1": 5}}, [], False)
@example({"builtin": "sim", "params": 5}, [], False)
@example({"builtin": "sim", "name": 5}, [], False)
@example({"builtin": "sim", "version_policy": {"latest": True}}, [], False)
@example({"class": 5}, ["1"], True)
def test_model_folders_load_or_raise_config_error(
    doc: dict[str, Any], folders: list[str], with_code: bool
) -> None:
    load_folder(to_toml(doc), folders, with_code)


@fuzz(0.5)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)), folder_names)
@example(b"\xff", ["1"])
def test_raw_model_toml_loads_or_raises_config_error(text: str | bytes, folders: list[str]) -> None:
    load_folder(text, folders, True)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    path.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(ConfigError, match="cannot be read as UTF-8"):
        load_server_config(path, {}, {})


def test_server_and_models_that_are_not_tables_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    for text in ("server = 5\n", "server = [1]\n", 'models = "sim"\n'):
        path.write_text(text)
        with pytest.raises(ConfigError, match="must be a table"):
            load_server_config(path, {}, {})


def write_model(tmp_path: Path, toml: str | bytes, *folders: str) -> Path:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "model.toml").write_bytes(toml.encode() if isinstance(toml, str) else toml)
    for name in folders:
        (model / name).mkdir()
    return model


def test_a_model_toml_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read as UTF-8"):
        load_model_folder(write_model(tmp_path, b'builtin = "sim"\n\xff'))


def test_non_ascii_digits_are_no_version_numbers(tmp_path: Path) -> None:
    """'\u00b2'.isdigit() is true but int('\u00b2') raises: such folders are not versions, such
    [versions.N] keys are refused."""
    (config,) = load_model_folder(write_model(tmp_path, 'builtin = "sim"\n', "\u00b2"))
    assert config.version == 1
    with pytest.raises(ConfigError, match="whole version numbers"):
        load_model_folder(write_model(tmp_path, 'builtin = "sim"\n[versions."\u00b2"]\n'))


def test_specific_versions_must_be_whole_numbers(tmp_path: Path) -> None:
    for policy in ('["x"]', "[1.5]", "[true]"):
        folder = write_model(tmp_path, f'builtin = "sim"\nversion_policy = {{ specific = {policy} }}\n')
        with pytest.raises(ConfigError, match="version_policy must be"):
            load_model_folder(folder)
