"""The gRPC edge's pure parts, without a server: the error table and its layer, the reading of a call's
metadata and deadline, the deadline rule with a wire deadline, the codec's typed contents and answers,
the reply, the model config, and health."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Counter

from inferd.api.http import request_deadline
from inferd.api.middleware import Accounting
from inferd.api.oip_answer import Inference
from inferd.api.oip_tensors import DecodedRequest
from inferd.clock import FakeClock
from inferd.config import ModelConfig, ServerConfig, TensorSpec
from inferd.config.tenants import TenantConfig
from inferd.core.call import Call
from inferd.core.tenant import Tenant
from inferd.errors import (
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    Forbidden,
    ModelError,
    NotFound,
    Overloaded,
    RateLimited,
    ServingError,
    ShuttingDown,
    Unauthorized,
    WorkerUnavailable,
)
from inferd.gateway.auth import TenantRequests
from inferd.grpc_edge.calls import RpcMetadata, grpc_call, read_hints
from inferd.grpc_edge.codec import decode_request, encode_response
from inferd.grpc_edge.edge import server_options
from inferd.grpc_edge.errors import GrpcErrors, code_of
from inferd.grpc_edge.health import NOT_SERVING, SERVING, Health
from inferd.grpc_edge.model_config import model_config
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.reply import GrpcReply
from inferd.observability.metrics import Metrics
from inferd.routing.fairness import BULK

Code = grpc.StatusCode
Tensor = pb.ModelInferRequest.InferInputTensor
ROUTE = "/inference.GRPCInferenceService/ModelInfer"


class Context:
    """The little of grpc.aio's ServicerContext that reading a call and sending a reply use."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), remaining_s: float | None = None) -> None:
        self.metadata = metadata
        self.remaining_s = remaining_s
        self.trailers: Any = None
        self.aborted: Any = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return self.remaining_s

    def set_trailing_metadata(self, trailers: Any) -> None:
        self.trailers = trailers

    async def abort(self, code: Code, details: str, trailers: Any) -> None:
        self.aborted = (code, details, trailers)
        raise RuntimeError("aborted")  # grpc.aio's abort raises too


def read(metadata: dict[str, str], remaining_s: float | None = None, keys: bool = False) -> Call:
    context = Context(tuple(metadata.items()), remaining_s)
    found = RpcMetadata(context.invocation_metadata())
    call = grpc_call(context, found, ROUTE, "sim", "2", keys)  # type: ignore[arg-type]
    read_hints(call, found, context, FakeClock(100.0), keys)  # type: ignore[arg-type]
    return call


# ---- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (BadRequest("b"), Code.INVALID_ARGUMENT),
        (Unauthorized("u"), Code.UNAUTHENTICATED),
        (Forbidden("f"), Code.PERMISSION_DENIED),
        (NotFound("n"), Code.NOT_FOUND),
        (RateLimited("r", 2.0), Code.RESOURCE_EXHAUSTED),
        (Overloaded("o", 1.0), Code.RESOURCE_EXHAUSTED),
        (Overloaded("cannot meet the deadline", 1.0, reason="deadline"), Code.DEADLINE_EXCEEDED),
        (WorkerUnavailable("w"), Code.UNAVAILABLE),
        (ShuttingDown("s"), Code.UNAVAILABLE),
        (DeadlineExceeded("d"), Code.DEADLINE_EXCEEDED),
        (ModelError("m"), Code.INTERNAL),
        (ServingError("x"), Code.INTERNAL),
    ],
)
def test_each_error_has_its_status_code(exc: ServingError, code: Code) -> None:
    assert code_of(exc) == code


async def answer_with(exc: BaseException) -> tuple[Call, GrpcReply]:
    async def handler(call: Call, request: object) -> GrpcReply:
        raise exc

    call = read({})
    return call, await GrpcErrors(handler)(call, None)


async def test_a_refusal_carries_the_rest_twins_message_outcome_and_retry_after() -> None:
    call, reply = await answer_with(Overloaded("model 'sim' queue is full", 2.5))
    assert (reply.code, reply.details, reply.status) == (Code.RESOURCE_EXHAUSTED, "model 'sim' queue is full", 429)
    assert reply.header(b"retry-after") == b"3" and reply.header(b"x-inferd-retry-after-ms") == b"2500"
    assert call.outcome == "rejected" and call.notes["rejected"] == "queue_full"


async def test_an_unauthenticated_call_gets_www_authenticate_and_a_gone_caller_cancelled() -> None:
    call, reply = await answer_with(Unauthorized("an API key is required"))
    assert reply.code == Code.UNAUTHENTICATED and reply.header(b"www-authenticate") == b"Bearer"
    assert call.outcome == "unauthorized"
    call, reply = await answer_with(ClientGone())
    assert (reply.code, reply.status, call.outcome) == (Code.CANCELLED, 499, "cancelled")


