"""The repository API (Triton's extension) over REST, and what its gRPC twin (grpc_edge/repository.py)
shares with it: who calls (gateway/auth.py `controller`), Triton's overrides refused, and the model
control underneath (fleet/model_control.py).

    POST /v2/repository/index                  {"ready": bool} (optional) -> [{name, version, state, reason}]
    POST /v2/repository/models/{m}/load        {"parameters": {...}} (optional) -> 200 once served
    POST /v2/repository/models/{m}/unload      {"parameters": {"unload_dependents": bool}} -> 200 once drained

Load and unload need the admin token (when one is set) or a tenant whose table sets `model_control =
true` (403 otherwise); the index lists the caller's models only. A load's `parameters.config` or `file:`
parameters (Triton's overrides of the repository) are refused with 400: models load from the repository.
A load whose body is over the routes' limit (a file override carries a whole file) is refused by the
overrides its keys name in the part read (400), else 413.

With several front ends, a load or an unload runs on the holder of the `decider` lease, for all of them
(fleet/control_share.py): any other front end checks the caller and the parameters, forwards it over the
front ends' channel (frontends/channel.py, kind KIND) and answers with its answer (its error included);
503 with Retry-After while that front end does not answer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import msgspec

from inferd.api.asgi import HttpRequest, HttpResponse
from inferd.api.http import json_response, read_body, read_head
from inferd.api.http_call import presented_key
from inferd.api.server_view import ServerView
from inferd.core.call import Call, ErrorBody
from inferd.errors import BadRequest, Forbidden, PayloadTooLarge, ServingError, WorkerUnavailable, from_wire
from inferd.fleet.repository_index import IndexRow
from inferd.frontends.channel import PeerUnreachable
from inferd.gateway.auth import Controller, controller

log = logging.getLogger("inferd.fleet")

INDEX = "/v2/repository/index"
LOAD = "/v2/repository/models/{model}/load"
UNLOAD = "/v2/repository/models/{model}/unload"
_LIMIT = 1 << 20
"""The largest body a repository route reads (its parameters are small; Triton's file overrides are
refused, from the keys in the body's first _LIMIT bytes when it is longer)."""
_OVERRIDE_KEY = re.compile(rb'"(config|file:[^"\\]*)"\s*:')
"""A JSON key naming one of Triton's overrides (an escaped quote inside a string never ends one)."""
KIND = "model-control"
"""The front ends' channel's request kind of a load or unload forwarded to the lease's holder."""
AWAY_RETRY_AFTER_S = 1.0


class IndexRequest(msgspec.Struct):
    ready: bool = False
    repository_name: str = ""


class ControlRequest(msgspec.Struct):
    parameters: dict[str, Any] = {}


class Order(msgspec.Struct, frozen=True):
    """A load or unload forwarded to the front end that decides for the server."""

    op: str
    """"load" or "unload"."""
    model: str


class Answer(msgspec.Struct, frozen=True):
    error: tuple[str, str] | None = None
    """(code, message) of the error it failed with (None: done)."""
    retry_after_s: float | None = None


class Repository:
    """The three operations, whatever the edge: the edge reads the caller's key and the request."""

    def __init__(self, server: ServerView) -> None:
        self.server = server
        self.control = server.model_control
        self.peers = server.peers
        """The other front ends (None: none): a load or unload runs on the lease's holder."""
        self.forward_timeout_s = 3 * server.config.worker_start_timeout_s + 60  # a load, an unload's drain
        if self.peers is not None:
            self.peers.channel.handle(KIND, self.answer, self.forward_timeout_s)

    def caller(self, call: Call, credential: str | None) -> Controller:
        """Who calls, from the key it presented: recorded as the call's tenant."""
        token = self.server.config.admin_token
        found = controller(self.server.gateway.current(), token.get_secret_value() if token else None, credential)
        call.tenant = found.tenant
        return found

    def index(self, who: Controller, ready_only: bool) -> list[IndexRow]:
        return self.control.index(who.tenant.may_call, ready_only)

    async def load(self, who: Controller, model: str, parameters: Iterable[str]) -> None:
        self._may_control(who, model)  # first: a caller that may not load learns nothing more (403)
        check_parameters(parameters)
        await self.carry_out(Order("load", model))

    def refuse_oversized(self, who: Controller, model: str, head: bytes) -> NoReturn:
        """A load whose body is over the limit, of which `head` was read: refused as its parameters would
        be (403 first, then the overrides its keys name: 400), else 413."""
        self._may_control(who, model)
        check_parameters(m.decode("utf-8", "replace") for m in _OVERRIDE_KEY.findall(head))
        raise PayloadTooLarge(f"load request body exceeds the limit of {_LIMIT} bytes")

    async def unload(self, who: Controller, model: str) -> None:
        self._may_control(who, model)
        await self.carry_out(Order("unload", model))

    async def carry_out(self, order: Order) -> None:
        """Here, or on the front end that holds the `decider` lease (its answer, its error included)."""
        to = None if self.peers is None else await self.server.cluster.decider_id()
        if self.peers is None or to is None:  # here (without the lease, model control refuses it: 503)
            await self.run(order)
            return
        address = self.peers.address(to)
        try:
            if address is None:
                raise PeerUnreachable("its record names no address to reach it by from here")
            payload = msgspec.msgpack.encode(order)
            raw = await self.peers.channel.ask_watched(address, KIND, payload, self.forward_timeout_s)
            answer = msgspec.msgpack.decode(raw, type=Answer)
        except (PeerUnreachable, msgspec.DecodeError) as exc:
            raise WorkerUnavailable(
                f"model {order.model!r}: front end {to!r} loads and unloads models for the server, and it did "
                f"not answer ({exc}); retry shortly",
                AWAY_RETRY_AFTER_S,
            ) from None
        if answer.error is not None:
            raise from_wire(*answer.error, answer.retry_after_s)

    async def run(self, order: Order) -> None:
        if order.op not in ("load", "unload"):
            raise BadRequest(f"unknown model control operation {order.op!r}")
        await (self.control.load if order.op == "load" else self.control.unload)(order.model)

    async def answer(self, payload: bytes) -> bytes:
        """A load or unload another front end forwarded here (it checked the caller)."""
        order = msgspec.msgpack.decode(payload, type=Order)
        log.info("model %s: %s forwarded here by another front end", order.model, order.op)
        try:
            await self.run(order)
        except ServingError as exc:
            return msgspec.msgpack.encode(Answer((exc.code, exc.message), getattr(exc, "retry_after_s", None)))
        except Exception as exc:  # a bug: the asking front end's client gets a 500 that names it, as here
            log.exception("forwarded %s of model %s failed", order.op, order.model)
            return msgspec.msgpack.encode(Answer(("Internal", f"{type(exc).__name__}: {exc}")))
        return msgspec.msgpack.encode(Answer())

    def _may_control(self, who: Controller, model: str) -> None:
        if not who.may_control:
            raise Forbidden(who.why_not)
        if not who.tenant.may_call(model):
            raise Forbidden(f"tenant {who.tenant.name!r} may not call model {model!r}, nor load or unload it")


def check_parameters(names: Iterable[str]) -> None:
    """Triton's overrides of the repository (`config`, `file:<path>`) are refused: BadRequest naming them."""
    refused = sorted(n for n in names if n == "config" or n.startswith("file:"))
    if refused:
        raise BadRequest(
            f"load parameters {refused} are not supported: inferd loads models from the repository only "
            "(edit the model's folder, then load it again)"
        )


_index_request = msgspec.json.Decoder(IndexRequest)
_control_request = msgspec.json.Decoder(ControlRequest)
_encoder = msgspec.json.Encoder()


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes, what: str) -> Any:
    try:
        return decoder.decode(body if body.strip() else b"{}")
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{what}: {exc}") from None


