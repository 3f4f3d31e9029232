"""The HTTP front end. Each handler reads top to bottom: parse -> submit -> encode.

Routes: OIP v2 (health, metadata, infer with Triton's binary extension), OpenAI /v1/embeddings and
/v1/models, /metrics, /openapi.json.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferd import __version__
from inferd.api import completions as completion_routes
from inferd.api import oip
from inferd.api import openai as openai_routes
from inferd.api.asgi import AsgiApp, HttpRequest, HttpResponse, Router, StreamingResponse
from inferd.api.errors import error_headers, status_of
from inferd.api.http import (
    ClientGone,
    check_content_type,
    json_response,
    parse_priority,
    read_body,
    wait_for_items,
)
from inferd.api.openapi import openapi_document
from inferd.batching.dispatcher import ItemResult, ModelRuntime
from inferd.errors import BadRequest, Internal, NotFound, ServingError
from inferd.llm.runtime import LLMRuntime
from inferd.llm.upstream import UpstreamRuntime
from inferd.server import InferenceServer

log = logging.getLogger("inferd.api")
access_log = logging.getLogger("inferd.access")

ErrorBody = Callable[[ServingError, int], bytes]


def oip_error(exc: ServingError, status: int) -> bytes:
    return oip.encode_json({"error": exc.message})


def create_app(server: InferenceServer) -> AsgiApp:
    api = Api(server)
    r = Router()
    r.add("GET", "/v2/health/live", api.live)
    r.add("GET", "/v2/health/ready", api.ready)
    r.add("GET", "/v2", api.server_metadata)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add("GET", base, api.model_metadata)
        r.add("GET", base + "/ready", api.model_ready)
        r.add("POST", base + "/infer", api.infer)
    r.add("POST", "/v1/embeddings", api.embeddings)
    r.add("GET", "/v1/models", api.list_models)
    r.add("POST", "/v1/completions", api.completions)
    r.add("POST", "/v1/chat/completions", api.chat_completions)
    r.add("GET", "/metrics", api.metrics)
    r.add("GET", "/openapi.json", api.openapi)
    return AsgiApp(r, server.running, _not_found)


def _not_found(path: str, other_method: bool) -> HttpResponse:
    if other_method:
        return json_response(oip.encode_json({"error": f"method not allowed on {path}"}), 405)
    return json_response(oip.encode_json({"error": f"no route {path}"}), 404)


def lifecycle(results: list[ItemResult]) -> dict[str, Any]:
    """The per-request lifecycle record: queue wait, batch id and size, compute time, attempts."""
    first = results[0]
    if len(results) == 1:
        return {
            "queue_ms": round(first.queue_s * 1000, 3),
            "batch_id": first.batch_id,
            "batch_size": first.batch_size,
            "compute_ms": round(first.compute_s * 1000, 3),
            "attempts": first.attempts,
        }
    batches = list(dict.fromkeys(r.batch_id for r in results))[:8]
    sizes = list(dict.fromkeys(r.batch_size for r in results))[:8]
    return {
        "queue_ms": round(max(r.queue_s for r in results) * 1000, 3),
        "batch_id": ",".join(map(str, batches)),
        "batch_size": ",".join(map(str, sizes)),
        "compute_ms": round(max(r.compute_s for r in results) * 1000, 3),
        "attempts": max(r.attempts for r in results),
    }


def lifecycle_headers(record: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-inferd-queue-ms", str(record["queue_ms"]).encode()),
        (b"x-inferd-batch-id", str(record["batch_id"]).encode()),
        (b"x-inferd-batch-size", str(record["batch_size"]).encode()),
        (b"x-inferd-compute-ms", str(record["compute_ms"]).encode()),
        (b"x-inferd-attempts", str(record["attempts"]).encode()),
    ]


class Api:
    def __init__(self, server: InferenceServer) -> None:
        self.server = server
        self.clock = server.clock
        self.max_body = server.config.max_body_bytes
        self.access_log = server.config.access_log

    # ---- health and metadata ----------------------------------------------------------------------
    async def live(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(content_type=None)

    async def ready(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(status=200 if self.server.ready else 503, content_type=None)

    async def server_metadata(self, request: HttpRequest) -> HttpResponse:
        return json_response(
            oip.encode_json({"name": "inferd", "version": __version__, "extensions": ["binary_tensor_data"]})
        )

    async def model_metadata(self, request: HttpRequest) -> HttpResponse:
        return await self.guard(request, None, self._model_metadata)

    async def _model_metadata(self, request: HttpRequest) -> HttpResponse:
        rt = self._runtime(request)
        return json_response(oip.encode_json(oip.model_metadata(rt.config, rt.served_version)))

    async def model_ready(self, request: HttpRequest) -> HttpResponse:
        return await self.guard(request, None, self._model_ready)

    async def _model_ready(self, request: HttpRequest) -> HttpResponse:
        rt = self._runtime(request)
        ready = rt.ready and not self.server.shutting_down
        return HttpResponse(status=200 if ready else 503, content_type=None)

    async def list_models(self, request: HttpRequest) -> HttpResponse:
        return openai_routes.list_models(self.server)

    async def metrics(self, request: HttpRequest) -> HttpResponse:
        body = generate_latest(self.server.metrics.registry)
        return HttpResponse(body, content_type=CONTENT_TYPE_LATEST.encode())

    async def openapi(self, request: HttpRequest) -> HttpResponse:
        return json_response(oip.encode_json(openapi_document()))

    # ---- inference ----------------------------------------------------------------------------------
    async def infer(self, request: HttpRequest) -> HttpResponse:
        rt = self.server.runtimes.get(request.path_params["model"])
        return await self.guard(request, rt, self._infer)

    async def _infer(self, request: HttpRequest) -> HttpResponse:
        rt = self._runtime(request)
        header_priority = request.header(b"x-priority")
        rt.precheck(parse_priority(None, header_priority))  # 503 / 429 decided before the body is read
        check_content_type(request)
        body = await read_body(request, self.max_body)
        req = oip.decode_request(body, request.header(b"inference-header-content-length"), rt.config)
        deadline = self.deadline(rt, req.timeout_us, request.header(b"x-request-timeout-ms"))
        items = rt.enqueue(req.items, deadline, parse_priority(req.priority, header_priority))
        results: list[ItemResult] = await wait_for_items(rt, items, deadline, self.clock, request)
        record = lifecycle(results)
        out, header_len = oip.encode_response(
            rt.config, results[0].version, req.request_id, req.outputs, [r.outputs for r in results], record
        )
        headers = lifecycle_headers(record)
        if header_len is None:
            return json_response(out, headers=headers)
        headers.append((b"inference-header-content-length", str(header_len).encode()))
        return HttpResponse(out, 200, b"application/octet-stream", headers)

    async def embeddings(self, request: HttpRequest) -> HttpResponse:
        return await self.guard(
            request, None, lambda r: openai_routes.embeddings(self, r), error_body=openai_routes.openai_error
        )

    # ---- text generation (LLM models): JSON or Server-Sent Events -----------------------------------
    async def completions(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        return await self.guard(
            request,
            None,
            lambda r: completion_routes.completions(self, r),
            error_body=openai_routes.openai_error,
        )

    async def chat_completions(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        return await self.guard(
            request,
            None,
            lambda r: completion_routes.chat_completions(self, r),
            error_body=openai_routes.openai_error,
        )

    # ---- shared -------------------------------------------------------------------------------------
    def text_model(self, request: HttpRequest, name: str) -> LLMRuntime | UpstreamRuntime:
        """The LLM or upstream model `name` for the OpenAI text routes (api.context.ApiContext)."""
        server = self.server
        rt = server.llm_runtimes.get(name) or server.upstreams.get(name)
        if rt is not None:
            return rt
        text_models = sorted({*server.llm_runtimes, *server.upstreams})
        if name in server.runtimes:
            raise BadRequest(f"model {name!r} does not generate text; text models: {text_models}")
        raise NotFound(f"unknown model {name!r}; text models served: {text_models}")

    def _runtime(self, request: HttpRequest) -> ModelRuntime:
        return self.server.runtime(request.path_params["model"], request.path_params.get("version"))

    def deadline(self, rt: ModelRuntime, timeout_us: float | None, header_ms: str | None) -> float | None:
        timeout_ms: float | None = rt.config.default_timeout_ms
        if timeout_us is not None:
            timeout_ms = timeout_us / 1000.0
        elif header_ms is not None:
            try:
                timeout_ms = float(header_ms)
            except ValueError:
                raise BadRequest(
                    f"X-Request-Timeout-Ms must be a number of milliseconds, got {header_ms!r}"
                ) from None
        if timeout_ms is None:
            return None
        if not 0 < timeout_ms <= rt.config.max_timeout_ms:
            raise BadRequest(f"timeout of {timeout_ms} ms is outside (0, {rt.config.max_timeout_ms}] ms")
        return self.clock.now() + timeout_ms / 1000.0

    async def guard(
        self,
        request: HttpRequest,
        rt: ModelRuntime | None,
        handler: Callable[[HttpRequest], Awaitable[HttpResponse]],
        error_body: ErrorBody = oip_error,
    ) -> HttpResponse:
        """Run a handler; turn errors into responses; count the outcome and time it.
        Handlers that learn their model late (from the body) put it in request.scope['inferd.runtime']."""
        start = self.clock.now()
        try:
            response = await handler(request)
            outcome = "ok"
        except ServingError as exc:
            status, outcome = status_of(exc)
            response = json_response(error_body(exc, status), status, error_headers(exc))
            rt = rt or request.scope.get("inferd.runtime")
            if rt is not None and status == 429:
                rt.metrics.rejected(getattr(exc, "reason", "rate_limited"))
        except ClientGone:
            outcome = "cancelled"
            response = HttpResponse(status=499, content_type=None)
        except Exception as exc:  # never a traceback to the caller: an error id they can quote
            error_id = f"{id(exc):x}"
            log.exception("internal error %s on %s %s", error_id, request.method, request.path)
            outcome = "internal"
            response = json_response(error_body(Internal(f"internal error (id {error_id})"), 500), 500)
        duration = self.clock.now() - start
        rt = rt or request.scope.get("inferd.runtime")
        if rt is not None:
            rt.metrics.observe_request(outcome, duration)
        if self.access_log:
            self._log_access(request, response, outcome, duration)
        return response

    def _log_access(
        self, request: HttpRequest, response: HttpResponse, outcome: str, duration: float
    ) -> None:
        def h(name: bytes) -> str:
            value = response.header(name)
            return value.decode() if value else "-"

        access_log.info(
            "%s %s status=%d outcome=%s ms=%.2f queue_ms=%s batch_id=%s batch_size=%s compute_ms=%s attempts=%s",
            request.method,
            request.path,
            response.status,
            outcome,
            duration * 1000,
            h(b"x-inferd-queue-ms"),
            h(b"x-inferd-batch-id"),
            h(b"x-inferd-batch-size"),
            h(b"x-inferd-compute-ms"),
            h(b"x-inferd-attempts"),
        )
