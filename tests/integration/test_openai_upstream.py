"""openai-upstream end to end: an inferd server serving sim-llm is the upstream engine; a second inferd
server fronts it (plus a flaky upstream that answers probes but fails every request, and a dead URL),
and the `openai` client talks to the front one.

Checked: the text is exactly sim-llm's documented tokens, streaming and not, completions and chat; the
failing upstreams are retried away and ejected; a dead-only model gives a clear 503; a full one a fast
429; a client that disconnects cancels the request upstream; the API key from the environment reaches
the upstream; token timing and upstream gauges are on /metrics; a caller's deadline travels upstream
as the time left and bounds the call (504, or an error event mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import openai
import pytest

from inferd.kinds.llm.sim_llm import sim_llm_chat_prompt, sim_llm_tokens
from tests.conftest import ServerProc, free_port, start_server

KEY_ENV = "INFERD_TEST_UPSTREAM_KEY"
KEY = "test-key-3c1f"


@dataclass
class Flaky:
    """An upstream that answers GET /v1/models (so probes pass) and 503s every completion, except for the
    model "half-stream": two SSE events, then the connection drops mid-body (chunked, no last chunk);
    and "slow": an answer that takes 10 s (streamed: an event every 0.1 s)."""

    url: str
    posts: int = 0
    authorizations: list[str] = field(default_factory=list)
    timeouts_ms: list[str | None] = field(default_factory=list)
    """X-Request-Timeout-Ms of each "slow" request."""


def start_flaky() -> tuple[Flaky, ThreadingHTTPServer]:
    port = free_port()
    flaky = Flaky(f"http://127.0.0.1:{port}/v1")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._answer(200, {"object": "list", "data": []})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if body["model"] == "half-stream":
                self._half_stream()
                return
            if body["model"] == "slow":
                flaky.timeouts_ms.append(self.headers.get("X-Request-Timeout-Ms"))
                with contextlib.suppress(OSError):  # the front closes the connection at the deadline
                    self._slow(body.get("stream") is True)
                return
            flaky.posts += 1
            flaky.authorizations.append(self.headers.get("Authorization", ""))
            self._answer(503, {"error": {"message": "flaky is down", "type": "server_error"}})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _half_stream(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for word in ("half", "way"):
                event = f"data: {json.dumps({'choices': [{'index': 0, 'text': word}]})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            time.sleep(0.3)  # the events reach the front before the failure (aiohttp drops unread data)
            self.close_connection = True  # no terminating chunk: the body is cut short

        def _slow(self, stream: bool) -> None:
            if not stream:
                time.sleep(10.0)
                self._answer(200, {"choices": [{"index": 0, "text": "late"}]})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(100):
                event = f"data: {json.dumps({'choices': [{'index': 0, 'text': 'tick'}]})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return flaky, server


def write_model(repo: Path, name: str, upstreams: list[str], **params: object) -> None:
    (repo / name).mkdir(parents=True)
    lines = ['builtin = "openai-upstream"', "[params]", f"upstreams = {json.dumps(upstreams)}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in params.items()]
    (repo / name / "model.toml").write_text("\n".join(lines) + "\n")


@dataclass
class Servers:
    upstream: ServerProc
    front: ServerProc
    flaky: Flaky
    dead: str


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("upstream")
    (root / "up-repo" / "sim-llm").mkdir(parents=True)
    (root / "up-repo" / "sim-llm" / "model.toml").write_text('builtin = "sim-llm"\n')
    upstream = start_server(root, "--model-repo", str(root / "up-repo"))
    flaky, flaky_server = start_flaky()
    dead = f"http://127.0.0.1:{free_port()}/v1"
    live = f"{upstream.url}/v1"
    repo = root / "front-repo"
    common = {"upstream_model": "sim-llm", "api_key_env": KEY_ENV, "probe_interval_s": 0.2}
    write_model(repo, "up", [live, flaky.url, dead], **common)
    write_model(repo, "dead-only", [dead], **common)
    write_model(repo, "tight", [live], max_inflight_per_upstream=1, **common)
    write_model(repo, "broken", [flaky.url], upstream_model="half-stream", probe_interval_s=0.2)
    write_model(repo, "slow", [flaky.url], upstream_model="slow", probe_interval_s=0.2)
    os.environ[KEY_ENV] = KEY
    try:
        front = start_server(root, "--model-repo", str(repo), "--no-admin")
    finally:
        del os.environ[KEY_ENV]
    try:
        wait_for(lambda: gauge(front, "inferd_upstream_health", "tight", live) == 2, "live upstream up")
        yield Servers(upstream, front, flaky, dead)
    finally:
        assert front.stop() in (0, -15)
        assert upstream.stop() in (0, -15)
        flaky_server.shutdown()


def client(s: Servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.front.url}/v1", api_key="unused", max_retries=0)


def expected(prompt: str, seed: int | None, n: int) -> str:
    return " ".join(sim_llm_tokens(prompt, seed, n))


def scrape(server: ServerProc) -> str:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(server: ServerProc, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", scrape(server), re.M)
    return float(found.group(1)) if found else float("nan")


def gauge(server: ServerProc, name: str, model: str, upstream: str) -> float:
    return metric(server, f'{name}{{model="{model}",upstream="{upstream}",version="1"}}')


def wait_for(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.05)


def test_models_lists_upstream_models(servers: Servers) -> None:
    assert {"up", "dead-only", "tight"} <= {m.id for m in client(servers).models.list()}


def test_completion_through_the_front_is_the_upstreams_tokens(servers: Servers) -> None:
    for i in range(12):  # enough that least-in-flight round-robin sends some to the flaky upstream first
        prompt = f"forward number {i} please"
        out = client(servers).completions.create(model="up", prompt=prompt, max_tokens=7, seed=i)
        assert out.choices[0].text == expected(prompt, i, 7)
        assert out.usage.completion_tokens == 7
    assert metric(servers.front, 'inferd_upstream_retries_total{model="up",version="1"}') >= 1
    assert servers.flaky.posts >= 1, "the flaky upstream never got a request: retries were not exercised"
    assert set(servers.flaky.authorizations) == {f"Bearer {KEY}"}
    wait_for(lambda: gauge(servers.front, "inferd_upstream_health", "up", servers.dead) == 0, "dead ejected")
    assert gauge(servers.front, "inferd_upstream_health", "up", servers.flaky.url) == 0, "flaky not ejected"
    failures = f'inferd_upstream_attempts_total{{model="up",outcome="failure",upstream="{servers.flaky.url}",version="1"}}'
    assert metric(servers.front, failures) >= 1


def test_streamed_completion_is_relayed_with_usage_only_when_asked(servers: Servers) -> None:
    c = client(servers)
    prompt = "stream through the front"
    plain = list(c.completions.create(model="up", prompt=prompt, max_tokens=15, seed=4, stream=True))
    assert "".join(ch.choices[0].text for ch in plain if ch.choices) == expected(prompt, 4, 15)
    assert all(ch.choices for ch in plain), "a usage chunk the client did not ask for was relayed"
    with_usage = list(
        c.completions.create(
            model="up",
            prompt=prompt,
            max_tokens=15,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 15


def test_chat_stream_and_not(servers: Servers) -> None:
    messages = [{"role": "user", "content": "hello upstream"}]
    prompt = sim_llm_chat_prompt(messages)
    c = client(servers)
    out = c.chat.completions.create(model="up", messages=messages, max_tokens=9, seed=2)
    assert out.choices[0].message.content == expected(prompt, 2, 9)
    chunks = list(c.chat.completions.create(model="up", messages=messages, max_tokens=9, seed=2, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected(prompt, 2, 9)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_dead_only_upstream_is_a_clear_503(servers: Servers) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        client(servers).completions.create(model="dead-only", prompt="anyone there", max_tokens=3)
    assert info.value.status_code == 503
    assert servers.dead in info.value.body["message"]
    assert "dead-only" in info.value.body["message"]


def test_upstream_errors_pass_through_in_openai_shape(servers: Servers) -> None:
    prompt = " ".join(["word"] * 2040)
    with pytest.raises(openai.BadRequestError) as info:
        client(servers).completions.create(model="up", prompt=prompt, max_tokens=100)
    assert info.value.body["code"] == "context_length_exceeded"


async def test_full_upstream_gives_a_fast_429_and_disconnect_cancels_upstream(servers: Servers) -> None:
    aborts = 'inferd_llm_client_aborts_total{model="sim-llm",version="1"}'
    aborts_before = metric(servers.upstream, aborts)
    body = {"model": "tight", "prompt": "a very long story", "max_tokens": 1500, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{servers.front.url}/v1/completions", json=body) as r:
            assert r.status == 200
            events = 0
            async for line in r.content:
                events += line.startswith(b"data: ")
                if events == 3:
                    break
            started = time.monotonic()
            async with http.post(f"{servers.front.url}/v1/completions", json=body) as full:
                assert full.status == 429
                assert int(full.headers["Retry-After"]) >= 1
                assert (await full.json())["error"]["type"] == "overloaded_error"
            assert time.monotonic() - started < 1.0
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while metric(servers.upstream, aborts) == aborts_before:
        assert time.monotonic() < deadline, "the upstream never saw the client leave"
        await asyncio.sleep(0.05)
    assert metric(servers.upstream, aborts) == aborts_before + 1
    assert metric(servers.upstream, 'inferd_llm_streams{model="sim-llm",version="1"}') == 0
    assert (
        gauge(servers.front, "inferd_upstream_inflight_requests", "tight", f"{servers.upstream.url}/v1") == 0
    )


def test_token_timing_metrics_of_upstream_models(servers: Servers) -> None:
    ttft = 'inferd_time_to_first_token_seconds_count{model="up",version="1"}'
    generated = 'inferd_generation_tokens_total{model="up",version="1"}'
    before = scrape(servers.front)
    ttft_before = metric(servers.front, ttft) if ttft in before else 0.0
    generated_before = metric(servers.front, generated) if generated in before else 0.0
    stream = client(servers).completions.create(model="up", prompt="time me", max_tokens=6, stream=True)
    assert sum(1 for _ in stream) == 6
    assert metric(servers.front, ttft) == ttft_before + 1
    assert metric(servers.front, 'inferd_inter_token_latency_seconds_count{model="up",version="1"}') >= 5
    assert metric(servers.front, generated) == generated_before + 6
    assert metric(servers.front, 'inferd_llm_request_duration_seconds_count{model="up",version="1"}') >= 1


async def test_upstream_failing_mid_stream_ends_with_an_error_event(servers: Servers) -> None:
    body = {"model": "broken", "prompt": "x", "max_tokens": 5, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{servers.front.url}/v1/completions", json=body) as r:
            assert r.status == 200
            events = [line async for line in r.content if line.startswith(b"data: ")]
    assert len(events) == 4, events
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]]
    assert texts == ["half", "way"]
    error = json.loads(events[2][6:])["error"]
    assert error["code"] == "WorkerDied" and servers.flaky.url in error["message"]
    assert events[3] == b"data: [DONE]\n"
    failures = f'inferd_upstream_attempts_total{{model="broken",outcome="failure",upstream="{servers.flaky.url}",version="1"}}'
    assert metric(servers.front, failures) == 1


async def test_a_deadline_travels_upstream_and_bounds_the_call(servers: Servers) -> None:
    body = {"model": "slow", "prompt": "x", "max_tokens": 5}
    async with aiohttp.ClientSession() as http:
        headers = {"X-Request-Timeout-Ms": "500"}
        async with http.post(f"{servers.front.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 504  # the upstream answers after 10 s
            error = (await r.json())["error"]
        assert error["code"] == "DeadlineExceeded" and error["type"] == "server_error"
        assert 0 < int(servers.flaky.timeouts_ms[-1] or 0) <= 500
        streamed = {**body, "stream": True}
        async with http.post(f"{servers.front.url}/v1/completions", json=streamed, headers=headers) as r:
            assert r.status == 200
            events = [line async for line in r.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        assert json.loads(events[-2][6:])["error"]["code"] == "DeadlineExceeded"
        assert all("choices" in json.loads(e[6:]) for e in events[:-2])
        for bad in ("soon", "0", "600001"):
            bad_header = {"X-Request-Timeout-Ms": bad}
            async with http.post(f"{servers.front.url}/v1/completions", json=body, headers=bad_header) as r:
                assert r.status == 400, bad
        long = {"model": "tight", "prompt": "a story that takes long", "max_tokens": 1500}
        async with http.post(f"{servers.front.url}/v1/completions", json=long, headers=headers) as r:
            assert r.status == 504
    # the upstream inferd ended the sequence too: its own deadline, or the front closing the connection
    running = 'inferd_llm_sequences{model="sim-llm",state="running",version="1"}'
    wait_for(lambda: metric(servers.upstream, running) == 0, "the upstream's engine ended the sequence")
    assert metric(servers.upstream, 'inferd_llm_streams{model="sim-llm",version="1"}') == 0
    assert metric(servers.upstream, 'inferd_llm_kv_usage_ratio{model="sim-llm",version="1"}') == 0


def test_upstream_requests_are_accounted_like_every_other_model(servers: Servers) -> None:
    """One request accounting for all kinds: upstream answers, refusals and their reasons land in the same
    series as batch and LLM models, labelled by model and version (run after the 429 test above)."""
    ok = 'inferd_requests_total{model="up",outcome="ok",protocol="http",version="1"}'
    before = metric(servers.front, ok)
    client(servers).completions.create(model="up", prompt="count me", max_tokens=3, seed=1)
    assert metric(servers.front, ok) == before + 1
    assert (
        metric(servers.front, 'inferd_request_duration_seconds_count{model="up",outcome="ok",protocol="http",version="1"}')
        >= 1
    )
    assert metric(servers.front, 'inferd_requests_total{model="tight",outcome="rejected",protocol="http",version="1"}') >= 1
    refused = 'inferd_requests_rejected_total{model="tight",reason="upstreams_full",version="1"}'
    assert metric(servers.front, refused) >= 1
