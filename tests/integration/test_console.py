"""The live console at `/` in a real headless Chromium (Playwright driving Debian's chromium), against a
real `inferd serve` under load: the page loads without console errors, shows every model, and the counts
it shows equal `/metrics` at the same moment (a counter shown lies between a scrape just before the
page's fetch and one just after). Also who may open it: the admin token, as a bearer or as the cookie
that `/?token=` sets; with tenants and no admin token nobody."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ServerProc, start_server

pytestmark = pytest.mark.slow
MODELS = ("sim", "sim-llm")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is missing: scripts/setup --test installs Debian's chromium")
    return path


def scrape(server: ServerProc, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[json.dumps(dict(sorted(s.labels.items())))] = s.value
    return out


def infer(server: ServerProc, text: str) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    req = urllib.request.Request(
        f"{server.url}/v2/models/sim/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
    except urllib.error.HTTPError as exc:
        exc.read()


class Load:
    """Requests from two threads until stopped, bounded by count and time."""

    def __init__(self, server: ServerProc, max_requests: int = 20_000, max_s: float = 90.0) -> None:
        self.server, self.max_requests, self.deadline = server, max_requests, time.monotonic() + max_s
        self.sent = 0
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(2)]

    def run(self) -> None:
        while (
            not self.stopping.is_set() and self.sent < self.max_requests and time.monotonic() < self.deadline
        ):
            self.sent += 1
            infer(self.server, f"load {self.sent}")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(15)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("console"), *[a for m in MODELS for a in ("--model", m)])
    yield s
    s.stop()


def test_console_in_chromium_shows_every_model_and_the_numbers_of_metrics(
    server: ServerProc, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with Load(server) as load, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{server.url}/", wait_until="load")
            for model in MODELS:
                page.wait_for_selector(f"#models tbody td:text-is('{model}')", timeout=20_000)
            deadline = time.monotonic() + 30
            while load.sent < 50 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert load.sent >= 50, "the load did not start"
            before = scrape(server, "inferd_requests_total")
            deadline = time.monotonic() + 30  # the load moves the counters before the page looks again
            while scrape(server, "inferd_requests_total") == before and time.monotonic() < deadline:
                time.sleep(0.05)
            page.evaluate("() => window.inferdConsole.refresh()")
            after = scrape(server, "inferd_requests_total")
            shown = page.eval_on_selector_all(
                "td[data-sample='inferd_requests_total']",
                "cells => cells.map(c => [c.getAttribute('data-labels'), c.textContent])",
            )
            page.wait_for_selector("[data-chart='sim/throughput'] canvas", timeout=20_000)
            page.screenshot(path=str(tmp_path / "console.png"), full_page=True)
            if os.environ.get("INFERD_CONSOLE_SCREENSHOT"):
                shutil.copy(tmp_path / "console.png", os.environ["INFERD_CONSOLE_SCREENSHOT"])
        finally:
            browser.close()
    assert not errors, f"console errors in the page: {errors}"
    assert shown, "the page shows no inferd_requests_total sample"
    moving = 0
    for labels, text in shown:
        key = json.dumps(dict(sorted(json.loads(labels).items())))
        value = float(text)
        assert before.get(key, 0.0) <= value <= after[key], (labels, before.get(key), value, after[key])
        moving += value > before.get(key, 0.0)  # the page shows a count newer than `before`
    sim_ok = [float(t) for lbl, t in shown if '"sim"' in lbl and '"ok"' in lbl]
    assert sim_ok and sim_ok[0] > 0, shown
    assert moving, "the page shows no count that moved since the first scrape: it did not look again"


def test_console_data_matches_metrics_once_quiet(server: ServerProc) -> None:
    for i in range(5):
        infer(server, f"quiet {i}")
    with urllib.request.urlopen(f"{server.url}/console/data", timeout=10) as r:
        data = json.loads(r.read())
    metrics = scrape(server, "inferd_requests_total")
    shown = {
        json.dumps(dict(sorted(s["labels"].items()))): s["value"]
        for s in data["metrics"]["inferd_requests_total"]
    }
    assert shown == metrics
    assert {m["name"] for m in data["models"]} == set(MODELS)
    assert all(w["state"] for w in data["workers"]) and len(data["workers"]) >= 2


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Message, bytes]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_console_needs_the_admin_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = "console-admin-token-123"
    monkeypatch.setenv("INFERD_ADMIN_TOKEN", token)
    s = start_server(tmp_path, "--model", "sim")
    try:
        assert get(f"{s.url}/")[0] == 401
        assert get(f"{s.url}/console/data")[0] == 401
        assert get(f"{s.url}/?token=wrong")[0] == 401
        status, headers, _ = get(f"{s.url}/?token={token}")
        assert status == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"].split(";")[0]
        assert token not in cookie and "HttpOnly" in headers["Set-Cookie"]
        assert get(f"{s.url}/console/data", {"Cookie": cookie})[0] == 200
        assert get(f"{s.url}/", {"Cookie": cookie})[0] == 200
        assert get(f"{s.url}/console/data", {"Authorization": f"Bearer {token}"})[0] == 200
        assert get(f"{s.url}/console/console.js", {"Cookie": "inferd_console=forged"})[0] == 401
    finally:
        s.stop()
    assert token not in s.log()


def test_console_with_tenants_and_no_admin_token_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("INFERD_ADMIN_TOKEN", raising=False)
    (tmp_path / "inferd.toml").write_text(f'[tenants.acme]\napi_key_sha256 = ["{key_digest(new_key())}"]\n')
    s = start_server(tmp_path, "--model", "sim", "--config", str(tmp_path / "inferd.toml"))
    try:
        status, _, body = get(f"{s.url}/console/data")
        assert status == 403 and b"INFERD_ADMIN_TOKEN" in body
        assert get(f"{s.url}/")[0] == 403
    finally:
        s.stop()


def test_inferd_top_prints_the_same_picture(server: ServerProc) -> None:
    from typer.testing import CliRunner

    from inferd.cli.main import app as cli_app

    infer(server, "for top")
    result = CliRunner().invoke(cli_app, ["top", "--url", server.url, "--once"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for model in MODELS:
        assert model in result.output
    assert "workers" in result.output and "req/s" in result.output
    refused = CliRunner().invoke(cli_app, ["top", "--url", "http://127.0.0.1:9", "--once"])
    assert refused.exit_code == 1 and "is `inferd serve` running there?" in refused.output