async def test_an_unexpected_error_is_internal_with_an_id_and_no_traceback() -> None:
    call, reply = await answer_with(KeyError("secret detail"))
    assert reply.code == Code.INTERNAL and reply.status == 500
    assert reply.details.startswith("internal error (id ") and "secret" not in reply.details
    assert call.outcome == "internal"


# ---- reading a call -----------------------------------------------------------------------------------
def test_the_call_reads_ids_trace_context_and_is_labelled_grpc() -> None:
    call = read({"x-request-id": "req-7", "traceparent": "00-aa-bb-01", "tracestate": "k=v", "user-agent": "x"})
    assert (call.protocol, call.route, call.model, call.version) == ("grpc", ROUTE, "sim", "2")
    assert (call.request_id, call.traceparent, call.tracestate) == ("req-7", "00-aa-bb-01", "k=v")
    assert call.credential is None and call.deadline is None
    assert read({"x-request-id": "bad id!"}).request_id != "bad id!"


def test_the_key_is_a_bearer_credential_else_x_api_key_and_read_only_with_tenants() -> None:
    assert read({"authorization": "Bearer  k1 "}, keys=True).credential == "k1"
    assert read({"x-api-key": "k2"}, keys=True).credential == "k2"
    assert read({"authorization": "Basic zz", "x-api-key": "k3"}, keys=True).credential == "k3"
    assert read({"x-api-key": "k2"}, keys=False).credential is None


def test_hints_are_read_as_http_reads_them() -> None:
    call = read({"x-priority": "bulk", "x-request-timeout-ms": "250", "x-tenant": "team-a"})
    assert (call.priority, call.timeout_ms, call.tenant.name) == (BULK, 250.0, "team-a")
    assert read({"x-tenant": "team-a"}, keys=True).tenant.anonymous  # the key names the tenant
    with pytest.raises(BadRequest, match="X-Request-Timeout-Ms must be a number"):
        read({"x-request-timeout-ms": "soon"})
    with pytest.raises(BadRequest, match="priority 'urgent'"):
        read({"x-priority": "urgent"})


def test_the_grpc_deadline_becomes_the_calls_and_one_past_is_refused() -> None:
    assert read({}, remaining_s=1.5).deadline == pytest.approx(101.5)
    with pytest.raises(DeadlineExceeded):
        read({}, remaining_s=0.0)


def test_metadata_other_than_the_edges_is_looked_up_as_sent() -> None:
    metadata = RpcMetadata((("x-cohort", "a"), ("x-cohort", "b"), ("x-api-key", "k")))
    assert metadata.get(b"x-cohort") == "b"  # the last one wins, as with HTTP headers
    assert metadata.get(b"x-api-key") == "k" and metadata.get(b"absent") is None
    assert RpcMetadata(None).get(b"x-cohort") is None


# ---- the deadline rule --------------------------------------------------------------------------------
def test_a_wire_deadline_bounds_the_others_replaces_the_default_and_is_cut_to_the_maximum() -> None:
    clock = FakeClock(10.0)
    assert request_deadline(clock, 60_000, None, None, 5000, wire=12.0) == 12.0  # no default then
    assert request_deadline(clock, 60_000, 500_000, None, 5000, wire=12.0) == 10.5  # parameters.timeout smaller
    assert request_deadline(clock, 60_000, None, 4000, None, wire=12.0) == 12.0  # the wire's smaller
    assert request_deadline(clock, 1000, None, None, None, wire=3600.0) == 11.0  # cut to max_timeout_ms
    assert request_deadline(clock, 60_000, None, None, 5000) == 15.0  # no wire deadline: as before
    with pytest.raises(BadRequest):
        request_deadline(clock, 1000, None, 2000, None, wire=12.0)  # a header beyond the maximum still is


# ---- the codec ----------------------------------------------------------------------------------------
def config(*inputs: TensorSpec, outputs: tuple[TensorSpec, ...] = ()) -> ModelConfig:
    outs = outputs or (TensorSpec(name="O", datatype="FP32", shape=(-1,)),)
    return ModelConfig(name="m", implementation="x:Y", max_batch_size=8, inputs=inputs, outputs=outs)


