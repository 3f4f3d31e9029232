"""ModelStreamInfer through a real `inferd serve`, with tritonclient.grpc's stream (`start_stream`,
`async_stream_infer`, `stop_stream`): many sim requests on one stream answered by id while an earlier
one still runs; the in-flight bound; sim-llm with Triton's vLLM tensors (text pieces, then a final
response; the same text as the REST route for the same seed; a whole answer over unary ModelInfer, from
the response cache when deterministic);
errors as error responses while the stream goes on (a request's timeout mid-stream among them); a
limited tenant's token quota; and a cancelled stream whose sequences are aborted,
with the KV blocks back to 0 and no request left in flight."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from inferd.api.binary import decode_bytes_elements, encode_bytes_elements
from inferd.gateway.keys import key_digest, new_key
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.kinds.llm.sim_llm import sim_llm_tokens
from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server

LIMIT = 4
"""The server's grpc_stream_max_in_flight."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("grpc-stream")
    repo = root / "repo"
    models = {
        "sim": 'builtin = "sim"\n',
        "sim-llm": 'builtin = "sim-llm"\n',
        "cached-llm": 'builtin = "sim-llm"\ncache = { enabled = true }\n',
        # one item a batch, 300 ms each: a stream's requests wait in its queue
        "slow": 'builtin = "sim"\nmax_batch_size = 1\nmax_wait_ms = 0\n[params]\nbase_ms = 300\n',
    }
    for name, toml in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    (root / "inferd.toml").write_text(f"[server]\ngrpc_stream_max_in_flight = {LIMIT}\n")
    s = start_server(root, "--model-repo", str(repo), "--config", str(root / "inferd.toml"))
    yield s
    assert s.stop() in (0, -15)


class Stream:
    """A tritonclient stream whose callbacks land in a queue: (request id, result, error)."""

    def __init__(
        self, server: ServerProc, headers: dict[str, str] | None = None, timeout_s: float | None = None
    ) -> None:
        self.client = triton.InferenceServerClient(server.grpc_target)
        self.answers: queue.Queue[tuple[str | None, Any, InferenceServerException | None]] = queue.Queue()
        self.client.start_stream(callback=self._got, headers=headers, stream_timeout=timeout_s)

    def _got(self, result: Any, error: InferenceServerException | None) -> None:
        rid = result.get_response().id if result is not None else None
        self.answers.put((rid, result, error))

    def next(self) -> tuple[str | None, Any, InferenceServerException | None]:
        return self.answers.get(timeout=30)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def sim_inputs(text: str) -> list[triton.InferInput]:
    inp = triton.InferInput("INPUT0", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return [inp]


def llm_inputs(prompt: str, stream: bool | None = None, exclude: bool | None = None, **sampling: Any) -> list[Any]:
    tensors: list[tuple[str, str, Any]] = [("text_input", "BYTES", prompt.encode())]
    if stream is not None:
        tensors.append(("stream", "BOOL", stream))
    if exclude is not None:
        tensors.append(("exclude_input_in_output", "BOOL", exclude))
    if sampling:
        tensors.append(("sampling_parameters", "BYTES", json.dumps(sampling).encode()))
    inputs = []
    for name, datatype, value in tensors:
        inp = triton.InferInput(name, [1], datatype)
        inp.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else np.bool_))
        inputs.append(inp)
    return inputs


def text_of(result: Any) -> str | None:
    out = result.as_numpy("text_output")
    return None if out is None else "".join(t.decode() for t in out)


def is_final(result: Any) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def metric_or(server: ServerProc, name: str, absent: float | None) -> float:
    """A sample's value; `absent` when the series does not exist yet (None: that fails the test)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    if found is None and absent is not None:
        return absent
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def metric(server: ServerProc, name: str) -> float:
    return metric_or(server, name, None)


def llm_engine(server: ServerProc) -> tuple[float, float, float]:
    """sim-llm's (KV usage, running sequences, streams open on the front end)."""
    labels = 'model="sim-llm",version="1"'
    return (
        metric(server, f"inferd_llm_kv_usage_ratio{{{labels}}}"),
        metric(server, 'inferd_llm_sequences{model="sim-llm",state="running",version="1"}'),
        metric(server, f"inferd_llm_streams{{{labels}}}"),
    )


