"""`inferd bench --chaos` against an in-process stub server with real worker processes.

The stub answers infer requests like the server (sim digest of the payload) and serves the admin worker
list, whose workers are real child processes this test spawns (`python -c 'time.sleep(60)'`). A small
supervisor task plays the server's part: it notices a worker that died (or, with `watch_stopped`, that is
stopped), marks it not ready after `detect_delay_s`, and starts a replacement `replace_delay_s` after it
noticed. Every child is SIGKILLed in teardown.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import typer
from aiohttp import web
from typer.testing import CliRunner

from inferd.bench.chaos_spec import ChaosSpec, planned_injections
from inferd.bench.chaos_stats import after_injection_mask, window_stats
from inferd.bench.loadgen import LoadSpec, run_load
from inferd.bench.report import LoadReport, render
from inferd.cli.bench_cmd import bench
from inferd.models.sim import sim_digest

HOST = socket.gethostname()
TOKEN = "s3cret"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def proc_state(pid: int) -> str | None:
    """The kernel's state letter for pid ('R', 'S', 'T' stopped, 'Z' zombie...), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


@dataclass
class FakeWorker:
    worker_id: str
    proc: subprocess.Popen[bytes]
    model: str = "sim"
    host: str = HOST
    state: str = "ready"
    noticed_at: float | None = None

    def row(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "model": self.model,
            "state": self.state,
            "pid": self.proc.pid,
            "host": self.host,
            "inflight_batches": 0,
            "completed_batches": 0,
            "restarts": 0,
            "version": 1,
        }


@dataclass
class Cluster:
    """The stub server's workers and how it reacts to failures."""

    detect_delay_s: float = 0.1
    replace_delay_s: float = 0.3
    watch_stopped: bool = True
    """Notice stopped workers (the server's hang watchdog); the stub never kills them itself."""
    slow_while_degraded_s: float = 0.0
    """Delay infer answers received while a noticed failure is not yet replaced."""
    token: str | None = TOKEN
    workers: list[FakeWorker] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    admin_requests: int = 0
    slowed: list[int] = field(default_factory=list)
    """Request numbers (i of id 'seed-i') the stub slowed."""
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def spawn(self, model: str = "sim", host: str = HOST, state: str = "ready") -> FakeWorker:
        proc = subprocess.Popen(SLEEPER)
        self.procs.append(proc)
        worker = FakeWorker(f"{model}.{next(self._ids)}", proc, model, host, state)
        self.workers.append(worker)
        return worker

    def degraded(self) -> bool:
        return any(w.noticed_at is not None for w in self.workers)

    def failed(self, w: FakeWorker) -> bool:
        if w.proc.poll() is not None:
            return True
        return self.watch_stopped and proc_state(w.proc.pid) == "T"

    async def supervise(self) -> None:
        """Every 10 ms: notice failed sim workers, mark them after detect_delay_s, replace them after
        replace_delay_s (the failed one leaves the list when its replacement arrives)."""
        while True:
            now = time.monotonic()
            for w in list(self.workers):
                if w.model != "sim" or w.host != HOST or w.state not in ("ready", "restarting"):
                    continue
                if w.noticed_at is None:
                    if self.failed(w):
                        w.noticed_at = now
                    continue
                if now - w.noticed_at >= self.detect_delay_s:
                    w.state = "restarting"
                if now - w.noticed_at >= self.replace_delay_s:
                    self.workers.remove(w)
                    self.spawn()
            await asyncio.sleep(0.01)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)


def make_app(cluster: Cluster) -> web.Application:
    async def infer(request: web.Request) -> web.Response:
        body = await request.json()
        rid = body["id"]
        payload = body["inputs"][0]["data"][0]
        if cluster.slow_while_degraded_s and cluster.degraded():
            cluster.slowed.append(int(rid.rsplit("-", 1)[1]))
            await asyncio.sleep(cluster.slow_while_degraded_s)
        model = request.match_info["model"]
        answer = {
            "model_name": model,
            "model_version": "1",
            "id": rid,
            "outputs": [
                {
                    "name": "OUTPUT0",
                    "datatype": "BYTES",
                    "shape": [1],
                    "data": [sim_digest(model, 1, payload)],
                }
            ],
        }
        return web.json_response(answer)

    async def workers(request: web.Request) -> web.Response:
        cluster.admin_requests += 1
        if cluster.token and request.headers.get("Authorization") != f"Bearer {cluster.token}":
            return web.json_response({"error": "missing or wrong admin token"}, status=401)
        return web.json_response({"workers": [w.row() for w in cluster.workers], "time": time.time()})

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_get("/admin/workers", workers)
    return app


