"""The search API (JSON): indexes, their documents, and search. Each handler reads top to bottom:
parse -> the index's service (kinds/search/service.py) or administration (kinds/search/indexes.py) -> encode.

    PUT    /v1/indexes/{name}                  create, or verify the settings (201 / 200 / 409)
    GET    /v1/indexes                         every index
    GET    /v1/indexes/{name}                  documents, shards, replicas, applied_seq per shard, ...
    DELETE /v1/indexes/{name}
    POST   /v1/indexes/{name}/documents        {"documents": [{id, text, title, fields}]} -> {"seq": [...]}
    GET    /v1/indexes/{name}/documents/{id}
    DELETE /v1/indexes/{name}/documents/{id}
    POST   /v1/indexes/{name}/search           {"query", "k", "mode", "filter", "timeout_ms"}

With several front ends (`--frontends N`, or front ends on many hosts sharing a store), a document write
runs on the front end that writes the index (the holder of its writer lease), an index created or
deleted on the holder of the `decider` lease; any other front end forwards it there
(frontends/search_writes.py), which runs it as here, and answers with its answer. The forwarding front
end first parses a write's body as the writer does (`check`, the same functions): a bad body is its own
400, never forwarded; the writer parses it again, as the authority.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from inferd.api.asgi import HttpRequest, HttpResponse
from inferd.api.http import check_content_type, json_response, read_body
from inferd.api.http_call import Hints
from inferd.cluster.lease import LEASE
from inferd.cluster.served import changes
from inferd.cluster.store import StoreError
from inferd.core.call import Call
from inferd.errors import BadRequest, WorkerUnavailable
from inferd.frontends.search_writes import (
    FORWARD_TIMEOUT_S,
    HERE,
    INDEX_OPS,
    KIND,
    Forwarder,
    Nobody,
    Write,
    WriteDesk,
    Writer,
    forwarded_writes,
    refusal,
    route_document,
    route_index_op,
)
from inferd.gateway.auth import allowed_models, check_model
from inferd.kinds.search.config import SearchParams, parse_params
from inferd.kinds.search.indexes import IndexAdmin, worker_cap
from inferd.kinds.search.kind import API
from inferd.kinds.search.requests import json_object, parse_documents, parse_search
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.writers import RECORD_PREFIX, writer_lease

log = logging.getLogger("inferd.search")

Add = Callable[..., None]
"""api/app.py's: (method, path, handler(call, request), [error body, hints])."""
SEARCH = Hints(priority=False, tenant=False)
"""A search reads X-Request-Timeout-Ms of the caller's wishes (no priority class, no tenant lane)."""
_json = msgspec.json.Encoder()
GET_TIMEOUT_S = 5.0


def add_search_routes(add: Add, server: Any) -> None:
    routes = SearchRoutes(server)
    add("PUT", "/v1/indexes/{name}", routes.put_index)
    add("GET", "/v1/indexes", routes.list_indexes)
    add("GET", "/v1/indexes/{name}", routes.get_index)
    add("DELETE", "/v1/indexes/{name}", routes.delete_index)
    add("POST", "/v1/indexes/{name}/documents", routes.post_documents)
    add("GET", "/v1/indexes/{name}/documents/{id}", routes.get_document)
    add("DELETE", "/v1/indexes/{name}/documents/{id}", routes.delete_document)
    add("POST", "/v1/indexes/{name}/search", routes.search, hints=SEARCH)


