"""The model API.

A model is a class with a load step and a batch function::

    class Model(inferd.Model):
        def load(self) -> None:
            self.weights = ...

        def predict_batch(self, inputs: list) -> list:   # or `async def`
            return [f(x) for x in inputs]

`predict_batch` gets one entry per batch item and must return exactly one output per item, in order.
An item is what one row of the request's tensors holds (the batch dimension is the first dimension
of every input tensor, as in Triton):

* a model with one input gets the bare value; a model with several gets a dict {input name: value};
* a scalar item (per-item shape ``()``) is a Python value: ``bytes`` for BYTES, ``int``/``float``/``bool``
  for numbers; other shapes are numpy arrays (object arrays of ``bytes`` for BYTES);
* a model with one output returns bare values; with several, a dict {output name: value} per item.
  Outputs are converted to the declared datatype and checked against the declared per-item shape.

Sync `predict_batch` runs in a worker thread, so the worker keeps answering heartbeats; async runs on
the worker's event loop. Models run in worker processes, one process per device.
"""

from __future__ import annotations

from typing import Any

from inferd.config import ModelConfig


class Model:
    """Base class of every served model."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def load(self) -> None:
        """Load weights. Runs once in the worker process before it takes traffic."""

    def predict_batch(self, inputs: list[Any]) -> list[Any]:
        """Run one batch; return one output per input, in order. May be `async def`."""
        raise NotImplementedError(f"{type(self).__name__} must implement predict_batch")

    def unload(self) -> None:
        """Free what `load` took (device memory, caches). Runs once, in the worker's device thread, when a
        pool worker evicts or unloads the model; the worker then drops the object and collects. A model
        whose memory is plain Python objects needs nothing here."""

    def warmup_inputs(self) -> list[Any]:
        """Items run once after load, before the worker takes traffic. Empty: no warm-up."""
        return []
