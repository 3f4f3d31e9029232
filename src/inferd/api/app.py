"""The HTTP front end. Each handler reads top to bottom: parse -> submit -> encode.

Routes: OIP v2 (health, metadata, infer with Triton's binary extension, the repository extension:
api/repository.py), OpenAI /v1/embeddings and /v1/models, /metrics, /openapi.json.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import cast

from prometheus_client import CONTENT_TYPE_LATEST

from inferd.api import completions as completion_routes
from inferd.api import oip
from inferd.api import openai as openai_routes
from inferd.api.asgi import AsgiApp, HttpRequest, HttpResponse, Response, Router
from inferd.api.cache_hook import CacheResult
from inferd.api.console import ConsoleAccess, add_console_routes
from inferd.api.http import check_content_type, json_response, parse_priority, read_body, request_deadline
from inferd.api.http_call import MODEL_WORK, Hints, http_call, read_hints
from inferd.api.middleware import AccessLog, Accounting, Errors, ModelVersion
from inferd.api.oip_answer import Inference, OipSource, fallback_headers, lifecycle_headers, oip_answer
from inferd.api.oip_metadata import HTTP, model_metadata, server_metadata
from inferd.api.openapi import openapi_document
from inferd.api.repository import add_repository_routes
from inferd.api.request_context import RequestContext
from inferd.api.search_routes import add_search_routes
from inferd.api.server_view import ServerView
from inferd.config import ModelConfig
from inferd.core.call import Call, ErrorBody, Layer, chain
from inferd.errors import BadRequest, ServingError
from inferd.gateway.auth import Auth, TenantRequests, allowed_models, check_model, tenant_share
from inferd.gateway.fallback import Fallbacks, falls_back
from inferd.gateway.quota_layer import Quotas
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.observability.logging_setup import accept_request_id, current_request_id
from inferd.runtime.contract import Runtime

log = logging.getLogger("inferd.api")

Route = Callable[[Call, HttpRequest], Awaitable[Response]]
"""A route's handler: the Call the edge read, and the request (for its body, read after the precheck)."""


def oip_error(exc: ServingError, status: int) -> bytes:
    return oip.encode_json({"error": exc.message, "request_id": current_request_id()})


def create_app(server: ServerView, api: Api | None = None) -> AsgiApp:
    """The HTTP app of `server`, over `api` (the runner builds one `Api` for every edge: the gRPC edge
    shares its fallbacks' breakers and its cache; None: one of its own)."""
    api = api if api is not None else Api(server)
    r = Router()
    oai = openai_routes.openai_error

    def add(
        method: str, path: str, handler: Route, errors: ErrorBody = oip_error, hints: Hints | None = None
    ) -> None:
        r.add(method, path, api.endpoint(handler, errors, path, hints))

    add("GET", "/v2/health/live", api.live)
    add("GET", "/v2/health/ready", api.ready)
    add("GET", "/v2", api.server_metadata)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        add("GET", base, api.model_metadata)
        add("GET", base + "/ready", api.model_ready)
        add("POST", base + "/infer", api.infer, hints=MODEL_WORK)
    add("POST", "/v1/embeddings", partial(openai_routes.embeddings, api), oai, MODEL_WORK)
    add("GET", "/v1/models", api.list_models, oai)
    add("POST", "/v1/completions", partial(completion_routes.completions, api), oai, MODEL_WORK)
    add("POST", "/v1/chat/completions", partial(completion_routes.chat_completions, api), oai, MODEL_WORK)
    add_search_routes(add, server)
    add_repository_routes(add, server, oip_error)
    add("GET", "/metrics", api.metrics)
    add("GET", "/openapi.json", api.openapi)
    token = server.config.admin_token.get_secret_value() if server.config.admin_token else None
    add_console_routes(r, server.console, ConsoleAccess(token, lambda: server.gateway.current().enforced))
    log.info(
        "request chain: %s",
        " -> ".join(
            getattr(layer, "__name__", None) or layer.func.__name__  # type: ignore[attr-defined]
            for layer in api.layers
        ),
    )
    return AsgiApp(r, server.running, _not_found)


