"""OpenAI-compatible routes: POST /v1/embeddings and GET /v1/models (batch and LLM models). Errors in the
OpenAI shape. Text generation lives in api/completions.py. A model's traffic.shadow also gets a sampled
copy of its embeddings requests (gateway/shadow.py), compared vector by vector with the answer."""

from __future__ import annotations

import base64
from functools import partial
from typing import Literal

import msgspec
import numpy as np

from inferd.api.asgi import HttpRequest, HttpResponse, StreamingResponse
from inferd.api.context import ApiContext
from inferd.api.http import check_content_type, decode_json, json_response, read_body
from inferd.core.call import Call
from inferd.errors import BadRequest, ServingError
from inferd.gateway.auth import tenant_share
from inferd.gateway.shadow import Rows, Shadows
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.observability.logging_setup import current_request_id
from inferd.runtime.contract import Runtime


class EmbeddingsRequest(msgspec.Struct):
    model: str
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


_decoder = msgspec.json.Decoder(EmbeddingsRequest)
_encoder = msgspec.json.Encoder()


def openai_error(exc: ServingError, status: int) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error" if exc.code == "RateLimited" else "overloaded_error"
    error = {"message": exc.message, "type": kind, "param": None, "code": exc.code}
    return _encoder.encode({"error": {**error, "request_id": current_request_id()}})


def list_models(names: list[str], started_at: float) -> HttpResponse:
    created = int(started_at)
    data = [{"id": name, "object": "model", "created": created, "owned_by": "inferd"} for name in names]
    return json_response(_encoder.encode({"object": "list", "data": data}))


async def embeddings(api: ApiContext, call: Call, request: HttpRequest) -> HttpResponse | StreamingResponse:
    check_content_type(request, ("application/json", ""))
    body = await read_body(request, api.max_body)
    req = decode_json(_decoder, body, "embeddings request", 'send {"model": ..., "input": ...}')
    primary = api.batch_model(call, req.model, request.header)
    # a batch model's fallback is a batch model too (same API family: KindRegistry.same_api)
    return await api.answer_with_fallback(call, primary, lambda rt: _embed(api, call, req, rt, primary))


async def _embed(
    api: ApiContext, call: Call, req: EmbeddingsRequest, rt: ModelRuntime, primary: ModelRuntime
) -> HttpResponse:
    """The embeddings of `req` by `rt` (the model it names, `primary`, or that model's fallback)."""
    texts = _texts(req, rt.config.max_items_per_request)
    _check_embedder(rt, req)
    share = tenant_share(call.tenant)  # the tenant's lane in the queue
    rt.precheck(call.priority, share)  # call.priority: X-Priority's
    # the model's default applies when the caller names none: a fallback's own
    deadline = call.deadline = api.deadline(rt, call)

    async def compute() -> tuple[tuple[bytes, int], int]:
        payloads = [t.encode() for t in texts]
        results = await rt.service.infer(
            payloads, deadline=deadline, priority=call.priority, share=share, gone=call.departure.watch
        )
        body, truncated = _encode(req, [r.outputs for r in results])
        return (body, truncated), len(body)

    if rt.config.cache.enabled:  # the same vectors for the same texts, in the same encoding
        (out, truncated), _ = await api.cache.answer(call, rt, ("embeddings", texts, req.encoding_format), compute)
    else:
        (out, truncated), _ = await compute()
    if rt is primary and (shadow := api.shadows.target(rt)) is not None:
        api.shadows.mirror(shadow, out, partial(_shadow_copy, api.shadows, req, texts), same_embeddings)
    return json_response(out, headers=[(b"x-inferd-truncated-inputs", str(truncated).encode())])


async def _shadow_copy(
    shadows: Shadows, req: EmbeddingsRequest, texts: list[str], rt: ModelRuntime, timeout_s: float
) -> bytes:
    """The body `rt` (the shadow version) would have answered; never cached or charged to the tenant."""
    _check_embedder(rt, req)
    return _encode(req, await shadows.copy_items([t.encode() for t in texts], rt, timeout_s))[0]


def same_embeddings(primary: bytes, shadow: bytes) -> bool:
    """The same vectors in the same order (the usage may differ)."""
    a, b = msgspec.json.decode(primary), msgspec.json.decode(shadow)
    return [d["embedding"] for d in a["data"]] == [d["embedding"] for d in b["data"]]


def _check_embedder(rt: Runtime, req: EmbeddingsRequest) -> None:
    spec_in, spec_out = rt.config.inputs, {t.name for t in rt.config.outputs}
    if len(spec_in) != 1 or spec_in[0].datatype != "BYTES" or "EMBEDDING" not in spec_out:
        raise BadRequest(f"model {rt.name!r} does not produce embeddings (it has no EMBEDDING output)")
    dims = next(t.shape for t in rt.config.outputs if t.name == "EMBEDDING")
    if req.dimensions is not None and (len(dims) != 1 or req.dimensions != dims[0]):
        raise BadRequest(
            f"model {rt.name!r} produces {list(dims)}-dimensional embeddings; "
            f"dimensions={req.dimensions} is not supported"
        )


def _encode(req: EmbeddingsRequest, rows: Rows) -> tuple[bytes, int]:
    data = []
    tokens = truncated = 0
    for index, outputs in enumerate(rows):
        vector = np.asarray(outputs["EMBEDDING"], dtype=np.float32)
        emb: object = (
            base64.b64encode(vector.tobytes()).decode()
            if req.encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": emb})
        tokens += int(outputs.get("TOKENS", 0))
        truncated += bool(outputs.get("TRUNCATED", False))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_inputs": truncated}
    return _encoder.encode({"object": "list", "data": data, "model": req.model, "usage": usage}), truncated


def _texts(req: EmbeddingsRequest, limit: int) -> list[str]:
    value = req.input
    if isinstance(value, str):
        texts = [value]
    elif value and all(isinstance(v, str) for v in value):
        texts = list(value)  # type: ignore[arg-type]
    elif not value:
        raise BadRequest("input is empty: send a string or a non-empty list of strings")
    else:
        raise BadRequest("token-id input is not supported: send text (a string or a list of strings)")
    if len(texts) > limit:
        raise BadRequest(f"{len(texts)} inputs in one request; the limit is {limit}")
    for i, t in enumerate(texts):
        try:
            t.encode()
        except UnicodeEncodeError:
            raise BadRequest(f"input[{i}] is not valid Unicode (lone surrogate)") from None
    return texts
