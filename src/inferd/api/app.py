"""The HTTP front end. Each handler reads top to bottom: parse -> submit -> encode.

Routes: OIP v2 (health, metadata, infer with Triton's binary extension), OpenAI /v1/embeddings and
/v1/models, /metrics, /openapi.json.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from inferd import __version__
from inferd.api import binary, oip
from inferd.api import openai as openai_routes
from inferd.api.errors import error_headers, status_of
from inferd.api.http import ClientGone, check_content_type, json_response, read_body, wait_for_items
from inferd.api.openapi import openapi_document
from inferd.batching.dispatcher import ItemResult, ModelRuntime
from inferd.errors import BadRequest, Internal, ServingError
from inferd.server import InferenceServer

log = logging.getLogger("inferd.api")
access_log = logging.getLogger("inferd.access")

Handler = Callable[[Request], Awaitable[Response]]


def create_app(server: InferenceServer) -> Starlette:
    api = Api(server)

    @asynccontextmanager
    async def lifespan(_app: Starlette):  # noqa: ANN202
        async with server.running():
            yield

    routes = [
        Route("/v2/health/live", api.live, methods=["GET"]),
        Route("/v2/health/ready", api.ready, methods=["GET"]),
        Route("/v2", api.server_metadata, methods=["GET"]),
        Route("/v2/models/{model}", api.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}", api.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/ready", api.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", api.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/infer", api.infer, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", api.infer, methods=["POST"]),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def lifecycle(results: list[ItemResult]) -> dict[str, Any]:
    """The per-request lifecycle record: queue wait, batch id and size, compute time, attempts."""
    first = results[0]
    if len(results) == 1:
        return {"queue_ms": round(first.queue_s * 1000, 3), "batch_id": first.batch_id,
                "batch_size": first.batch_size, "compute_ms": round(first.compute_s * 1000, 3),
                "attempts": first.attempts}
    batches = list(dict.fromkeys(r.batch_id for r in results))[:8]
    sizes = list(dict.fromkeys(r.batch_size for r in results))[:8]
    return {"queue_ms": round(max(r.queue_s for r in results) * 1000, 3),
            "batch_id": ",".join(map(str, batches)), "batch_size": ",".join(map(str, sizes)),
            "compute_ms": round(max(r.compute_s for r in results) * 1000, 3),
            "attempts": max(r.attempts for r in results)}


def lifecycle_headers(record: dict[str, Any]) -> dict[str, str]:
    return {
        "x-inferd-queue-ms": str(record["queue_ms"]),
        "x-inferd-batch-id": str(record["batch_id"]),
        "x-inferd-batch-size": str(record["batch_size"]),
        "x-inferd-compute-ms": str(record["compute_ms"]),
        "x-inferd-attempts": str(record["attempts"]),
    }


class Api:
    def __init__(self, server: InferenceServer) -> None:
        self.server = server
        self.clock = server.clock
        self.max_body = server.config.max_body_bytes
        self.access_log = server.config.access_log

    # ---- health and metadata ----------------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.server.ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return json_response(oip.encode_json(
            {"name": "inferd", "version": __version__, "extensions": ["binary_tensor_data"]}))

    async def model_metadata(self, request: Request) -> Response:
        return await self._guard(request, None, self._model_metadata)

    async def _model_metadata(self, request: Request) -> Response:
        rt = self._runtime(request)
        return json_response(oip.encode_json(oip.model_metadata(rt.config, rt.served_version)))

    async def model_ready(self, request: Request) -> Response:
        return await self._guard(request, None, self._model_ready)

    async def _model_ready(self, request: Request) -> Response:
        rt = self._runtime(request)
        return Response(status_code=200 if rt.ready and not self.server.shutting_down else 503)

    async def list_models(self, request: Request) -> Response:
        return await openai_routes.list_models(self.server)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return json_response(oip.encode_json(openapi_document()))

    # ---- inference ----------------------------------------------------------------------------------
    async def infer(self, request: Request) -> Response:
        name = request.path_params["model"]
        rt = self.server.runtimes.get(name)
        return await self._guard(request, rt, self._infer)

    async def _infer(self, request: Request) -> Response:
        rt = self._runtime(request)
        rt.precheck()  # 503 / 429 decided before the body is read
        check_content_type(request)
        body = await read_body(request, self.max_body)
        req = oip.decode_request(body, request.headers.get(binary.HEADER), rt.config)
        deadline = self._deadline(rt, req.timeout_us, request.headers.get("x-request-timeout-ms"))
        items = rt.enqueue(req.items, deadline)
        results: list[ItemResult] = await wait_for_items(rt, items, deadline, self.clock, request)
        record = lifecycle(results)
        out, header_len = oip.encode_response(rt.config, results[0].version, req.request_id, req.outputs,
                                              [r.outputs for r in results], record)
        headers = lifecycle_headers(record)
        if header_len is None:
            return json_response(out, headers=headers)
        headers[binary.HEADER] = str(header_len)
        return Response(out, headers=headers, media_type="application/octet-stream")

    async def embeddings(self, request: Request) -> Response:
        return await openai_routes.embeddings(self, request)

    # ---- shared -------------------------------------------------------------------------------------
    def _runtime(self, request: Request) -> ModelRuntime:
        return self.server.runtime(request.path_params["model"], request.path_params.get("version"))

    def _deadline(self, rt: ModelRuntime, timeout_us: float | None, header_ms: str | None) -> float | None:
        timeout_ms: float | None = rt.config.default_timeout_ms
        if timeout_us is not None:
            timeout_ms = timeout_us / 1000.0
        elif header_ms is not None:
            try:
                timeout_ms = float(header_ms)
            except ValueError:
                raise BadRequest(f"X-Request-Timeout-Ms must be a number of milliseconds, got {header_ms!r}") from None
        if timeout_ms is None:
            return None
        if not 0 < timeout_ms <= rt.config.max_timeout_ms:
            raise BadRequest(f"timeout of {timeout_ms} ms is outside (0, {rt.config.max_timeout_ms}] ms")
        return self.clock.now() + timeout_ms / 1000.0

    async def _guard(self, request: Request, rt: ModelRuntime | None, handler: Handler,
                     error_body: Callable[[ServingError, int], bytes] | None = None) -> Response:
        """Run a handler; turn errors into responses; count the outcome and time it."""
        start = self.clock.now()
        try:
            response = await handler(request)
            outcome = "ok"
        except ServingError as exc:
            status, outcome = status_of(exc)
            body = error_body(exc, status) if error_body else oip.encode_json({"error": exc.message})
            response = json_response(body, status, error_headers(exc))
            if rt is not None and status == 429:
                rt.metrics.rejected(getattr(exc, "reason", "rate_limited"))
        except ClientGone:
            outcome = "cancelled"
            response = Response(status_code=499)
        except Exception as exc:  # never a traceback to the caller: an error id they can quote
            error_id = f"{id(exc):x}"
            log.exception("internal error %s on %s %s", error_id, request.method, request.url.path)
            exc = Internal(f"internal error (id {error_id})")
            outcome = "internal"
            body = error_body(exc, 500) if error_body else oip.encode_json({"error": exc.message})
            response = json_response(body, 500)
        duration = self.clock.now() - start
        if rt is not None:
            rt.metrics.observe_request(outcome, duration)
        if self.access_log:
            access_log.info("%s %s %d %s %.2fms %s", request.method, request.url.path, response.status_code,
                            outcome, duration * 1000, response.headers.get("x-inferd-batch-id", "-"))
        return response