class SearchRoutes:
    def __init__(self, server: Any) -> None:
        self.server = server
        self.admin = IndexAdmin(server, IndexStore(server.config.data_dir), worker_cap(os.cpu_count()))
        self.max_body = server.config.max_body_bytes
        peers = server.peers
        self.forwarder = None if peers is None else Forwarder(peers.channel.ask_watched, peers.address)
        """Other front ends: a write goes to the one that runs it (frontends/search_writes.py); None: this
        one alone runs every write."""
        if peers is not None:
            desk = WriteDesk(self.run_forwarded, forwarded_writes(server.metrics.registry))
            peers.channel.handle(KIND, desk.answer, FORWARD_TIMEOUT_S)

    def indexes(self) -> list[str]:
        """The served models of the kinds that come in on these routes (`Kind.api`)."""
        return self.server.registry.names(self.server.kinds.serving(API))

    def index(self, call: Call, request: HttpRequest) -> Any:
        """The index the path names (404 when unknown; 403 outside the caller's tenant)."""
        name = request.path_params["name"]
        check_model(call.tenant, name, self.indexes)
        rt = self.admin.find(name)
        call.runtime = rt
        return rt

    async def body(self, request: HttpRequest) -> bytes:
        check_content_type(request, ("application/json", ""))
        return await read_body(request, self.max_body)

    # ---- indexes -------------------------------------------------------------------------------------
    async def put_index(self, call: Call, request: HttpRequest) -> HttpResponse:
        name = request.path_params["name"]
        check_model(call.tenant, name, lambda: [name])  # a tenant creates only names it may use
        answer = await self.write(Write("create", name, body=await self.body(request)))
        call.runtime = self.server.registry.get(name) if name in self.server.registry else None
        return answer

    async def list_indexes(self, call: Call, request: HttpRequest) -> HttpResponse:
        names = allowed_models(call.tenant, self.indexes())
        return _answer({"indexes": [describe(self.server.registry.get(n)) for n in names]})

    async def get_index(self, call: Call, request: HttpRequest) -> HttpResponse:
        return _answer(describe(self.index(call, request)))

    async def delete_index(self, call: Call, request: HttpRequest) -> HttpResponse:
        rt = self.index(call, request)
        return await self.write(Write("drop", rt.name))

    # ---- documents -----------------------------------------------------------------------------------
    async def post_documents(self, call: Call, request: HttpRequest) -> HttpResponse:
        rt = self.index(call, request)
        return await self.write(Write("upsert", rt.name, body=await self.body(request)), rt)

    async def get_document(self, call: Call, request: HttpRequest) -> HttpResponse:
        rt = self.index(call, request)
        doc = await rt.index.get(request.path_params["id"], rt.clock.now() + GET_TIMEOUT_S)
        return _answer({"id": doc.id, "text": doc.text, "title": doc.title, "fields": doc.fields})

    async def delete_document(self, call: Call, request: HttpRequest) -> HttpResponse:
        rt = self.index(call, request)
        return await self.write(Write("delete", rt.name, key=request.path_params["id"]), rt)

    async def write(self, write: Write, rt: Any = None) -> HttpResponse:
        """Run a write here, or have the front end that runs it run it and answer as it did."""
        forwarder = self.forwarder
        to = HERE if forwarder is None else await self.route(write, rt)
        if forwarder is None or to == HERE:
            body, created = await self.execute(write)
            return json_response(body, 201 if created else 200)
        check(write, rt)  # a bad body is a 400 here: it is never forwarded
        if isinstance(to, Nobody):
            raise refusal(to)
        body, created = await forwarder.forward(write, to)
        if rt is not None:  # a document write: read-your-writes here too
            await rt.index.forwarded(msgspec.json.decode(body)["seq"])
        else:  # an index created or deleted: served here as where it ran before the answer
            await self.server.index_sync.refresh()
        return json_response(body, 201 if created else 200)

    async def route(self, write: Write, rt: Any) -> str | Nobody:
        """Where `write` runs: HERE, another front end's id, or Nobody (frontends/search_writes.py)."""
        me = self.server.cluster.me
        if write.op in INDEX_OPS:
            if self.server.index_sync is None:  # indexes not shared: each front end has its own
                return HERE
            return route_index_op(await self.decider(), me)
        writer = self.writer_of(rt)
        to = route_document(write, writer, me)
        # none known here: the store's word now (a writer new since its last try), unless this front end
        # holds the lease and takes the index over (the store names this one: no round trip per write)
        if isinstance(to, Nobody) and writer.taking_over() is None:
            with changes():
                grant = await self.server.cluster.store.holder(writer_lease(write.index))
            if grant is not None and grant.holder != me:
                return str(grant.holder)
        return to

    def writer_of(self, rt: Any) -> Writer:
        """Who writes the index of `rt` (kinds/search/writers.py)."""
        return rt.writer

    async def decider(self) -> str | None:
        """The id of the front end that holds the `decider` lease (it creates and deletes indexes):
        this one's while it acts as the holder; None while none does. ClusterUnavailable (503) when the
        store does not answer."""
        cluster = self.server.cluster
        if cluster.versions.holds():
            return str(cluster.me)
        with changes():
            grant = await cluster.store.holder(LEASE)
        if grant is None or grant.holder == cluster.me:  # (ours, while we do not act on it: lapsed)
            return None
        return str(grant.holder)

    async def run_forwarded(self, write: Write) -> tuple[bytes, bool]:
        """A write another front end forwarded here: run, or refused (503, Retry-After) when this front
        end does not run it (any more: the lease moved meanwhile). It is never forwarded again."""
        rt = None if write.op in INDEX_OPS else self.admin.find(write.index)
        to = await self.route(write, rt)
        if to != HERE:
            what = "hold the lease of the server's decisions" if rt is None else f"write index {write.index!r}"
            retry = to.retry_after_s if isinstance(to, Nobody) else 1.0
            raise WorkerUnavailable(f"front end {self.server.cluster.me!r} does not {what} now: retry shortly", retry)
        return await self.execute(write)

    async def execute(self, write: Write) -> tuple[bytes, bool]:
        """A write on the front end that runs it: (the answer's JSON body, whether it created)."""
        if write.op == "create":
            return await self._create(write.index, write.body)
        rt = self.admin.find(write.index)
        if write.op == "drop":
            await self.admin.delete(rt.name)
            await self._forget_writer(rt.name)
            return _json.encode({"deleted": rt.name}), False
        if write.op == "upsert":
            docs = parse_documents(write.body, rt.params.fields)  # as `check` does before forwarding
            seq = await rt.index.upsert(docs)
            return _json.encode({"seq": seq, "documents": len(docs)}), False
        if write.op == "delete":
            await rt.index.get(write.key, rt.clock.now() + GET_TIMEOUT_S)  # 404 when there is none
            return _json.encode({"seq": await rt.index.delete(write.key), "deleted": write.key}), False
        raise BadRequest(f"unknown search write {write.op!r}")

    async def _forget_writer(self, name: str) -> None:
        """A deleted index's record of its last writer goes with it (kinds/search/writers.py): an index
        created again under its name starts afresh, never held back waiting for the old one's replicas."""
        try:
            await self.server.cluster.store.delete(f"{RECORD_PREFIX}{name}")
        except StoreError as exc:
            log.warning("index %s: its last writer's record could not be removed (%s)", name, exc)

    async def _create(self, name: str, body: bytes) -> tuple[bytes, bool]:
        created = await self.admin.create(name, index_settings(name, body))
        return _json.encode(describe(self.server.registry.get(name))), created

    # ---- search --------------------------------------------------------------------------------------
    async def search(self, call: Call, request: HttpRequest) -> HttpResponse:
        rt = self.index(call, request)
        req = parse_search(await self.body(request), rt.params.fields, rt.params.shards, call.timeout_ms)
        call.deadline = search_deadline(rt.clock.now(), req.timeout_ms)
        return _answer(await rt.index.search(req))


