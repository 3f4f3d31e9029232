"""The HTTP edge reads a request once into its Call (api/http_call.py), and the one deadline rule every
route follows (api/http.py `request_deadline`): when the caller gives two timeouts the smaller wins. A
search sets `call.deadline` too. One tenant per call: the LLM prefix-cache salt and the fairness lane
are both `call.tenant`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.api.asgi import HttpRequest
from inferd.api.completions import CompletionRequest, _TextCall
from inferd.api.http import request_deadline
from inferd.api.http_call import MODEL_WORK, Hints, http_call, read_hints
from inferd.api.peer import AsgiPeer
from inferd.api.search_routes import SearchRoutes
from inferd.clock import FakeClock
from inferd.config.tenants import TenantConfig
from inferd.core.tenant import ANONYMOUS, Tenant
from inferd.errors import BadRequest
from inferd.gateway.auth import tenant_share
from inferd.kinds.llm.placement import Generation
from inferd.routing.fairness import BULK, INTERACTIVE, NO_TENANT, TenantShare
from tests.unit.test_llm_failover import make_runtime

MAX_MS = 600_000.0


def deadline(timeout_us: float | None, header_ms: float | None, default_ms: float | None = 5000.0) -> float | None:
    return request_deadline(FakeClock(0.0), MAX_MS, timeout_us, header_ms, default_ms)


# ---- the one deadline rule -------------------------------------------------------------------------------
def test_the_smaller_of_the_oip_timeout_and_the_header_wins_whichever_it_is() -> None:
    assert deadline(300_000, 1000.0) == pytest.approx(0.3)  # OIP 300 ms against the header's 1 s
    assert deadline(3_000_000, 200.0) == pytest.approx(0.2)  # the header's 200 ms against OIP's 3 s
    assert deadline(250_000, None) == pytest.approx(0.25)
    assert deadline(None, 700.0) == pytest.approx(0.7)


def test_the_models_default_applies_only_when_the_caller_gives_none() -> None:
    assert deadline(None, None) == pytest.approx(5.0)
    assert deadline(None, None, None) is None  # no default (text generation): no deadline
    assert deadline(None, 9000.0) == pytest.approx(9.0)  # a caller may ask for more than the default


def test_each_timeout_given_is_checked_against_the_models_bounds() -> None:
    for timeout_us, header_ms, bad in ((None, 0.0, "0.0"), (-5.0, None, "-0.005"), (1000.0, 600_001.0, "600001.0")):
        with pytest.raises(BadRequest, match=rf"timeout of {bad} ms is outside \(0, 600000.0\] ms"):
            deadline(timeout_us, header_ms)


# ---- the edge --------------------------------------------------------------------------------------------
def request(
    path: str, headers: dict[str, str] | None = None, params: dict[str, str] | None = None, body: bytes = b""
) -> HttpRequest:
    raw = [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return sent.pop(0)

    scope: dict[str, Any] = {"method": "POST", "path": path, "headers": raw}
    return HttpRequest(scope, AsgiPeer(receive), params or {})


def error_body(exc: Any, status: int) -> bytes:
    return b""


def test_the_edge_reads_path_ids_and_trace_context_into_the_call() -> None:
    headers = {"X-Request-Id": "req-1", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "k=v"}
    req = request("/v2/models/sim/versions/2/infer", headers, {"model": "sim", "version": "2"})
    call = http_call(req, error_body, "/v2/models/{model}/versions/{version}/infer", False)
    assert (call.model, call.version, call.request_id) == ("sim", "2", "req-1")
    assert (call.traceparent, call.tracestate) == (headers["traceparent"], "k=v")
    assert (call.method, call.target, call.departure) == ("POST", "/v2/models/sim/versions/2/infer", req.peer)
    assert call.tenant is ANONYMOUS and call.credential is None


def test_the_version_header_applies_only_where_the_path_names_none() -> None:
    pinned = {"X-Inferd-Model-Version": "3"}
    assert http_call(request("/v1/completions", pinned), error_body, "/v1/completions", False).version == "3"
    in_path = request("/v2/models/sim/versions/2/infer", pinned, {"model": "sim", "version": "2"})
    assert http_call(in_path, error_body, "/v2/models/{model}/versions/{version}/infer", False).version == "2"


def test_a_malformed_request_id_is_replaced() -> None:
    call = http_call(request("/v2", {"X-Request-Id": "bad id!"}), error_body, "/v2", False)
    assert call.request_id and call.request_id != "bad id!"


def test_the_hints_of_model_work_are_parsed_once_with_the_400s_naming_them() -> None:
    call = http_call(request("/v1/completions"), error_body, "/v1/completions", False)
    hints = request("/v1/completions", {"X-Priority": "bulk", "X-Request-Timeout-Ms": "250", "X-Tenant": "team-a"})
    read_hints(call, hints, MODEL_WORK, False)
    assert (call.priority, call.timeout_ms, call.tenant.name, call.tenant.anonymous) == (BULK, 250.0, "team-a", True)
    for headers, named in (
        ({"X-Priority": "urgent"}, "priority 'urgent'"),
        ({"X-Request-Timeout-Ms": "soon"}, "X-Request-Timeout-Ms must be a number of milliseconds, got 'soon'"),
        ({"X-Tenant": "t" * 257}, "X-Tenant is 257 characters long; at most 256"),
    ):
        call = http_call(request("/v1/completions"), error_body, "/v1/completions", False)
        with pytest.raises(BadRequest, match=named):
            read_hints(call, request("/v1/completions", headers), MODEL_WORK, False)


def test_a_route_reads_only_the_hints_it_declares() -> None:
    call = http_call(request("/x"), error_body, "/x", False)
    read_hints(call, request("/x", {"X-Priority": "urgent", "X-Tenant": "t"}), Hints(priority=False, tenant=False), False)
    assert (call.priority, call.tenant) == (INTERACTIVE, ANONYMOUS)


# ---- one tenant ------------------------------------------------------------------------------------------
async def test_the_prefix_cache_salt_and_the_fairness_lane_are_the_calls_tenant() -> None:
    rt, _ = make_runtime(n_workers=1)
    call = http_call(request("/v1/completions"), error_body, "/v1/completions", False)
    read_hints(call, request("/v1/completions", {"X-Tenant": "team-a"}), MODEL_WORK, False)

    async def placed() -> Generation:
        req = CompletionRequest(model="sim-llm", prompt="x", max_tokens=4)
        choices = await _TextCall(rt, req, call, "text_completion", "id", "x", 4).start()
        return rt.placement.live[choices.streams[0].seq_id].gen

    gen = await placed()
    assert (gen.tenant, gen.weight) == ("team-a", 1.0)
    assert gen.share == tenant_share(call.tenant) == TenantShare("team-a", 1.0)
    call.tenant = Tenant("acme", TenantConfig(weight=3.0))  # as the Auth layer names it with tenants
    gen = await placed()
    assert (gen.tenant, gen.weight) == ("acme", 3.0) and gen.share == tenant_share(call.tenant)
    assert tenant_share(ANONYMOUS) is NO_TENANT


# ---- search ----------------------------------------------------------------------------------------------
class FakeIndex:
    def __init__(self) -> None:
        self.asked: list[float] = []

    async def search(self, req: Any) -> dict[str, Any]:
        self.asked.append(req.timeout_ms)
        return {"hits": []}


def search_routes(clock: FakeClock, data_dir: Path) -> tuple[SearchRoutes, FakeIndex]:
    index = FakeIndex()
    rt = SimpleNamespace(name="docs", kind="search", clock=clock, index=index, params=SimpleNamespace(fields={}, shards=1))

    class Registry:
        def __contains__(self, name: str) -> bool:
            return name == "docs"

        def get(self, name: str) -> Any:
            return rt

        def names(self, kind: str | None = None) -> list[str]:
            return ["docs"]

    config = SimpleNamespace(data_dir=data_dir, max_body_bytes=1 << 20)
    server = SimpleNamespace(config=config, registry=Registry(), frontend=None, peers=None)
    return SearchRoutes(server), index


@pytest.mark.parametrize(
    ("body", "header_ms", "expected_s"),
    [
        (b'{"query": "x"}', None, 1.0),  # the search default
        (b'{"query": "x", "timeout_ms": 300}', None, 0.3),
        (b'{"query": "x", "timeout_ms": 3000}', 200.0, 0.2),  # the header's, smaller
        (b'{"query": "x", "timeout_ms": 300}', 5000.0, 0.3),  # the body's, smaller
    ],
)
async def test_a_search_sets_the_calls_deadline_from_the_smaller_timeout(
    body: bytes, header_ms: float | None, expected_s: float, tmp_path: Path
) -> None:
    clock = FakeClock(100.0)
    routes, index = search_routes(clock, tmp_path)
    path = "/v1/indexes/docs/search"
    req = request(path, {"content-type": "application/json"}, {"name": "docs"}, body)
    call = http_call(req, error_body, "/v1/indexes/{name}/search", False)
    call.timeout_ms = header_ms  # as read_hints reads X-Request-Timeout-Ms
    await routes.search(call, req)
    assert call.deadline == pytest.approx(100.0 + expected_s)
    assert index.asked == [pytest.approx(expected_s * 1000)]


# ---- a bad hint, through the whole app -------------------------------------------------------------------
async def test_a_bad_hint_is_a_400_in_the_routes_shape_and_routes_that_take_none_ignore_it() -> None:
    from tests.fuzz.app_client import call, check_conforms, make_app

    app = make_app()
    bad = [(b"x-priority", b"urgent"), (b"x-request-id", b"req-7")]
    answer = await call(app, "GET", "/v2/health/live", headers=bad)
    assert answer.status == 200  # a route that runs no model's work reads no hints
    answer = await call(app, "POST", "/v2/models/sim/infer", b"{}", bad)
    assert answer.status == 400 and answer.headers[b"x-request-id"] == b"req-7"
    body = json.loads(answer.body)
    assert body["request_id"] == "req-7" and body["error"].startswith("priority 'urgent'")
    check_conforms("POST", "/v2/models/sim/infer", answer)
    timeout = [(b"x-request-timeout-ms", b"soon")]
    answer = await call(app, "POST", "/v1/embeddings", b'{"model": "sim", "input": "x"}', timeout)
    assert answer.status == 400
    assert "X-Request-Timeout-Ms must be a number" in json.loads(answer.body)["error"]["message"]
    check_conforms("POST", "/v1/embeddings", answer)
    tenant = [(b"x-tenant", b"t" * 300)]
    answer = await call(app, "POST", "/v1/completions", b'{"model": "sim-llm", "prompt": "x"}', tenant)
    assert answer.status == 400 and "X-Tenant is 300 characters" in json.loads(answer.body)["error"]["message"]
