"""OIP metadata: the server's (GET /v2 and gRPC ServerMetadata: name, version, and the protocol
extensions the edge asked answers, in Triton's names) and a model's (GET /v2/models/{model}, with the
model's kind and its served versions)."""

from __future__ import annotations

from typing import Any

from inferd import __version__
from inferd.config import ModelConfig

HTTP, GRPC = "http", "grpc"

EXTENSIONS: dict[str, tuple[str, ...]] = {
    "binary_tensor_data": (HTTP,),  # tensors as raw bytes after the JSON (api/binary.py); gRPC's raw_*_contents are the protocol's own
    "model_repository": (HTTP, GRPC),  # POST /v2/repository/index, .../models/{m}/load|unload; RepositoryIndex, RepositoryModelLoad|Unload
    "schedule_policy": (HTTP, GRPC),  # parameters.priority (Triton's levels: 0 and 1 interactive, 2 and above bulk) and parameters.timeout (us)
    "model_configuration": (GRPC,),  # ModelConfig (grpc_edge/model_config.py); REST has no /config route
    "statistics": (GRPC,),  # ModelStatistics; REST has no /stats route (/metrics instead)
}
"""Triton's protocol extensions inferd implements, and the edges that answer each: the one list both
GET /v2 and gRPC ServerMetadata read (`server_metadata`). Not implemented: classification, sequence,
shared memory (its RPCs answer UNIMPLEMENTED), trace, logging, parameters (custom ones reach no model)."""


def server_metadata(edge: str) -> dict[str, Any]:
    """The server's metadata as `edge` (HTTP, GRPC) answers it: the extensions it implements."""
    return {"name": "inferd", "version": __version__, "extensions": [e for e, on in EXTENSIONS.items() if edge in on]}


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