def until_engine_idle(server: ServerProc) -> None:
    for _ in range(200):
        if llm_engine(server) == (0.0, 0.0, 0.0):
            return
        time.sleep(0.05)
    raise AssertionError(f"sim-llm kept KV blocks, sequences or streams: {llm_engine(server)}")


def read_pieces(stream: Stream, rid: str) -> tuple[list[str], Any]:
    """Every text piece of request `rid` up to its final response (which it returns too)."""
    pieces: list[str] = []
    while True:
        got, result, error = stream.next()
        assert error is None, error
        assert got == rid
        text = text_of(result)
        if is_final(result):
            if text is not None:
                pieces.append(text)
            return pieces, result
        assert text is not None
        pieces.append(text)


def test_many_requests_on_one_stream_are_answered_by_id_while_an_earlier_one_runs(server: ServerProc) -> None:
    stream = Stream(server)
    try:
        stream.client.async_stream_infer(
            "sim-llm", llm_inputs("a long story", stream=True, max_tokens=1500), request_id="long"
        )
        _, first, _ = stream.next()  # the long one has begun
        assert first.get_response().id == "long" and not is_final(first)
        for i in range(LIMIT - 1):
            stream.client.async_stream_infer("sim", sim_inputs(f"item {i}"), request_id=f"sim-{i}")
        answered: dict[str, str] = {}
        while len(answered) < LIMIT - 1:
            rid, result, error = stream.next()
            assert error is None, error
            if rid == "long":
                assert not is_final(result), "the long request ended before the ones sent after it"
                continue
            assert rid is not None and rid not in answered
            answered[rid] = result.as_numpy("OUTPUT0")[0].decode()
            assert is_final(result)
        assert answered == {f"sim-{i}": sim_digest("sim", 1, f"item {i}") for i in range(LIMIT - 1)}
    finally:
        stream.close(cancel=True)
    until_engine_idle(server)


def test_a_request_past_the_bound_is_refused_and_the_stream_goes_on(server: ServerProc) -> None:
    stream = Stream(server)
    try:
        for i in range(LIMIT):
            inputs = llm_inputs(f"story {i}", stream=True, max_tokens=1500)
            stream.client.async_stream_infer("sim-llm", inputs, request_id=f"long-{i}")
        started: set[str] = set()
        while len(started) < LIMIT:  # every long request has answered: all four are in flight
            rid, _, error = stream.next()
            assert error is None, error
            started.add(str(rid))
        stream.client.async_stream_infer("sim", sim_inputs("one too many"), request_id="extra")
        while True:
            rid, _, error = stream.next()
            if error is not None:
                break
        message = str(error)
        assert "[StatusCode.RESOURCE_EXHAUSTED]" in message and f"{LIMIT} requests in flight" in message
        assert "(request 'extra')" in message
    finally:
        stream.close(cancel=True)
    until_engine_idle(server)


def test_llm_streams_text_pieces_then_a_final_response_with_rest_s_text(server: ServerProc) -> None:
    prompt, seed, n = "the quick brown fox", 7, 12
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{server.url}/v1/completions",
            json.dumps({"model": "sim-llm", "prompt": prompt, "max_tokens": n, "seed": seed}).encode(),
            {"content-type": "application/json"},
        ),
        timeout=30,
    ) as r:
        rest_text = json.loads(r.read())["choices"][0]["text"]
    assert rest_text == " ".join(sim_llm_tokens(prompt, seed, n))
    stream = Stream(server)
    try:
        inputs = llm_inputs(prompt, stream=True, max_tokens=n, seed=seed)
        stream.client.async_stream_infer("sim-llm", inputs, request_id="s1", enable_empty_final_response=True)
        pieces, final = read_pieces(stream, "s1")
        assert len(pieces) >= n - 1 and "".join(pieces) == rest_text
        assert final.get_response().model_name == "sim-llm"
        # stream false on the stream: one response, the whole text after the prompt (vLLM's default)
        stream.client.async_stream_infer("sim-llm", llm_inputs(prompt, max_tokens=n, seed=seed), request_id="w")
        rid, whole, error = stream.next()
        assert error is None and rid == "w" and is_final(whole)
        assert text_of(whole) == prompt + rest_text
    finally:
        stream.close()


