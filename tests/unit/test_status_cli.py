"""`inferd status` against a stub admin API (aiohttp on port 0, in its own thread and event loop)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import typer
from aiohttp import web
from rich.console import Console
from typer.testing import CliRunner

from inferd.cli.status import AdminSnapshot, AdminUnavailable, render_snapshot, status, watch_loop
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(30)

TOKEN = "s3cret"
WIDE = {"COLUMNS": "250", "INFERD_ADMIN_TOKEN": ""}

WORKERS = {
    "workers": [
        {
            "worker_id": "sim.0.g1",
            "model": "sim",
            "version": 3,
            "state": "ready",
            "pid": 4242,
            "host": "127.0.0.1",
            "zone": "zone-b",
            "inflight_batches": 2,
            "latency_ms": 212.4,
            "completed_batches": 1234,
            "restarts": 1,
            "last_progress_s_ago": 0.25,
            "last_heartbeat_s_ago": 0.5,
            "busy_s": 12.0,
        },
        {
            "worker_id": "sim.1.g0",
            "model": "sim",
            "version": 3,
            "state": "draining",
            "pid": 4343,
            "host": "10.0.0.7",
            "inflight_batches": 0,
            "completed_batches": 77,
            "restarts": 0,
            "last_progress_s_ago": 95.0,
            "last_heartbeat_s_ago": 1.5,
            "busy_s": 3.0,
        },
    ],
    "time": 1700000000.0,
    "frontend": {"id": "fe-1", "zone": "zone-a"},
    "grpc": "127.0.0.1:8001",
}
MODELS = {
    "models": {
        "sim": {
            "ready": True,
            "stalled": False,
            "ready_workers": 1,
            "queued": 17,
            "isolation_batches": 0,
            "batch_timeout_s": 2.5,
            "busy_ratio": 0.625,
            "autoscaler": {
                "last": {"from": 2, "to": 2, "reason": "hold: busy ratio 0.55 within the band"},
                "changes": [{"at": 1796000000.0, "from": 1, "to": 2, "reason": "scale up 1 -> 2: queue"}],
            },
        }
    },
    "llm_models": {
        "smollm2": {
            "ready": True,
            "workers": 2,
            "streams": 9,
            "running": 7,
            "waiting": 2,
            "kv_usage": 0.43,
            "prefix_hit_ratio": 0.25,
            "preemptions": 3,
            "rejected": 11,
            "moved": 4,
            "lost": 0,
        }
    },
    "retry_budget": {
        "balance": 10.5,
        "requests_in_window": 321,
        "retries_in_window": 4,
        "exhausted_total": 2,
    },
}


@dataclass
class StubAdmin:
    url: str
    token: str | None
    hits: list[str] = field(default_factory=list)


def stub_app(stub: StubAdmin) -> web.Application:
    async def workers(request: web.Request) -> web.Response:
        return answer(request, WORKERS)

    async def models(request: web.Request) -> web.Response:
        return answer(request, MODELS)

    def answer(request: web.Request, payload: dict) -> web.Response:
        stub.hits.append(request.path)
        if stub.token and request.headers.get("Authorization") != f"Bearer {stub.token}":
            return web.json_response({"error": "missing or wrong admin token"}, status=401)
        return web.json_response(payload)

    app = web.Application()
    app.add_routes([web.get("/admin/workers", workers), web.get("/admin/models", models)])
    return app


def serve_stub(token: str | None) -> Iterator[StubAdmin]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stub = StubAdmin(url="", token=token)
    runner = web.AppRunner(stub_app(stub), access_log=None, handle_signals=False)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=5)
    stub.url = f"http://127.0.0.1:{port}"
    try:
        yield stub
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


@pytest.fixture
def admin() -> Iterator[StubAdmin]:
    yield from serve_stub(token=None)


@pytest.fixture
def locked_admin() -> Iterator[StubAdmin]:
    yield from serve_stub(token=TOKEN)


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("status")(status)
    return app


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli(), list(args), env={**WIDE, **(env or {})})


def test_status_prints_worker_and_model_tables_with_the_retry_budget(admin: StubAdmin) -> None:
    result = invoke("--admin-url", admin.url)
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("sim.0.g1", "sim.1.g0", "4242", "10.0.0.7", "1234", "draining", "0.2 s", "1.6 min"):
        assert text in out, text
    for header in ("zone", "in-flight", "latency", "completed", "restarts", "progress age", "heartbeat age"):
        assert header in out, header
    assert "zone-b" in out, "a worker's zone (the other, of an older inferd, has none)"
    assert "(front end fe-1, zone zone-a); gRPC API on 127.0.0.1:8001" in out
    assert "212 ms" in out
    for text in ("ready workers", "queued", "batch timeout", "busy ratio", "2.5 s", "62%", "17"):
        assert text in out, text
    assert "retry budget: balance 10.5, 321 requests and 4 retries in the window, exhausted 2 times" in out
    assert sorted(admin.hits) == ["/admin/models", "/admin/workers"]
    assert "LLM models" in out and "smollm2" in out
    assert "autoscaler sim: 2 -> 2 (hold: busy ratio 0.55 within the band)" in out
    assert "1 -> 2  scale up 1 -> 2: queue" in out
    for text in ("43%", "25%"):  # KV used, prefix hits
        assert text in out, text


def test_status_json_prints_both_raw_answers(admin: StubAdmin) -> None:
    result = invoke("--admin-url", admin.url + "/", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"workers": WORKERS, "models": MODELS}


def test_status_sends_the_token_given_as_an_option(locked_admin: StubAdmin) -> None:
    result = invoke("--admin-url", locked_admin.url, "--token", TOKEN, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["models"] == MODELS


def test_status_reads_the_token_from_the_environment(locked_admin: StubAdmin) -> None:
    result = invoke("--admin-url", locked_admin.url, "--json", env={"INFERD_ADMIN_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["workers"] == WORKERS


@pytest.mark.parametrize("token_args", [[], ["--token", "wrong"]])
def test_status_exits_1_with_a_hint_when_the_admin_api_answers_401(
    locked_admin: StubAdmin, token_args: list[str]
) -> None:
    result = invoke("--admin-url", locked_admin.url, *token_args)
    assert result.exit_code == 1
    assert "401" in result.stderr
    assert "INFERD_ADMIN_TOKEN" in result.stderr
    assert "Traceback" not in result.output


def test_status_exits_1_naming_the_url_when_the_admin_api_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # bound then closed: nothing listens there
    result = invoke("--admin-url", url)
    assert result.exit_code == 1
    assert "cannot reach the admin API" in result.stderr
    assert url in result.stderr
    assert "Traceback" not in result.output


def test_watch_refreshes_until_ctrl_c_and_survives_a_failed_refresh() -> None:
    first = AdminSnapshot(workers={"workers": []}, models={"models": {}})
    second = AdminSnapshot(workers=WORKERS, models=MODELS)
    answers: list[AdminSnapshot | AdminUnavailable] = [AdminUnavailable("server restarting"), second]
    shown: list[tuple[AdminSnapshot, str | None]] = []
    sleeps: list[float] = []

    def fetch() -> AdminSnapshot:
        answer = answers.pop(0)
        if isinstance(answer, AdminUnavailable):
            raise answer
        return answer

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    watch_loop(first, fetch, lambda snap, err: shown.append((snap, err)), 2.0, sleep=sleep)
    assert sleeps == [2.0, 2.0, 2.0]
    assert shown == [(first, "server restarting"), (second, None)]


def test_help_lists_every_option() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for option in ("--admin-url", "--token", "--watch", "--json", "INFERD_ADMIN_TOKEN"):
        assert option in result.output, option


def test_status_finds_the_admin_api_on_the_http_port_plus_two(admin: StubAdmin) -> None:
    admin_port = int(admin.url.rsplit(":", 1)[1])
    result = invoke("--port", str(admin_port - 2), "--host", "127.0.0.1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["workers"] == WORKERS
    assert sorted(admin.hits) == ["/admin/models", "/admin/workers"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--admin-url", "http://127.0.0.1:9001", "--port", "9000"], "not both"),
        (["--port", "0"], "--admin-url"),
    ],
)
def test_status_refuses_an_address_it_cannot_resolve(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_status_says_nothing_of_grpc_for_a_server_without_it() -> None:
    snapshot = AdminSnapshot(workers={**WORKERS, "grpc": None}, models=MODELS)
    console = Console(width=200, record=True)
    console.print(render_snapshot(snapshot, "http://127.0.0.1:8002"))
    text = console.export_text()
    assert "from http://127.0.0.1:8002 (front end fe-1, zone zone-a) at" in text
    assert "gRPC" not in text