def _not_found(request: HttpRequest, other_method: bool) -> HttpResponse:
    request_id = accept_request_id(request.header(b"x-request-id"))
    path = request.path
    message = f"method not allowed on {path}" if other_method else f"no route {path}"
    body = oip.encode_json({"error": message, "request_id": request_id})
    return json_response(body, 405 if other_method else 404, [(b"x-request-id", request_id.encode())])


async def _refuse(exc: ServingError, call: Call, request: HttpRequest) -> Response:
    """The handler of a call the edge could not read (a bad header value): its error."""
    raise exc


class HttpOip:
    """An OIP REST request's body (JSON, or Triton's binary extension), read after the precheck."""

    __slots__ = ("body", "header_length", "limit", "request")

    def __init__(self, request: HttpRequest, limit: int) -> None:
        self.request = request
        self.limit = limit
        self.body = b""
        self.header_length: str | None = None

    async def read(self) -> None:
        request = self.request
        check_content_type(request)
        self.body = await read_body(request, self.limit)
        self.header_length = request.header(b"inference-header-content-length")

    def decode(self, config: ModelConfig) -> oip.DecodedRequest:
        return oip.decode_request(self.body, self.header_length, config)


class Api:
    def __init__(self, server: ServerView) -> None:
        self.server = server
        self.registry = server.registry
        self.clock = server.clock
        self.max_body = server.config.max_body_bytes
        self.cache = server.cache
        self.shadows = server.shadows
        self.fallbacks = Fallbacks(self.registry, server.kinds, self.clock, server.metrics.fallback_requests)
        self.tenants_enforced = lambda: server.gateway.current().enforced
        """Whether tenants are configured now: the edge then reads the key, and never X-Tenant."""
        self.layers: list[Layer] = [
            partial(Accounting, metrics=server.metrics, clock=self.clock, observe=server.traffic.observe),
            partial(TenantRequests, counter=server.tenant_requests),
            ModelVersion,
            partial(CacheResult, hook=self.cache),
            Errors,
            partial(Auth, gate=server.gateway.current),
            partial(Quotas, engine=lambda: server.gateway.quotas),
        ]
        """The middleware chain, outermost first (api/middleware.py); quotas, cache and tracing are
        layers of this list, after Auth (which sets call.tenant)."""
        if server.config.access_log:
            sample = server.config.observability.access_log_sample
            self.layers.insert(0, partial(AccessLog, clock=self.clock, sample=sample))
        self.layers.insert(0, RequestContext)

    def endpoint(
        self, handler: Route, error_body: ErrorBody, path: str = "", hints: Hints | None = None
    ) -> Callable[[HttpRequest], Awaitable[Response]]:
        """A route (`path`, its template): each request is read into its Call once (api/http_call.py),
        then passes the whole chain, then `handler`. A bad value of its `hints` headers is refused by the
        same chain (a 400 after auth, in the route's error shape)."""
        run = chain(self.layers, handler)
        enforced = self.tenants_enforced

        async def route(request: HttpRequest) -> Response:
            keys = enforced()
            call = http_call(request, error_body, path, keys)
            if hints is not None:
                try:
                    read_hints(call, request, hints, keys)
                except ServingError as exc:
                    return await chain(self.layers, partial(_refuse, exc))(call, request)
            return await run(call, request)

        return route

    # ---- finding the model that serves a request ---------------------------------------------------
    def resolve(self, call: Call, name: str, metadata: Callable[[bytes], str | None], api: str) -> Runtime:
        """The runtime serving `name` at the version the call asks for (`call.version`; None: the
        default, or a canary or A/B split's choice, which may read the caller's `metadata` by lower-case
        name), if its kind serves this family of routes (`Kind.api`); recorded on the call for
        accounting. Unknown models get a 404 listing every model (with tenants: every model the caller
        may call); a model outside the tenant's list a 403."""
        version = call.version
        tenant = call.tenant
        self.check_served(call, name)
        if version is None:  # a canary or A/B split may send it to another version than the default
            sticky = None if tenant.anonymous else tenant.name
            version = self.server.traffic.choose(name, sticky, metadata)
        rt = call.runtime = self.registry.get(name, version)
        kind = self.server.kinds.get(rt.kind)
        if kind.api != api:
            routes = kind.routes
            raise BadRequest(f"model {name!r} is a {rt.kind} model: send its requests to {routes}")
        return rt

    def check_served(self, call: Call, name: str) -> None:
        """The caller may call `name` and it is served: else 404 (an unloaded model's says so), or 403."""
        if call.tenant.may_call(name):
            self.server.model_control.refuse_unloaded(name)
        check_model(call.tenant, name, self.registry.names)

    def text_model(self, call: Call, name: str, metadata: Callable[[bytes], str | None]) -> Runtime:
        """An LLM or upstream model for the OpenAI text routes (X-Inferd-Model-Version may pin a version)."""
        return self.resolve(call, name, metadata, "text")

    def batch_model(self, call: Call, name: str, metadata: Callable[[bytes], str | None]) -> ModelRuntime:
        return cast(ModelRuntime, self.resolve(call, name, metadata, "oip"))  # the batch kind's runtime

    # ---- health and metadata ----------------------------------------------------------------------
    async def live(self, call: Call, request: HttpRequest) -> HttpResponse:
        return HttpResponse(content_type=None)

    async def ready(self, call: Call, request: HttpRequest) -> HttpResponse:
        return HttpResponse(status=200 if self.server.ready else 503, content_type=None)

    async def server_metadata(self, call: Call, request: HttpRequest) -> HttpResponse:
        return json_response(oip.encode_json(server_metadata(HTTP)))

    async def model_metadata(self, call: Call, request: HttpRequest) -> HttpResponse:
        params = request.path_params  # the version in the path only: X-Inferd-Model-Version is not read
        self.check_served(call, params["model"])
        rt = self.registry.get(params["model"], params.get("version"))
        versions = self.registry.versions(rt.name)
        return json_response(
            oip.encode_json(model_metadata(rt.config, versions, self.server.kinds.get(rt.kind).api == "oip"))
        )

    async def model_ready(self, call: Call, request: HttpRequest) -> HttpResponse:
        params = request.path_params  # the version in the path only
        self.check_served(call, params["model"])
        rt = self.registry.get(params["model"], params.get("version"))
        ready = rt.ready and not self.server.shutting_down
        return HttpResponse(status=200 if ready else 503, content_type=None)

    async def list_models(self, call: Call, request: HttpRequest) -> HttpResponse:
        names = allowed_models(call.tenant, self.registry.names())
        return openai_routes.list_models(names, self.server.started_at)

    async def metrics(self, call: Call, request: HttpRequest) -> HttpResponse:
        body = await self.server.metrics_text()
        return HttpResponse(body, content_type=CONTENT_TYPE_LATEST.encode())

    async def openapi(self, call: Call, request: HttpRequest) -> HttpResponse:
        return json_response(oip.encode_json(openapi_document()))

    # ---- inference ----------------------------------------------------------------------------------
    async def infer(self, call: Call, request: HttpRequest) -> HttpResponse:
        model = request.path_params["model"]
        done = await self.run_oip(call, model, request.header, HttpOip(request, self.max_body))
        rt, req = done.runtime, done.request
        out, header_len = oip.encode_response(
            rt.config, done.version, req.request_id, req.outputs, done.rows, done.record
        )
        headers = fallback_headers(rt) if done.fallback else []
        headers += lifecycle_headers(done.record)
        if header_len is None:
            return json_response(out, headers=headers)
        headers.append((b"inference-header-content-length", str(header_len).encode()))
        return HttpResponse(out, 200, b"application/octet-stream", headers)

    async def run_oip(
        self, call: Call, name: str, metadata: Callable[[bytes], str | None], source: OipSource
    ) -> Inference:
        """The one OIP inference path of every edge: the model `name` resolved (canary and A/B splits
        choose by `metadata`, the caller's headers or gRPC metadata), admitted before `source` is read
        (a model without room hands it to its fallback), decoded, answered under the call's deadline
        (through the cache), and mirrored to a shadow. The edge encodes the answer. From its model's
        resolution to its answer it is the work of its model and its fallback (`ModelControl.hold`): an
        unload of either waits for it."""
        primary = self.batch_model(call, name, metadata)
        fallback = self.fallback_for(call, primary)
        control = self.server.model_control
        control.hold(name)
        if fallback is not None:
            control.hold(fallback.name)
        try:
            share = tenant_share(call.tenant)  # call.priority: the edge's (the request may change it)
            # 503 / 429 decided before the body is read; a model that cannot take it hands it to its fallback
            rt, _ = self.fallbacks.admit(primary, fallback, lambda r: r.precheck(call.priority, share))
            call.runtime = rt
            await source.read()
            req = source.decode(rt.config)
            call.deadline = self.deadline(rt, call, req.timeout_us)
            if req.priority is not None:
                call.priority = parse_priority(req.priority, None)
            try:
                version, rows, record = await oip_answer(self.cache, call, rt, req)
            except ServingError as exc:  # refused at enqueue (queue full, deadline unmeetable)
                if rt is not primary or fallback is None or not falls_back(exc):
                    raise
                self.fallbacks.refused(primary, fallback, exc)
                rt = call.runtime = fallback
                req = source.decode(rt.config)
                version, rows, record = await oip_answer(self.cache, call, rt, req)
        finally:
            control.release(name)
            if fallback is not None:
                control.release(fallback.name)
        if rt is not primary:
            record = {**record, "fallback": rt.name}
        elif (shadow := self.shadows.target(rt)) is not None:
            self.shadows.mirror(shadow, rows, partial(self.shadows.copy_items, req.items))
        return Inference(rt, rt is not primary, req, version, rows, record)

    async def answer_with_fallback(
        self, call: Call, primary: Runtime, answer: Callable[[Runtime], Awaitable[Response]]
    ) -> Response:
        """`answer(primary)`, or `answer(fallback)` when the primary refuses it for want of capacity (or
        its breaker is open); a fallback's answer is flagged. For routes that admit in one step. Until
        `answer` returns (a stream: once it started) the call is the work of its model and its fallback
        (`ModelControl.hold`)."""
        fallback = self.fallback_for(call, primary)
        control = self.server.model_control
        control.hold(primary.name)
        if fallback is not None:
            control.hold(fallback.name)
        try:
            if fallback is None:
                return await answer(primary)
            if self.fallbacks.ask_primary(primary, fallback):
                try:
                    response = await answer(primary)
                except ServingError as exc:
                    if not falls_back(exc):
                        raise
                    self.fallbacks.refused(primary, fallback, exc)
                else:
                    self.fallbacks.admitted(primary)
                    return response
            call.runtime = fallback
            response = await answer(fallback)
        finally:
            control.release(primary.name)
            if fallback is not None:
                control.release(fallback.name)
        response.headers.extend(fallback_headers(fallback))
        return response

    def fallback_for(self, call: Call, primary: Runtime) -> Runtime | None:
        """The primary's fallback, if its model has one the caller may call (and it is not being unloaded:
        its new requests are refused, those handed over too)."""
        fallback = self.fallbacks.target(primary)
        if fallback is None or not call.tenant.may_call(fallback.name) or fallback.name in self.server.model_control.unloaded:
            return None
        return fallback

    # ---- shared -------------------------------------------------------------------------------------
    def deadline(self, rt: Runtime, call: Call, timeout_us: float | None = None) -> float | None:
        """The request's absolute deadline: the smaller of the body's `timeout_us` (OIP), the call's
        `timeout_ms` (X-Request-Timeout-Ms) and the deadline its wire carries (`call.deadline`: gRPC's),
        else the model's default_timeout_ms."""
        c = rt.config
        return request_deadline(
            self.clock, c.max_timeout_ms, timeout_us, call.timeout_ms, c.default_timeout_ms, call.deadline
        )