def add_repository_routes(add: Callable[[str, str, Any, ErrorBody], None], server: ServerView, errors: ErrorBody) -> None:
    """The three routes, through `add` (api/app.py's: the whole chain, then the handler)."""
    repo = Repository(server)

    async def index(call: Call, request: HttpRequest) -> HttpResponse:
        who = repo.caller(call, presented_key(request))
        body = _decode(_index_request, await read_body(request, _LIMIT), "repository index request")
        return json_response(_encoder.encode(repo.index(who, body.ready)))  # dataclass rows: JSON objects

    async def load(call: Call, request: HttpRequest) -> HttpResponse:
        who = repo.caller(call, presented_key(request))
        head, whole = await read_head(request, _LIMIT)
        if not whole:  # a file override's content: its key is in the head
            repo.refuse_oversized(who, request.path_params["model"], head)
        body = _decode(_control_request, head, "load request")
        await repo.load(who, request.path_params["model"], body.parameters)
        return json_response(b"{}")

    async def unload(call: Call, request: HttpRequest) -> HttpResponse:
        who = repo.caller(call, presented_key(request))
        _decode(_control_request, await read_body(request, _LIMIT), "unload request")
        await repo.unload(who, request.path_params["model"])
        return json_response(b"{}")

    add("POST", INDEX, index, errors)
    add("POST", LOAD, load, errors)
    add("POST", UNLOAD, unload, errors)