def test_typed_contents_decode_into_the_declared_datatype() -> None:
    cfg = config(TensorSpec(name="I", datatype="INT8", shape=(2,)), TensorSpec(name="B", datatype="BYTES"))
    message = pb.ModelInferRequest(
        id="r1",
        inputs=[
            Tensor(name="I", datatype="INT8", shape=[2, 2], contents=pb.InferTensorContents(int_contents=[1, -2, 3, 127])),
            Tensor(name="B", datatype="BYTES", shape=[2], contents=pb.InferTensorContents(bytes_contents=[b"a", b"b"])),
        ],
        parameters={"timeout": pb.InferParameter(int64_param=1500), "priority": pb.InferParameter(string_param="bulk")},
    )
    req = decode_request(message, cfg)
    assert req.request_id == "r1" and req.timeout_us == 1500.0 and req.priority == "bulk"
    assert [item["I"].tolist() for item in req.items] == [[1, -2], [3, 127]]
    assert req.items[0]["I"].dtype == np.int8 and [item["B"] for item in req.items] == [b"a", b"b"]


def test_typed_contents_out_of_range_or_without_a_field_are_refused() -> None:
    int8 = config(TensorSpec(name="I", datatype="INT8"))
    with pytest.raises(BadRequest, match="out of range for INT8"):
        decode_request(pb.ModelInferRequest(inputs=[Tensor(name="I", datatype="INT8", shape=[1], contents=pb.InferTensorContents(int_contents=[300]))]), int8)
    fp16 = config(TensorSpec(name="H", datatype="FP16"))
    with pytest.raises(BadRequest, match="send it in raw_input_contents"):
        decode_request(pb.ModelInferRequest(inputs=[Tensor(name="H", datatype="FP16", shape=[1], contents=pb.InferTensorContents(fp32_contents=[1.0]))]), fp16)
    with pytest.raises(BadRequest, match="values must be finite"):
        fp32 = config(TensorSpec(name="F", datatype="FP32"))
        decode_request(pb.ModelInferRequest(inputs=[Tensor(name="F", datatype="FP32", shape=[1], contents=pb.InferTensorContents(fp32_contents=[float("nan")]))]), fp32)
    with pytest.raises(BadRequest, match="neither contents nor raw_input_contents"):
        decode_request(pb.ModelInferRequest(inputs=[Tensor(name="F", datatype="FP32", shape=[1])]), config(TensorSpec(name="F", datatype="FP32")))


def test_outputs_asked_for_are_checked_and_answered_raw_in_order() -> None:
    cfg = config(
        TensorSpec(name="X", datatype="FP32", shape=(2,)),
        outputs=(TensorSpec(name="S", datatype="FP64"), TensorSpec(name="T", datatype="BYTES")),
    )
    message = pb.ModelInferRequest(
        inputs=[Tensor(name="X", datatype="FP32", shape=[2, 2])],
        raw_input_contents=[np.zeros(4, dtype=np.float32).tobytes()],
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="T")],
    )
    req = decode_request(message, cfg)
    assert [spec.name for spec, _ in req.outputs] == ["T"]
    rt = type("Rt", (), {"config": cfg})()
    done = Inference(rt, False, req, 3, [{"S": 1.5, "T": b"ab"}, {"S": 2.5, "T": b"c"}], {})  # type: ignore[arg-type]
    answer = encode_response(done)
    assert (answer.model_name, answer.model_version, answer.id) == ("m", "3", "")
    assert [(o.name, o.datatype, list(o.shape)) for o in answer.outputs] == [("T", "BYTES", [2])]
    assert answer.raw_output_contents == [b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"]
    every = DecodedRequest("r", req.items, [(s, True) for s in cfg.outputs], None, None)
    answer = encode_response(Inference(rt, False, every, 3, done.rows, {}))  # type: ignore[arg-type]
    assert np.frombuffer(answer.raw_output_contents[0], dtype=np.float64).tolist() == [1.5, 2.5]
    with pytest.raises(BadRequest, match="unknown output 'Z'"):
        message.outputs[0].name = "Z"
        decode_request(message, cfg)


# ---- the reply and the config -------------------------------------------------------------------------
async def test_a_reply_sends_its_headers_as_trailers_and_an_error_aborts() -> None:
    context = Context()
    reply = GrpcReply("answer", [(b"x-request-id", b"r1")])
    assert await reply.send(context) == "answer"  # type: ignore[arg-type]
    assert context.trailers == (("x-request-id", "r1"),)
    refused = GrpcReply(None, [(b"retry-after", b"2")], 429, Code.RESOURCE_EXHAUSTED, "slow down")
    with pytest.raises(RuntimeError):
        await refused.send(context)  # type: ignore[arg-type]
    assert context.aborted == (Code.RESOURCE_EXHAUSTED, "slow down", (("retry-after", "2"),))


def test_a_unary_reply_closes_at_once_and_a_streamed_one_when_closed() -> None:
    closed: list[str] = []
    GrpcReply().on_close(lambda: closed.append("unary"))
    stream = GrpcReply(streamed=True)
    stream.on_close(lambda: closed.append("stream"))
    assert closed == ["unary"]
    stream.close()
    stream.close()
    assert closed == ["unary", "stream"]


def test_an_llm_is_configured_as_tritons_vllm_backend_decoupled() -> None:
    rt = type("Rt", (), {"config": config(TensorSpec(name="X", datatype="FP32"))})()
    llm = model_config(rt, "text")  # type: ignore[arg-type]
    assert llm.model_transaction_policy.decoupled
    assert [(i.name, i.optional) for i in llm.input] == [
        ("text_input", False), ("stream", True), ("sampling_parameters", True), ("exclude_input_in_output", True)
    ]
    assert [o.name for o in llm.output] == ["text_output"]
    batch = model_config(rt, "oip")  # type: ignore[arg-type]
    assert batch.max_batch_size == 8 and list(batch.input[0].dims) == [] and not batch.model_transaction_policy.decoupled


# ---- health -------------------------------------------------------------------------------------------
class Registry:
    def __init__(self, ready: bool) -> None:
        self.model = type("Rt", (), {"ready": ready})()

    def __contains__(self, name: object) -> bool:
        return name == "sim"

    def get(self, name: str) -> Any:
        return self.model


class ServerView:
    def __init__(self) -> None:
        self.registry = Registry(ready=True)
        self.shutting_down = False

    @property
    def ready(self) -> bool:
        return not self.shutting_down and self.registry.model.ready


def test_health_reads_the_server_and_each_model_live() -> None:
    view = ServerView()
    health = Health(view)  # type: ignore[arg-type]
    assert health.status("") == SERVING and health.status("sim") == SERVING
    assert health.status("nope") is None
    view.registry.model.ready = False
    assert health.status("") == NOT_SERVING and health.status("sim") == NOT_SERVING
    view.registry.model.ready = True
    view.shutting_down = True  # SIGTERM's grace period: still answering, no longer ready
    assert health.status("") == NOT_SERVING and health.status("sim") == NOT_SERVING


async def test_health_watch_sends_each_change_once() -> None:
    view = ServerView()
    health = Health(view, poll_s=0.001)  # type: ignore[arg-type]
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), None)  # type: ignore[arg-type]
    assert (await anext(watch)).status == SERVING
    view.shutting_down = True
    assert (await anext(watch)).status == NOT_SERVING
    await watch.aclose()
    unknown = health.Watch(health_pb2.HealthCheckRequest(service="nope"), None)  # type: ignore[arg-type]
    assert (await anext(unknown)).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    await unknown.aclose()


