"""`inferd bench --protocol grpc` against a stub ModelInfer server (grpc.aio, in process): the request
bytes are a well-formed ModelInferRequest, answers get the same check as REST's, statuses are counted by
code, deadlines cancel the RPC, and requests spread over the channels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from inferd.bench.grpc_infer import (
    bytes_element,
    grpc_fields,
    infer_request,
    request_head,
    varint,
)
from inferd.bench.infer_requests import BadAnswer
from inferd.bench.loadgen import LoadSpec, run_load
from inferd.bench.spec_checks import default_grpc_target, is_grpc_target
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.models.sim import sim_digest

Rule = Callable[[int], bool]


def never(i: int) -> bool:
    return False


@dataclass
class StubBehaviour:
    """Which request numbers (i in id "seed-i") get which misbehaviour."""

    exhausted: Rule = never
    past_deadline: Rule = never
    """Answer DEADLINE_EXCEEDED, as a server does with a request past its deadline."""
    wrong_digest: Rule = never
    foreign_id: Rule = never
    typed_contents: Rule = never
    """Answer in typed `contents` instead of raw_output_contents."""
    slow: Rule = never
    slow_s: float = 0.0
    received: int = 0
    cancelled: int = 0
    peers: set[str] = field(default_factory=set)
    metadata: dict[str, str] = field(default_factory=dict)
    deadlines: list[float | None] = field(default_factory=list)


class _Stub:
    def __init__(self, behaviour: StubBehaviour) -> None:
        self.b = behaviour

    async def infer(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        b = self.b
        b.received += 1
        b.peers.add(context.peer())
        b.deadlines.append(context.time_remaining())
        b.metadata.update((k, v) for k, v in context.invocation_metadata() if isinstance(v, str))
        req = pb.ModelInferRequest.FromString(raw)
        assert [t.name for t in req.inputs] == ["INPUT0"] and req.inputs[0].datatype == "BYTES"
        assert list(req.inputs[0].shape) == [1] and len(req.raw_input_contents) == 1
        blob = req.raw_input_contents[0]
        payload = blob[4 : 4 + int.from_bytes(blob[:4], "little")].decode()
        i = int(req.id.rsplit("-", 1)[1])
        if b.slow(i):
            try:
                await asyncio.sleep(b.slow_s)
            except asyncio.CancelledError:
                b.cancelled += 1
                raise
        if b.past_deadline(i):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        if b.exhausted(i):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", (("retry-after", "1"),))
        digest = sim_digest(req.model_name, 1, payload + ("other" if b.wrong_digest(i) else ""))
        rid = f"{req.id.rsplit('-', 1)[0]}-{i - 1}" if b.foreign_id(i) else req.id
        resp = pb.ModelInferResponse(model_name=req.model_name, model_version="1", id=rid)
        out = resp.outputs.add(name="OUTPUT0", datatype="BYTES", shape=[1])
        if b.typed_contents(i):
            out.contents.bytes_contents.append(digest.encode())
        else:
            resp.raw_output_contents.append(bytes_element(digest.encode()))
        context.set_trailing_metadata((("x-inferd-queue-ms", "5.0"), ("x-inferd-batch-size", "8")))
        return resp.SerializeToString()


@dataclass
class Stub:
    target: str
    behaviour: StubBehaviour


@pytest.fixture
async def stub(no_leftover_tasks: None) -> AsyncIterator[Stub]:
    """The server stops before the check for leftover tasks (it needs that fixture to be set up first)."""
    behaviour = StubBehaviour()
    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(_Stub(behaviour).infer)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield Stub(f"127.0.0.1:{port}", behaviour)
    await server.stop(None)


def spec(target: str, **overrides: object) -> LoadSpec:
    base: dict[str, object] = {
        "url": target,
        "protocol": "grpc",
        "rate": 200.0,
        "duration_s": 0.5,
        "arrival": "constant",
    }
    return LoadSpec(**(base | overrides))  # type: ignore[arg-type]


def test_request_bytes_are_the_message_tritonclient_would_send() -> None:
    raw = infer_request(request_head("sim"), "7-300", "7-300-".ljust(200, "x"))
    req = pb.ModelInferRequest.FromString(raw)
    want = pb.ModelInferRequest(model_name="sim", id="7-300")
    want.inputs.add(name="INPUT0", datatype="BYTES", shape=[1])
    want.raw_input_contents.append(len(b"7-300-".ljust(200, b"x")).to_bytes(4, "little") + b"7-300-".ljust(200, b"x"))
    assert req == want
    assert varint(0) == b"\x00" and varint(300) == b"\xac\x02" and varint(1 << 21) == b"\x80\x80\x80\x01"


def test_answer_fields_from_raw_or_typed_contents_and_bad_answers() -> None:
    resp = pb.ModelInferResponse(model_name="sim", model_version="1", id="0-1")
    resp.raw_output_contents.append(bytes_element(b"abc"))
    assert grpc_fields(resp.SerializeToString()) == ("0-1", "sim", "1", "abc")
    typed = pb.ModelInferResponse(model_name="sim", model_version="2", id="0-2")
    typed.outputs.add(name="OUTPUT0").contents.bytes_contents.append(b"def")
    assert grpc_fields(typed.SerializeToString()) == ("0-2", "sim", "2", "def")
    truncated = pb.ModelInferResponse(id="0-3", raw_output_contents=[b"\x09\x00\x00\x00abc"])
    for bad in (b"\xff\xff\xff", pb.ModelInferResponse(id="0-4").SerializeToString(), truncated.SerializeToString()):
        with pytest.raises(BadAnswer):
            grpc_fields(bad)


def test_grpc_targets() -> None:
    assert is_grpc_target("127.0.0.1:8001") and is_grpc_target("[::1]:8001") and is_grpc_target("host:1")
    assert not any(map(is_grpc_target, ("http://h:1", "h", "h:0", "h:x", ":80", "h:70000")))
    assert default_grpc_target("http://127.0.0.1:8000") == "127.0.0.1:8001"
    assert default_grpc_target("http://[::1]:9000/") == "[::1]:9001"
    with pytest.raises(ValueError, match="HOST:PORT"):
        LoadSpec(url="http://127.0.0.1:8001", protocol="grpc")


async def test_correct_answers_are_ok_with_lifecycle_metadata_over_several_channels(stub: Stub) -> None:
    report = await run_load(spec(stub.target, channels=3, priority="low", headers=(("X-Api-Key", "k"),)))
    m = report.measured
    assert m.sent == 100 and m.ok == 100 and m.mismatched == 0 and m.errors == {}
    assert m.queue_ms["p50"] == pytest.approx(5.0, rel=0.01) and m.batch_size["mean"] == 8
    assert len(stub.behaviour.peers) == 3  # one connection per channel
    assert stub.behaviour.metadata["x-priority"] == "low" and stub.behaviour.metadata["x-api-key"] == "k"
    assert report.invariants["lost"] == 0


async def test_statuses_are_counted_by_code_and_wrong_answers_caught(stub: Stub) -> None:
    b = stub.behaviour
    b.exhausted = lambda i: i % 10 == 0
    b.wrong_digest = lambda i: i % 10 == 1
    b.foreign_id = lambda i: i % 10 == 2
    b.typed_contents = lambda i: i % 10 == 3
    b.past_deadline = lambda i: i % 10 == 4
    report = await run_load(spec(stub.target, duration_s=0.25, timeout_ms=2000.0, send_deadline=True))
    m = report.measured
    assert m.sent == 50
    assert m.errors == {"grpc_resource_exhausted": 5, "grpc_deadline_exceeded": 5}
    assert m.mismatch_kinds["wrong_digest"] == 5
    assert m.mismatch_kinds["wrong_id"] + m.mismatch_kinds["unknown_id"] == 5
    assert m.ok == 30  # typed contents pass the same check
    assert m.rejection_ms["p50"] is not None
    assert report.invariants["timed_out"] == 5
    # --send-deadline: the gRPC deadline (its header rounds up to a few ms)
    assert all(d is not None and 0 < d <= 2.05 for d in b.deadlines), b.deadlines


async def test_without_send_deadline_no_grpc_deadline_is_sent(stub: Stub) -> None:
    report = await run_load(spec(stub.target, duration_s=0.05))
    assert report.measured.ok == report.sent > 0
    assert stub.behaviour.deadlines == [None] * report.sent


async def test_the_client_deadline_cancels_the_rpc(stub: Stub) -> None:
    stub.behaviour.slow, stub.behaviour.slow_s = (lambda i: True), 5.0
    report = await run_load(spec(stub.target, duration_s=0.05, timeout_ms=100.0))
    assert report.measured.errors == {"timeout": report.sent} and report.sent > 0
    for _ in range(50):
        if stub.behaviour.cancelled == report.sent:
            break
        await asyncio.sleep(0.02)
    assert stub.behaviour.cancelled == report.sent  # the server saw each RPC cancelled


async def test_a_target_nobody_listens_on_gives_connection_errors() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = await run_load(spec(f"127.0.0.1:{port}", duration_s=0.05, timeout_ms=2000.0))
    assert report.sent > 0 and report.measured.errors == {"connection": report.sent}


# --- bench-llm --protocol grpc: ModelStreamInfer with the vLLM backend's tensors ---


@dataclass
class LLMStub:
    """How the stub answers request i (its id "seed-i")."""

    error: Rule = never
    foreign_id: Rule = never
    no_final: Rule = never
    wrong_text: Rule = never
    requests: list[pb.ModelInferRequest] = field(default_factory=list)
    half_closed: int = 0
    opened: int = 0


def _stream_response(rid: str, text: str | None, final: bool) -> bytes:
    resp = pb.ModelInferResponse(model_name="sim-llm", model_version="1", id=rid)
    if text is not None:
        resp.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        resp.raw_output_contents.append(bytes_element(text.encode()))
    resp.parameters["triton_final_response"].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=resp).SerializeToString()


def _llm_handler(b: LLMStub) -> grpc.GenericRpcHandler:
    from inferd.bench.grpc_llm import bytes_elements
    from inferd.kinds.llm.sim_llm import sim_llm_tokens

    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        b.opened += 1
        async for raw in requests:
            req = pb.ModelInferRequest.FromString(raw)
            b.requests.append(req)
            tensors = {t.name: bytes_elements(c) if t.datatype == "BYTES" else c for t, c in
                       zip(req.inputs, req.raw_input_contents, strict=True)}  # fmt: skip
            params = json.loads(tensors["sampling_parameters"][0])
            i = int(req.id.rsplit("-", 1)[1])
            if b.error(i):
                error = pb.ModelStreamInferResponse(error_message="[StatusCode.RESOURCE_EXHAUSTED] full")
                error.infer_response.id = req.id  # as inferd's edge answers an error on a stream
                yield error.SerializeToString()
                continue
            rid = "other" if b.foreign_id(i) else req.id
            words = sim_llm_tokens(tensors["text_input"][0].decode(), params["seed"], params["max_tokens"])
            if b.wrong_text(i):
                words[-1] = "nope"
            for k, word in enumerate(words):
                yield _stream_response(rid, word if k == 0 else " " + word, False)
            if not b.no_final(i):
                yield _stream_response(rid, None, True)
            else:
                return
        b.half_closed += 1

    return grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)}
    )


async def test_llm_streams_carry_the_vllm_tensors_and_are_checked_and_timed(no_leftover_tasks: None) -> None:
    from inferd.bench.llm_loadgen import run_llm_load
    from inferd.bench.llm_workload import LengthDist, LLMLoadSpec

    b = LLMStub(error=lambda i: i == 1, foreign_id=lambda i: i == 2, no_final=lambda i: i == 3,
                wrong_text=lambda i: i == 4)  # fmt: skip
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_llm_handler(b),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        spec = LLMLoadSpec(
            url=f"127.0.0.1:{port}", protocol="grpc", rate=100.0, duration_s=0.1, arrival="constant",
            prompt_tokens=LengthDist(8, 8), output_tokens=LengthDist(5, 5), timeout_s=5.0, temperature=0.5,
        )  # fmt: skip
        report = await run_llm_load(spec)
    finally:
        await server.stop(None)
    m = report.measured
    assert m.sent == 10 and m.ok == 6
    assert m.errors == {"grpc_resource_exhausted": 1, "incomplete": 1}
    assert m.mismatch_kinds == {"wrong_text": 1, "wrong_length": 0, "wrong_id": 1}
    assert m.output_tokens == 30 and m.itl_ms["p50"] is not None and m.ttft_ms["p50"] is not None
    # a stream per request; every one that got its final response (6 good, 1 wrong text) was half-closed
    assert b.opened == 10 and b.half_closed >= 7
    req = b.requests[0]
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [
        ("text_input", "BYTES", [1]),
        ("stream", "BOOL", [1]),
        ("sampling_parameters", "BYTES", [1]),
        ("exclude_input_in_output", "BOOL", [1]),
    ]
    assert req.raw_input_contents[1] == b"\x01" and req.raw_input_contents[3] == b"\x01"
    assert json.loads(req.raw_input_contents[2][4:]) == {"max_tokens": 5, "temperature": 0.5, "seed": 0}


def test_stream_error_kinds_name_the_status_when_the_message_does() -> None:
    from inferd.bench.grpc_llm import stream_error_kind

    assert stream_error_kind("[StatusCode.RESOURCE_EXHAUSTED] 64 in flight (request '0-1')") == (
        "grpc_resource_exhausted"
    )
    assert stream_error_kind("[StatusCode.INVALID_ARGUMENT] no text_input") == "grpc_invalid_argument"
    assert stream_error_kind("model failed") == "stream_error"


async def test_llm_requests_share_long_lived_streams_matched_by_id(no_leftover_tasks: None) -> None:
    from inferd.bench.llm_loadgen import run_llm_load
    from inferd.bench.llm_workload import LengthDist, LLMLoadSpec

    # an answer under an id nobody sent is dropped: its request times out; the others are matched by id
    b = LLMStub(error=lambda i: i == 1, foreign_id=lambda i: i == 2, wrong_text=lambda i: i == 4)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_llm_handler(b),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        spec = LLMLoadSpec(
            url=f"127.0.0.1:{port}", protocol="grpc", streams=2, rate=200.0, duration_s=0.1,
            arrival="constant", prompt_tokens=LengthDist(8, 8), output_tokens=LengthDist(5, 5), timeout_s=1.0,
        )  # fmt: skip
        report = await run_llm_load(spec)
    finally:
        await server.stop(None)
    m = report.measured
    assert m.sent == 20 and m.ok == 17
    assert m.errors == {"grpc_resource_exhausted": 1, "timeout": 1}
    assert m.mismatch_kinds == {"wrong_text": 1, "wrong_length": 0, "wrong_id": 0}
    assert len(b.requests) == 20 and b.opened == 2  # two streams carried every request