def search_deadline(now: float, timeout_ms: float) -> float:
    """A search's deadline on the server's clock: its time (the smaller of the body's timeout_ms and
    X-Request-Timeout-Ms, kinds/search/requests.py `parse_search`) from `now`."""
    return now + timeout_ms / 1000.0


def check(write: Write, rt: Any) -> None:
    """A write's body parsed as `execute` parses it (BadRequest, PayloadTooLarge naming the problem):
    what a front end does before forwarding. `rt`: the index of a document write."""
    if write.op == "upsert":
        parse_documents(write.body, rt.params.fields)
    elif write.op == "create":
        index_settings(write.index, write.body)


def index_settings(name: str, body: bytes) -> SearchParams:
    """The settings of index `name` to create, from the PUT's body (BadRequest naming the problem)."""
    raw = json_object(body, "index settings")
    params = parse_params(raw.get("settings", raw), f"settings of index {name!r}")
    if not _valid_name(name):
        raise BadRequest(f"index name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return params


def describe(rt: Any) -> dict[str, Any]:
    """An index as GET /v1/indexes/{name} shows it."""
    stats = rt.statistics().detail
    shards = stats.shards
    return {
        "name": rt.name,
        "ready": rt.ready,
        "documents": sum(s.documents for s in shards),
        "shards": rt.params.shards,
        "replicas": rt.params.replicas,
        "applied_seq": [s.applied_seq for s in shards],
        "seq": [s.durable_seq for s in shards],
        "serving_replicas": [s.serving for s in shards],
        "workers": [
            [
                {"worker": r.worker_id, "pid": r.pid, "phase": r.phase, "applied_seq": r.applied_seq}
                for r in s.replicas
            ]
            for s in shards
        ],
        "embedder": {"model": rt.params.embedder, "state": stats.service.embedder, **_versions(stats)},
        "hedge": {"requests": stats.service.hedge.requests, "hedges": stats.service.hedge.hedges},
        "settings": rt.params.model_dump(),
    }


def _versions(stats: Any) -> dict[str, Any]:
    """The embedder version of the index's vectors, and a running re-embed (kinds/search/reembed.py)."""
    re = stats.service.reembed
    if re is None:
        return {}
    running = None if re.target is None else {"to": re.target, "documents": re.reembedded}
    return {"version": re.version, "reembedding": running}


def _answer(body: dict[str, Any], status: int = 200) -> HttpResponse:
    return json_response(_json.encode(body), status)


def _valid_name(name: str) -> bool:
    return (
        0 < len(name) <= 64
        and name[0].isalnum()
        and all(c.isalnum() or c in "_.-" for c in name)
        and name.isascii()
    )
