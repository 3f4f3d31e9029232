"""The model API users implement, and the built-in models."""

from inferd.models.base import Model

__all__ = ["Model"]