# ---- the listener's options ---------------------------------------------------------------------------
def test_the_listener_options_follow_the_settings() -> None:
    plain = dict(server_options(ServerConfig(max_body_bytes=1 << 20), reuseport=False))
    assert plain["grpc.max_receive_message_length"] == 1 << 20  # max_body_bytes when unset
    assert plain["grpc.so_reuseport"] == 0 and "grpc.max_connection_age_ms" not in plain
    assert (plain["grpc.keepalive_time_ms"], plain["grpc.keepalive_timeout_ms"]) == (60_000, 20_000)
    cfg = ServerConfig(
        grpc_max_message_bytes=4096,
        grpc_keepalive_time_s=5,
        grpc_max_connection_age_s=300,
        grpc_max_connection_age_grace_s=10,
    )
    tuned = dict(server_options(cfg, reuseport=True))
    assert tuned["grpc.max_receive_message_length"] == 4096 and tuned["grpc.so_reuseport"] == 1
    assert tuned["grpc.keepalive_time_ms"] == 5000
    assert (tuned["grpc.max_connection_age_ms"], tuned["grpc.max_connection_age_grace_ms"]) == (300_000, 10_000)


# ---- a call its edge cancels --------------------------------------------------------------------------
async def test_a_call_cancelled_by_its_edge_is_counted_cancelled_under_its_protocol() -> None:
    clock = FakeClock()
    metrics = Metrics({}, clock)
    registry = CollectorRegistry()
    tenants = Counter("t_requests_total", "", ["tenant", "outcome"], registry=registry)
    started = asyncio.Event()

    async def handler(call: Call, request: object) -> GrpcReply:
        call.runtime = type("Rt", (), {"name": "sim", "version": 1})()  # type: ignore[assignment]
        started.set()
        await asyncio.Event().wait()  # until grpc.aio cancels the RPC's task
        raise AssertionError("not reached")

    call = read({})
    call.tenant = Tenant("acme", TenantConfig())
    task = asyncio.create_task(Accounting(TenantRequests(handler, tenants), metrics, clock)(call, None))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    labels = {"model": "sim", "version": "1", "outcome": "cancelled", "protocol": "grpc"}
    assert metrics.registry.get_sample_value("inferd_requests_total", labels) == 1
    assert metrics.request_statistics("sim", 1).failed == 1
    assert tenants.labels("acme", "cancelled")._value.get() == 1
