"""Find and instantiate a model class from a ModelConfig's `implementation`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from inferd.config import ModelConfig
from inferd.models.base import Model


def load_model_class(implementation: str) -> type[Model]:
    """'package.module:Class' or '/path/to/model.py:Class'."""
    target, sep, cls_name = implementation.rpartition(":")
    if not sep or not cls_name:
        raise ValueError(
            f"implementation {implementation!r} must look like 'module:Class' or 'file.py:Class'"
        )
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"model file {path} does not exist")
        mod_name = f"inferd_user_model_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import model file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ValueError(f"{target} has no class {cls_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise ValueError(f"{implementation} is not a subclass of inferd.Model")
    return cls


def instantiate(config: ModelConfig) -> Model:
    return load_model_class(config.implementation)(config)