@dataclass
class Stub:
    url: str
    cluster: Cluster


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    cluster = Cluster()
    runner = web.AppRunner(make_app(cluster), handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    supervisor = asyncio.ensure_future(cluster.supervise())
    try:
        yield Stub(f"http://127.0.0.1:{runner.addresses[0][1]}", cluster)
    finally:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await runner.cleanup()
        cluster.kill_all()
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert leftover == [], f"tasks left running: {leftover}"


def load(url: str, duration_s: float, **overrides: object) -> LoadSpec:
    base: dict[str, object] = {"url": url, "rate": 200.0, "duration_s": duration_s, "arrival": "constant"}
    return LoadSpec(**(base | overrides))  # type: ignore[arg-type]


def chaos(stub: Stub, mode: str, **overrides: object) -> ChaosSpec:
    base: dict[str, object] = {
        "mode": mode,
        "admin_url": stub.url,
        "admin_token": TOKEN,
        "measure_timeout_s": 1.0,
    }
    return ChaosSpec(**(base | overrides))  # type: ignore[arg-type]


def assert_invariants_clean(report: LoadReport) -> None:
    inv = report.invariants
    assert (inv["lost"], inv["duplicated"], inv["misrouted"], inv["timed_out"]) == (0, 0, 0, 0)
    assert inv["errors"] == {}


# --- the window split (no network) ---


def test_after_injection_mask_covers_window_after_each_injection() -> None:
    offsets = np.array([0.0, 0.99, 1.0, 2.99, 3.0, 4.99, 5.0, 6.5, 7.0, 7.5])
    mask = after_injection_mask(offsets, [5.0, 1.0], 2.0)  # unsorted on purpose
    assert mask.tolist() == [False, False, True, True, False, False, True, True, False, False]
    # Overlapping windows: 3.5 is 2.5 s after the first injection but 1.5 s after the second.
    assert after_injection_mask(np.array([3.5, 4.1]), [1.0, 2.0], 2.0).tolist() == [True, False]
    assert not after_injection_mask(offsets, [], 2.0).any()


def test_window_stats_counts_sent_ok_failed_and_latency_of_ok_answers() -> None:
    results = np.array([0.010, 0.020, np.nan, -1.0, 0.5])  # nan: never sent; -1: sent, not ok
    stats = window_stats(results)
    assert (stats["sent"], stats["ok"], stats["failed"]) == (4, 3, 1)
    assert stats["latency_ms"]["max"] == pytest.approx(500.0, rel=0.01)
    assert stats["latency_ms"]["p50"] == pytest.approx(20.0, rel=0.01)
    assert window_stats(np.array([]))["latency_ms"] == {"p50": None, "p99": None, "max": None}


def test_chaos_spec_defaults_and_validation() -> None:
    spec = ChaosSpec(mode="kill", admin_token="t0ken")
    assert (spec.interval_s, spec.first_s, spec.admin_url) == (3.0, 3.0, "http://127.0.0.1:8002")
    assert "t0ken" not in repr(spec) and "t0ken" not in json.dumps(spec.to_dict())
    assert spec.to_dict()["admin_token_set"] is True
    assert ChaosSpec(mode="stop", interval_s=2.0, start_s=0.5).first_s == 0.5
    assert planned_injections(spec, 60.0) == 19  # at 3, 6, ..., 57 s
    assert planned_injections(ChaosSpec(), 60.0) == 0
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        ChaosSpec(mode="kill", interval_s=0.0)
    with pytest.raises(ValueError, match="mode must be"):
        ChaosSpec(mode="explode")  # type: ignore[arg-type]


# --- against the stub ---


async def test_kill_hits_a_ready_local_worker_of_the_model_at_each_interval(stub: Stub) -> None:
    cluster = stub.cluster
    for _ in range(2):
        cluster.spawn()
    decoys = [
        cluster.spawn(model="other"),
        cluster.spawn(host="elsewhere.example"),
        cluster.spawn(state="draining"),
    ]
    report = await run_load(
        load(stub.url, 1.6, warmup_s=0.2), chaos(stub, "kill", interval_s=0.5, start_s=0.3)
    )
    c = report.chaos
    assert c is not None and c.planned == 3
    assert [inj["n"] for inj in c.injections] == [0, 1, 2], c
    assert c.skipped == {} and c.admin_errors == {}
    for k, inj in enumerate(c.injections):
        assert (
            0.3 + 0.5 * k <= inj["at_s"] < 0.3 + 0.5 * k + 1.0
        )  # from the measured window's start (loose: loaded CI)
        assert inj["signal"] == "SIGKILL" and inj["ready_before"] == 3  # the remote one counts too
    pids = [inj["pid"] for inj in c.injections]
    assert len(set(pids)) == 3
    by_pid = {p.pid: p for p in cluster.procs}
    for pid in pids:
        assert by_pid[pid].wait(timeout=1) == -signal.SIGKILL  # really killed, by us
    for decoy in decoys:
        assert decoy.proc.poll() is None  # wrong model, other host, not ready: never touched
    # The stub marks a dead worker after 0.1 s and replaces it 0.3 s after noticing (10 ms polls);
    # the agent polls every 50 ms.
    # (the bounds are loose on purpose: a loaded 2-core machine stretches every poll; the order holds)
    for inj in c.injections:
        assert 0.0 < inj["detect_s"] <= inj["replace_s"] < 5.0
    assert c.detect_ms["measured"] == 3 and c.detect_ms["missing"] == 0
    assert 0.0 < c.detect_ms["p50"] <= c.detect_ms["max"] < 5000.0
    assert c.detect_ms["p50"] <= c.replace_ms["p50"] <= c.replace_ms["max"] < 5000.0
    assert c.after_injection["sent"] + c.steady["sent"] == report.measured.sent == 320
    assert_invariants_clean(report)
    assert report.to_dict()["chaos"]["injections"][0]["pid"] == pids[0]


async def test_stop_is_detected_by_the_watchdog_and_every_stopped_pid_is_resumed(stub: Stub) -> None:
    cluster = stub.cluster
    for _ in range(2):
        cluster.spawn()
    report = await run_load(load(stub.url, 1.0), chaos(stub, "stop", interval_s=0.4, start_s=0.2))
    c = report.chaos
    assert c is not None and len(c.injections) == 2, c
    assert all(inj["signal"] == "SIGSTOP" for inj in c.injections)
    stopped = [inj["pid"] for inj in c.injections]
    assert c.stopped_pids == stopped and sorted(c.resumed_pids) == sorted(stopped)
    for pid in stopped:
        # The stub's watchdog replaced them without killing them: still alive, and not left stopped.
        assert proc_state(pid) not in (None, "T", "t", "Z")
    for inj in c.injections:
        assert 0.0 < inj["detect_s"] <= inj["replace_s"] < 5.0
    assert_invariants_clean(report)


async def test_stop_never_targets_a_pid_it_stopped_before(stub: Stub) -> None:
    cluster = stub.cluster
    cluster.watch_stopped = False  # a server that never notices: the stopped worker stays "ready"
    (only,) = [cluster.spawn()]
    report = await run_load(
        load(stub.url, 1.0), chaos(stub, "stop", interval_s=0.3, start_s=0.1, measure_timeout_s=0.3)
    )
    c = report.chaos
    assert c is not None and c.planned == 3
    assert [inj["pid"] for inj in c.injections] == [only.proc.pid]
    assert c.skipped == {"no_local_ready_worker": 2}
    assert c.injections[0]["detect_s"] is None and c.detect_ms["missing"] == 1  # bounded, not measured
    assert c.resumed_pids == [only.proc.pid]
    assert proc_state(only.proc.pid) not in (None, "T", "t")


async def test_p99_after_injections_comes_from_requests_intended_in_the_window(stub: Stub) -> None:
    # While a killed worker is not yet replaced (0.3 s), the stub answers 100 ms late. Only requests
    # intended within after_window_s (0.4 s) of the injection may be slowed; all others are steady.
    cluster = stub.cluster
    cluster.detect_delay_s = 0.0
    cluster.slow_while_degraded_s = 0.1
    for _ in range(2):
        cluster.spawn()
    spec = load(stub.url, 1.5, warmup_s=0.25)
    report = await run_load(spec, chaos(stub, "kill", interval_s=5.0, start_s=0.5, after_window_s=0.4))
    c = report.chaos
    assert c is not None and len(c.injections) == 1
    at = c.injections[0]["at_s"]
    # ~60 are slowed on a quiet machine (0.3 s at 200 req/s); a loaded one may shorten the window, and
    # what matters here is which requests land in it
    assert cluster.slowed, "the stub slowed no request"
    intended = sorted(i / spec.rate - spec.warmup_s for i in cluster.slowed)
    assert all(t < at + 0.4 for t in intended), (at, intended)
    # A request intended a few ms before the kill but sent late (send lag) may reach the stub after it
    # noticed the kill: allow two, within 50 ms.
    early = [t for t in intended if t < at]
    assert len(early) <= 2 and all(t >= at - 0.05 for t in early), (at, early)
    after, steady = c.after_injection, c.steady
    assert after["sent"] in (79, 80, 81)  # 0.4 s at 200 req/s
    assert after["sent"] + steady["sent"] == report.measured.sent == 300
    assert after["latency_ms"]["p99"] >= 100.0
    assert steady["latency_ms"]["p50"] < 50.0
    assert steady["latency_ms"]["p99"] < after["latency_ms"]["p99"]
    assert_invariants_clean(report)


async def test_admin_api_down_or_refusing_skips_injections_without_failing_the_run(stub: Stub) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens on `port` now
    stub.cluster.spawn()
    down = chaos(stub, "kill", interval_s=0.2, admin_url=f"http://127.0.0.1:{port}")
    report = await run_load(load(stub.url, 0.5), down)
    assert report.chaos is not None
    assert report.chaos.injections == [] and report.chaos.skipped == {"admin_unavailable": 2}
    assert report.chaos.admin_errors == {"connection": 2}
    report = await run_load(load(stub.url, 0.5), chaos(stub, "kill", interval_s=0.2, admin_token="wrong"))
    assert report.chaos is not None and report.chaos.admin_errors == {"http_401": 2}
    assert stub.cluster.workers[0].proc.poll() is None
    assert_invariants_clean(report)


async def test_report_renders_invariants_and_chaos_rows(stub: Stub) -> None:
    stub.cluster.spawn()
    stub.cluster.spawn()
    report = await run_load(load(stub.url, 0.6), chaos(stub, "kill", interval_s=0.3, start_s=0.1))
    from rich.console import Console

    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    for row in (
        "LOST",
        "DUPLICATED",
        "MISROUTED",
        "TIMED OUT",
        "errors by kind",
        "throughput",
        "injections (made/planned)",
        "time to detect ms p50/max",
        "time to replace ms p50/max",
        "p99 ms after injections (2 s)",
        "p99 ms steady",
    ):
        assert row in text, text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["invariants"] == {"lost": 0, "duplicated": 0, "misrouted": 0, "timed_out": 0, "errors": {}}
    assert len(data["chaos"]["injections"]) == 2


# --- the command ---


@pytest.fixture
def threaded_stub() -> Iterator[Stub]:
    """The stub on its own loop in a thread, for the blocking CLI."""
    cluster = Cluster()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(cluster), handler_cancellation=True, shutdown_timeout=0.5)

    async def start() -> tuple[int, asyncio.Task[None]]:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1], asyncio.ensure_future(cluster.supervise())

    async def stop(supervisor: asyncio.Task[None]) -> None:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port, supervisor = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=5)
    try:
        yield Stub(f"http://127.0.0.1:{port}", cluster)
    finally:
        asyncio.run_coroutine_threadsafe(stop(supervisor), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
        cluster.kill_all()


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench)
    return app