async def test_the_asyncio_client_streams_several_llm_requests_on_one_stream(server: ServerProc) -> None:
    prompts = {f"a{i}": (f"caller {i} says hi", i, 5 + i) for i in range(3)}
    client = triton_aio.InferenceServerClient(server.grpc_target)

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for rid, (prompt, seed, n) in prompts.items():
            inputs = llm_inputs(prompt, stream=True, max_tokens=n, seed=seed)
            yield {"model_name": "sim-llm", "inputs": inputs, "request_id": rid, "enable_empty_final_response": True}

    texts: dict[str, str] = dict.fromkeys(prompts, "")
    ended: set[str] = set()
    try:
        async for result, error in client.stream_infer(requests()):
            assert error is None, error
            rid = result.get_response().id
            assert rid not in ended
            texts[rid] += text_of(result) or ""
            if is_final(result):
                ended.add(rid)
    finally:  # the requests sent, the client half-closed: the stream ends once every one is answered
        await client.close()
    assert ended == set(prompts)
    assert texts == {rid: " ".join(sim_llm_tokens(p, seed, n)) for rid, (p, seed, n) in prompts.items()}


def test_llm_over_unary_model_infer_is_one_whole_answer(server: ServerProc) -> None:
    client = triton.InferenceServerClient(server.grpc_target)
    try:
        result = client.infer("sim-llm", llm_inputs("hello there", exclude=True, max_tokens=5, seed=3))
        assert text_of(result) == " ".join(sim_llm_tokens("hello there", 3, 5))
        with pytest.raises(InferenceServerException) as err:
            client.infer("sim-llm", llm_inputs("hello", stream=True))
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "ModelStreamInfer" in str(err.value)
    finally:
        client.close()


def test_a_deterministic_whole_answer_comes_from_the_response_cache(server: ServerProc) -> None:
    channel = grpc.insecure_channel(server.grpc_target)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    try:
        request = pb.ModelInferRequest(model_name="cached-llm", id="c")
        sampling = json.dumps({"max_tokens": 6, "seed": 4}).encode()
        for name, value in (("text_input", b"cache me"), ("sampling_parameters", sampling)):
            request.inputs.add(name=name, datatype="BYTES", shape=[1])
            request.raw_input_contents.append(encode_bytes_elements([value]))
        answers, seen = [], []
        for _ in range(2):
            response, rpc = stub.ModelInfer.with_call(request, timeout=30)
            trailers = dict(rpc.trailing_metadata())
            seen.append(trailers["x-inferd-cache"])
            answers.append(decode_bytes_elements(memoryview(response.raw_output_contents[0]), 1, "text_output"))
        assert seen == ["miss", "hit"] and answers[0] == answers[1]
        assert answers[0] == [("cache me" + " ".join(sim_llm_tokens("cache me", 4, 6))).encode()]
        request.inputs[1].name = "stream"  # no seed: the text is not deterministic, never cached
        request.inputs[1].datatype = "BOOL"
        request.raw_input_contents[1] = b"\x00"
        _, rpc = stub.ModelInfer.with_call(request, timeout=30)
        assert dict(rpc.trailing_metadata())["x-inferd-cache"] == "bypass"
    finally:
        channel.close()


