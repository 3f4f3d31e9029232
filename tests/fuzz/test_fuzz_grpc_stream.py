"""Fuzzing ModelStreamInfer end to end in-process: the gRPC edge's inference service over the whole front
end (sim and sim-llm, no workers: whatever gets past the checks is answered UNAVAILABLE), fed streams of
arbitrary requests (batch and LLM tensors, unknown models, bad parameters). Every request gets exactly
one last response carrying its id; errors are error responses naming a status, never a crash; the stream
goes on after each. The named cases: an LLM request without text_input, bad sampling_parameters JSON, a
stream request for an unknown model."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc import aio
from hypothesis import given
from hypothesis import strategies as st

from inferd.api.app import Api
from inferd.api.binary import encode_bytes_elements
from inferd.config import ServerConfig
from inferd.grpc_edge.edge import grpc_layers
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.grpc_edge.services import InferenceService
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.models.sim import sim_config
from inferd.server import InferenceServer
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(90))

CODES = {
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "UNAVAILABLE",
    "RESOURCE_EXHAUSTED",
    "DEADLINE_EXCEEDED",
}
"""The statuses a request of these streams may get (no workers: UNAVAILABLE past the checks)."""
ERROR = re.compile(r"^\[StatusCode\.([A-Z_]+)\] .+ \(request '(r\d+)'\)$", re.S)


class InProcess:
    """The inference service on a loop of its own thread, over a server with no workers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        config = ServerConfig(admin_port=None, workers=0, grpc_stream_max_in_flight=8)
        server = InferenceServer(config, [sim_config(), sim_llm_config()], spawn_workers=False)
        api = Api(server)
        self.server = aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(api, grpc_layers(api)), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    service = InProcess()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()
        service.stop()


def tensor(name: str, datatype: str, value: bytes | bool, shape: list[int] | None = None) -> tuple[Any, bytes]:
    raw = bytes([value]) if isinstance(value, bool) else encode_bytes_elements([value])
    return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape or [1]), raw


leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(), st.text(max_size=5))
sampling = st.one_of(
    st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "seed", "stop", "n", "top_k", "?"]), leaf, max_size=4).map(
        lambda d: json.dumps(d).encode()
    ),
    st.binary(max_size=16),
)


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    model = draw(st.sampled_from(["sim", "sim-llm", "nope", ""]))
    tensors = []
    if draw(st.booleans()):
        tensors.append(tensor("INPUT0", "BYTES", draw(st.binary(max_size=8))))
    if draw(st.booleans()):
        tensors.append(tensor("text_input", draw(st.sampled_from(["BYTES", "BOOL"])), draw(st.binary(max_size=8))))
    if draw(st.booleans()):
        tensors.append(tensor("stream", "BOOL", draw(st.booleans()), draw(st.sampled_from([[1], [2], [10**12]]))))
    if draw(st.booleans()):
        tensors.append(tensor("sampling_parameters", "BYTES", draw(sampling)))
    request = pb.ModelInferRequest(model_name=model)
    for inp, raw in draw(st.permutations(tensors)):
        request.inputs.append(inp)
        request.raw_input_contents.append(raw)
    if draw(st.booleans()):
        request.parameters["timeout"].CopyFrom(
            draw(st.sampled_from([pb.InferParameter(int64_param=-1), pb.InferParameter(string_param="x")]))
        )
    return request


def run_stream(stub: pb_grpc.GRPCInferenceServiceStub, batch: list[pb.ModelInferRequest]) -> list[Any]:
    for i, request in enumerate(batch):
        request.id = f"r{i}"
    return list(stub.ModelStreamInfer(iter(batch), timeout=20))


def check(batch: list[pb.ModelInferRequest], responses: list[Any]) -> dict[str, str]:
    """Every request's one last response, by id: "" for an answer, the status of an error."""
    last: dict[str, str] = {}
    for response in responses:
        answer = response.infer_response
        rid = answer.id
        assert rid not in last, f"a response after request {rid!r}'s last one"
        if response.error_message:
            found = ERROR.match(response.error_message)
            assert found is not None and found.group(2) == rid, response.error_message
            assert found.group(1) in CODES, response.error_message
            status = found.group(1)
        else:
            status = ""
        if answer.parameters["triton_final_response"].bool_param:
            last[rid] = status
    assert sorted(last) == sorted(r.id for r in batch)
    return last


@fuzz(0.1)
@given(st.lists(requests(), min_size=1, max_size=6))
def test_any_requests_on_a_stream_get_one_last_response_each(
    stub: pb_grpc.GRPCInferenceServiceStub, batch: list[pb.ModelInferRequest]
) -> None:
    check(batch, run_stream(stub, batch))


def test_the_named_cases_get_their_status_and_the_stream_goes_on(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    no_text = pb.ModelInferRequest(model_name="sim-llm")
    inp, raw = tensor("stream", "BOOL", True)
    no_text.inputs.append(inp)
    no_text.raw_input_contents.append(raw)
    bad_json = pb.ModelInferRequest(model_name="sim-llm")
    for inp, raw in (tensor("text_input", "BYTES", b"hi"), tensor("sampling_parameters", "BYTES", b"{oops")):
        bad_json.inputs.append(inp)
        bad_json.raw_input_contents.append(raw)
    unknown = pb.ModelInferRequest(model_name="nope")
    inp, raw = tensor("INPUT0", "BYTES", b"x")
    unknown.inputs.append(inp)
    unknown.raw_input_contents.append(raw)
    batch = [no_text, bad_json, unknown]
    responses = run_stream(stub, batch)
    assert check(batch, responses) == {"r0": "INVALID_ARGUMENT", "r1": "INVALID_ARGUMENT", "r2": "NOT_FOUND"}
    messages = {r.infer_response.id: r.error_message for r in responses}
    assert "input 'text_input' is missing" in messages["r0"]
    assert "input 'sampling_parameters': malformed JSON" in messages["r1"]
    assert "unknown model 'nope'" in messages["r2"]