def test_help_lists_the_chaos_options() -> None:
    result = CliRunner().invoke(cli(), ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in (
        "--chaos",
        "--chaos-interval",
        "--chaos-start",
        "--admin-url",
        "--admin-token",
        "--chaos-seed",
    ):
        assert option in result.output


def test_command_runs_chaos_kill_and_reports_json(threaded_stub: Stub) -> None:
    for _ in range(2):
        threaded_stub.cluster.spawn()
    args = ["--url", threaded_stub.url, "--rate", "200", "--duration", "0.8", "--arrival", "constant"]
    args += ["--chaos", "kill", "--chaos-interval", "0.3", "--chaos-start", "0.2", "--chaos-seed", "3"]
    args += ["--admin-url", threaded_stub.url, "--admin-token", TOKEN, "--json"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    chaos_report = data["chaos"]
    assert chaos_report["spec"]["mode"] == "kill" and chaos_report["spec"]["seed"] == 3
    assert chaos_report["spec"]["admin_token_set"] is True and TOKEN not in result.output
    assert len(chaos_report["injections"]) == 2
    for inj in chaos_report["injections"]:
        assert proc_state(inj["pid"]) in (None, "Z")  # killed (reaped by the teardown)
    assert data["invariants"]["misrouted"] == 0 and data["invariants"]["duplicated"] == 0


def test_command_rejects_a_bad_chaos_interval() -> None:
    result = CliRunner().invoke(cli(), ["--chaos", "kill", "--chaos-interval", "0"])
    assert result.exit_code != 0
    assert "interval_s must be > 0" in result.output


def test_no_child_is_left_stopped() -> None:
    """Guard for the whole module: no process of ours is stopped (teardowns killed every child)."""
    out = subprocess.run(
        ["ps", "-o", "pid=,stat=", "--ppid", str(os.getpid())], capture_output=True, text=True, check=False
    )
    assert not [line for line in out.stdout.splitlines() if line.split()[1].startswith("T")]