def test_errors_are_error_responses_and_the_stream_goes_on(server: ServerProc) -> None:
    stream = Stream(server)
    try:
        stream.client.async_stream_infer("nope", sim_inputs("x"), request_id="e1")
        stream.client.async_stream_infer("sim-llm", llm_inputs("p", temperature="hot"), request_id="e2")
        inputs = [i for i in llm_inputs("p", stream=True) if i.name() != "text_input"]
        stream.client.async_stream_infer("sim-llm", inputs, request_id="e3")
        stream.client.async_stream_infer("sim", sim_inputs("still here"), request_id="ok")
        errors: dict[str, str] = {}
        ok = None
        for _ in range(4):
            _, result, error = stream.next()
            if error is not None:
                found = re.search(r"\(request '(\w+)'\)$", str(error))
                assert found, str(error)
                errors[found.group(1)] = str(error)
            else:
                ok = result
        assert ok is not None and ok.as_numpy("OUTPUT0")[0].decode() == sim_digest("sim", 1, "still here")
        assert errors["e1"].startswith("[StatusCode.NOT_FOUND]") and "'nope'" in errors["e1"]
        assert errors["e2"].startswith("[StatusCode.INVALID_ARGUMENT]") and "temperature" in errors["e2"]
        assert errors["e3"].startswith("[StatusCode.INVALID_ARGUMENT]") and "text_input" in errors["e3"]
    finally:
        stream.close()


def test_a_cancelled_stream_aborts_its_sequences_and_frees_the_kv_blocks(server: ServerProc) -> None:
    aborted = 'inferd_llm_sequences_ended_total{model="sim-llm",outcome="aborted",version="1"}'
    gone = 'inferd_llm_client_aborts_total{model="sim-llm",version="1"}'
    cancelled = 'inferd_requests_total{model="sim-llm",outcome="cancelled",protocol="grpc",version="1"}'
    until_engine_idle(server)
    aborted_before, gone_before = metric(server, aborted), metric(server, gone)
    cancelled_before = metric_or(server, cancelled, 0.0)
    stream = Stream(server)
    try:
        stream.client.async_stream_infer(
            "sim-llm", llm_inputs("stream a story", stream=True, max_tokens=1500), request_id="streamed"
        )
        whole = llm_inputs("write a book", max_tokens=1500, n=2)  # two choices, answered whole: none yet
        stream.client.async_stream_infer("sim-llm", whole, request_id="whole")
        for _ in range(3):
            rid, _, error = stream.next()
            assert error is None and rid == "streamed"
        for _ in range(200):  # until all three sequences hold KV blocks
            kv, _, streams = llm_engine(server)
            if streams == 3:
                break
            time.sleep(0.02)
        assert kv > 0 and streams == 3
    finally:
        stream.close(cancel=True)
    until_engine_idle(server)
    assert metric(server, aborted) == aborted_before + 3
    assert metric(server, gone) == gone_before + 3
    assert metric(server, cancelled) == cancelled_before + 2  # both requests, cut before their end


def test_a_cancelled_stream_withdraws_its_queued_items(server: ServerProc) -> None:
    depth = 'inferd_queue_depth{model="slow",version="1"}'
    inflight = 'inferd_inflight_batches{model="slow",version="1"}'
    ran = 'inferd_batch_executions_total{model="slow",outcome="ok",version="1"}'
    cancelled = 'inferd_requests_total{model="slow",outcome="cancelled",protocol="grpc",version="1"}'
    ran_before, cancelled_before = metric_or(server, ran, 0.0), metric_or(server, cancelled, 0.0)
    stream = Stream(server)
    try:
        for i in range(LIMIT):
            stream.client.async_stream_infer("slow", sim_inputs(f"queued {i}"), request_id=f"q{i}")
        for _ in range(200):  # the worker has its batches, the rest wait in the front end's queue
            if metric(server, depth) > 0 and metric(server, inflight) > 0:
                break
            time.sleep(0.01)
        assert metric(server, depth) > 0 and stream.answers.empty()
    finally:
        stream.close(cancel=True)
    for _ in range(300):  # the queue empties at once; the batches the worker had end
        if metric(server, depth) == 0 and metric(server, inflight) == 0:
            break
        time.sleep(0.01)
    assert metric(server, depth) == 0 and metric(server, inflight) == 0
    ran_after = metric_or(server, ran, 0.0)
    assert ran_after < ran_before + LIMIT, "items of the cancelled stream ran after it went away"
    assert metric(server, depth) == 0 and metric(server, inflight) == 0 and metric_or(server, ran, 0.0) == ran_after
    assert metric(server, cancelled) == cancelled_before + LIMIT  # every request of the stream, as 499s are


