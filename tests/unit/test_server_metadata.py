"""The server metadata's extensions (api/oip_metadata.py `EXTENSIONS`): GET /v2 and gRPC ServerMetadata
read the one list, each edge naming only the Triton extensions it answers; every one named has its routes
(REST: in the OpenAPI document built from the routes' types) or its RPCs (gRPC: implemented, not the
generated servicer's UNIMPLEMENTED), and one not named has none."""

from __future__ import annotations

import asyncio

from inferd import __version__
from inferd.api import oip
from inferd.api.http import parse_priority
from inferd.api.oip_metadata import EXTENSIONS, GRPC, HTTP, server_metadata
from inferd.api.openapi import openapi_document
from inferd.api.repository import INDEX, LOAD, UNLOAD
from inferd.grpc_edge.codec import request_parameters
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.grpc_edge.services import InferenceService
from inferd.models.sim import sim_config
from inferd.routing.fairness import BULK, INTERACTIVE

RPCS = {
    "model_repository": ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
    "schedule_policy": ("ModelInfer", "ModelStreamInfer"),
    "model_configuration": ("ModelConfig",),
    "statistics": ("ModelStatistics",),
}
"""Triton's extensions and the RPCs that answer them."""


def implemented(rpc: str) -> bool:
    return getattr(InferenceService, rpc) is not getattr(pb_grpc.GRPCInferenceServiceServicer, rpc)


def test_each_edge_names_the_extensions_it_answers() -> None:
    assert server_metadata(HTTP) == {
        "name": "inferd",
        "version": __version__,
        "extensions": ["binary_tensor_data", "model_repository", "schedule_policy"],
    }
    assert server_metadata(GRPC)["extensions"] == [
        "model_repository", "schedule_policy", "model_configuration", "statistics"
    ]
    assert all(set(edges) <= {HTTP, GRPC} and edges for edges in EXTENSIONS.values())


def test_every_grpc_extension_named_has_its_rpcs_and_none_other_is_answered() -> None:
    named = server_metadata(GRPC)["extensions"]
    for extension in named:
        assert all(implemented(rpc) for rpc in RPCS[extension]), extension
    assert not implemented("SystemSharedMemoryStatus") and not implemented("CudaSharedMemoryRegister")
    assert not implemented("TraceSetting") and not implemented("LogSettings")


def test_every_rest_extension_named_has_its_routes() -> None:
    paths = openapi_document()["paths"]
    assert {INDEX, LOAD, UNLOAD} <= set(paths)  # model_repository
    assert not any(p.endswith(("/config", "/stats")) for p in paths)  # no model_configuration, statistics
    assert "model_configuration" not in server_metadata(HTTP)["extensions"]


def test_both_edges_read_the_schedule_policy_parameters_and_rest_the_binary_tensors() -> None:
    """schedule_policy: Triton's `priority` (levels: 2 and above are bulk here) and `timeout` (us)."""
    config = sim_config()
    body = b'{"parameters": {"priority": 2, "timeout": 5000}, "inputs": [{"name": "INPUT0", "shape": [1], '
    body += b'"datatype": "BYTES", "parameters": {"binary_data_size": 6}}]}'
    rest = oip.decode_request(body + b"\x02\x00\x00\x00hi", str(len(body)), config)  # binary_tensor_data
    assert (rest.priority, rest.timeout_us, rest.items) == (2, 5000.0, [b"hi"])
    assert parse_priority(rest.priority, None) == BULK and parse_priority(1, None) == INTERACTIVE
    message = pb.ModelInferRequest(model_name="sim")
    message.parameters["priority"].int64_param = 2
    message.parameters["timeout"].int64_param = 5000
    assert request_parameters(message) == (5000.0, 2)


def test_the_grpc_service_answers_its_metadata_from_the_list() -> None:
    service = InferenceService.__new__(InferenceService)  # _server_metadata reads nothing of the service
    reply = asyncio.run(service._server_metadata(None, pb.ServerMetadataRequest()))  # type: ignore[arg-type]
    assert reply.message == pb.ServerMetadataResponse(**server_metadata(GRPC))
    assert list(reply.message.extensions) == server_metadata(GRPC)["extensions"]
