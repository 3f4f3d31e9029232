"""inferd: an inference server that batches requests for black-box models."""

__version__ = "0.1.0"

from inferd.models.base import Model

__all__ = ["Model", "__version__"]
