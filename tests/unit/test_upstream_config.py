"""openai-upstream models in the model repository: what a model.toml may say, and the API key taken from
the environment at load (never from the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config import ConfigError
from inferd.kinds.repository import load_model_folder
from inferd.kinds.upstream.runtime import UpstreamConfig, is_upstream, openai_upstream_config


def write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(text)
    return folder


def test_platform_key_makes_an_upstream_model_without_workers(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "big",
        'platform = "openai_upstream"\n[params]\nupstreams = ["http://gpu-1:8000/v1/"]\n'
        'upstream_model = "meta-llama/Llama-3.1-8B-Instruct"\n',
    )
    (config,) = load_model_folder(folder)
    assert is_upstream(config) and config.name == "big" and config.workers == 0
    settings = UpstreamConfig.model_validate(config.params)
    assert settings.upstreams == ("http://gpu-1:8000/v1",)
    assert settings.upstream_model == "meta-llama/Llama-3.1-8B-Instruct"


def test_builtin_key_works_too(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", 'builtin = "openai-upstream"\n[params]\nupstreams = ["http://a:1/v1"]\n')
    assert is_upstream(load_model_folder(folder)[0])


def test_api_key_comes_from_the_named_variable_and_is_never_logged() -> None:
    config = openai_upstream_config(
        "m", {"MY_KEY": "s3cret"}, params={"upstreams": ["http://a:1/v1"], "api_key_env": "MY_KEY"}
    )
    settings = UpstreamConfig.model_validate(config.params)
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in config.model_dump_json()


def test_missing_key_variable_says_which_to_set() -> None:
    with pytest.raises(ConfigError, match="'MY_KEY', which is not set"):
        openai_upstream_config("m", {}, params={"upstreams": ["http://a:1/v1"], "api_key_env": "MY_KEY"})


def test_a_key_written_in_the_file_is_refused(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "m",
        'builtin = "openai-upstream"\n[params]\nupstreams = ["http://a:1/v1"]\napi_key = "oops"\n',
    )
    with pytest.raises(ConfigError, match="api_key_env"):
        load_model_folder(folder)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"upstreams": []}, "upstreams"),
        ({"upstreams": ["gpu-1:8000/v1"]}, "not an http"),
        ({"upstreams": ["http://a/v1", "http://a/v1/"]}, "listed twice"),
        ({"upstreams": ["http://a/v1"], "base_ejection_s": 9, "max_ejection_s": 3}, "lower base_ejection_s"),
        ({"upstreams": ["http://a/v1"], "max_inflight": 3}, "max_inflight"),
    ],
)
def test_bad_params_are_config_errors_that_name_the_problem(params: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        openai_upstream_config("m", {}, params=params)
