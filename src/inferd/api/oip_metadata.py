"""OIP model metadata (GET /v2/models/{model}), with the model's kind and its served versions."""

from __future__ import annotations

from typing import Any

from inferd.config import ModelConfig


def model_metadata(config: ModelConfig, versions: list[int], tensors: bool) -> dict[str, Any]:
    """OIP model metadata, plus the model's kind. Only a kind served by OIP (`tensors`: batch) has
    tensors: LLM and upstream models are served by the OpenAI routes."""
    meta: dict[str, Any] = {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": config.platform,
        "kind": config.kind,
    }
    if not tensors:
        return meta
    return {
        **meta,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in config.inputs],
        "outputs": [
            {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in config.outputs
        ],
        "parameters": {
            "max_batch_size": config.max_batch_size,
            "max_wait_ms": config.max_wait_ms,
            "max_queue_size": config.max_queue_size,
            "idempotent": config.idempotent,
        },
    }