def test_a_request_s_timeout_cuts_its_stream_with_an_error_and_frees_the_kv_blocks(server: ServerProc) -> None:
    stream = Stream(server)
    try:
        inputs = llm_inputs("a story past its time", stream=True, max_tokens=1500)
        stream.client.async_stream_infer("sim-llm", inputs, request_id="late", timeout=400_000)  # microseconds
        pieces = []
        while True:
            rid, result, error = stream.next()
            if error is not None:
                break
            assert rid == "late" and not is_final(result)
            pieces.append(text_of(result))
        message = str(error)
        assert message.startswith("[StatusCode.DEADLINE_EXCEEDED]") and message.endswith("(request 'late')")
        words = "".join(p or "" for p in pieces).split()
        assert len(words) < 1500 and words == sim_llm_tokens("a story past its time", None, len(words))
        # the stream goes on
        stream.client.async_stream_infer("sim", sim_inputs("after"), request_id="after")
        rid, result, error = stream.next()
        assert error is None and rid == "after"
    finally:
        stream.close()
    until_engine_idle(server)


def test_the_stream_s_deadline_bounds_its_requests(server: ServerProc) -> None:
    stream = Stream(server, timeout_s=1.0)
    try:
        inputs = llm_inputs("a story longer than the stream", stream=True, max_tokens=1500)
        stream.client.async_stream_infer("sim-llm", inputs, request_id="bounded")
        while True:
            _, result, error = stream.next()
            if error is not None:
                break
            assert not is_final(result)
        assert "DEADLINE_EXCEEDED" in str(error), str(error)  # the request's own, or the stream's
    finally:
        stream.close()
    until_engine_idle(server)


TOKENS = new_key()
CONTEXT = 2048
"""sim-llm's context length: tokens_per_min may not be lower (the longest request it accepts)."""


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("grpc-stream-tenants")
    path = root / "inferd.toml"
    path.write_text(f'[tenants.tok]\napi_key_sha256 = ["{key_digest(TOKENS)}"]\ntokens_per_min = {CONTEXT}\n')
    s = start_server(root, "--model", "sim-llm", "--config", str(path))
    yield s
    assert s.stop() in (0, -15)


def test_a_limited_tenant_s_llm_requests_reserve_their_tokens(tenant_server: ServerProc) -> None:
    stream = Stream(tenant_server, headers={"authorization": f"Bearer {TOKENS}"})
    try:
        stream.client.async_stream_infer("sim-llm", llm_inputs("hi", max_tokens=200), request_id="small")
        rid, _, error = stream.next()
        assert error is None and rid == "small"
        # 1 + 200 tokens used (6 s of the bucket's refill): the next one's 1 + 2047 no longer fit
        stream.client.async_stream_infer("sim-llm", llm_inputs("hi", max_tokens=CONTEXT - 1), request_id="big")
        _, _, error = stream.next()
        assert error is not None and str(error).startswith("[StatusCode.RESOURCE_EXHAUSTED]")
        assert "tokens" in str(error) and str(error).endswith("(request 'big')")
    finally:
        stream.close()
    client = triton.InferenceServerClient(tenant_server.grpc_target)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("sim-llm", llm_inputs("hi", max_tokens=CONTEXT - 1), headers={"x-api-key": TOKENS})
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "tokens" in str(err.value)
        with pytest.raises(InferenceServerException) as err:
            client.infer("sim-llm", llm_inputs("hi", max_tokens=2))  # no key
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        client.close()


def test_a_stopping_server_answers_what_a_stream_sent_then_ends_it(tmp_path: Path) -> None:
    s = start_server(tmp_path, "--model", "sim-llm")
    stream = Stream(s)
    try:
        inputs = llm_inputs("a story to finish", stream=True, max_tokens=300)
        stream.client.async_stream_infer("sim-llm", inputs, request_id="open")
        rid, _, error = stream.next()
        assert error is None and rid == "open"
        assert s.stop() == 0  # the open stream holds the shutdown only until its request is answered
        pieces, _ = read_pieces(stream, "open")
        assert "".join(pieces).split()[-299:] == sim_llm_tokens("a story to finish", None, 300)[1:]
        assert stream.answers.empty()
    finally:
        stream.close()
