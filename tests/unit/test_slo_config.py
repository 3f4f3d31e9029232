"""The per-model [slo] table: typed, validated at start with messages that say the fix, read from
model.toml and from [models.NAME.slo] of the --config file."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from inferd.cli.slo import configured_slos
from inferd.config import ConfigError, ModelConfig
from inferd.kinds.builtin import builtin_kinds
from inferd.observability.slo_config import Objective, SloConfig, model_slos

LLM = {"name": "chat", "kind": "llm", "implementation": "x:Y"}
BATCH = {
    "name": "sim",
    "implementation": "x:Y",
    "inputs": [{"name": "IN", "datatype": "FP32"}],
    "outputs": [{"name": "OUT", "datatype": "FP32"}],
}


def test_defaults_are_three_nines_and_99_percent_within_200_ms() -> None:
    assert SloConfig().objectives() == (
        Objective("availability", 0.999),
        Objective("latency", 0.99, 0.2),
    )


@pytest.mark.parametrize(
    ("table", "fix"),
    [
        ({"availability": 1.0}, "availability = 0.999"),
        ({"availability": 0.0}, "strictly between 0 and 1"),
        ({"latency_target": 1.5}, "latency_target = 0.99"),
        ({"latency_ms": 0}, "latency_ms = 0.0 must be a positive number of milliseconds"),
        ({"ttft_ms": -5}, "ttft_ms = -5.0 must be a positive"),
        ({"p99_ms": 100}, "p99_ms"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_fix(table: dict[str, float], fix: str) -> None:
    with pytest.raises(ValidationError, match=fix):
        SloConfig(**table)


def test_ttft_and_itl_are_refused_on_a_model_that_does_not_stream_tokens() -> None:
    kinds = builtin_kinds()
    with pytest.raises(ConfigError, match=r"ttft_ms and itl_ms apply to LLM models.*'batch'.*remove"):
        kinds.check(ModelConfig(**BATCH, slo={"ttft_ms": 300, "itl_ms": 40}))
    chat = ModelConfig(**LLM, slo={"latency_ms": 5000, "ttft_ms": 300, "itl_ms": 40})
    kinds.check(chat)
    assert chat.slo is not None
    assert [o.slo for o in chat.slo.objectives()] == ["availability", "latency", "ttft", "itl"]
    assert chat.slo.objectives()[2].threshold_s == pytest.approx(0.3)


def test_model_slos_keeps_the_models_that_set_a_table_with_the_highest_versions() -> None:
    models = [
        ModelConfig(**BATCH, version=1, slo={"latency_ms": 100}),
        ModelConfig(**BATCH, version=2, slo={"latency_ms": 150}),
        ModelConfig(**{**BATCH, "name": "plain"}),
    ]
    assert model_slos(models) == {"sim": SloConfig(latency_ms=150)}


def _repo(tmp_path: Path, slo: str) -> Path:
    folder = tmp_path / "repo" / "scale"
    (folder / "1").mkdir(parents=True)
    (folder / "model.toml").write_text(
        'builtin = "sim"\n' + slo + "\n",
    )
    return tmp_path / "repo"


def test_model_toml_sets_the_slo_and_the_config_file_overrides_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "[slo]\navailability = 0.99\nlatency_ms = 50\n")
    assert configured_slos(None, repo) == {"scale": SloConfig(availability=0.99, latency_ms=50)}
    config = tmp_path / "inferd.toml"
    config.write_text("[models.scale.slo]\navailability = 0.9995\n")
    assert configured_slos(config, repo) == {"scale": SloConfig(availability=0.9995)}


def test_a_bad_slo_in_the_config_file_is_a_config_error_naming_model_and_field(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "")
    config = tmp_path / "inferd.toml"
    config.write_text("[models.scale.slo]\navailability = 99.9\n")
    with pytest.raises(ConfigError, match=r"\[models.scale\] overrides: slo.availability: .*0.999"):
        configured_slos(config, repo)
