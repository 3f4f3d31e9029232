"""One worker shared by two front ends (`inferd.worker.main --connect A,B`), and front end A hung
(SIGSTOP; for an LLM worker, a scripted front end that stops reading): B keeps getting its answers, the worker cuts A off once A's link has not drained for
--stuck-after-s, and A, running again (SIGCONT), gets no wrong or duplicated answer and is served again.

A stopped front end stalls its link only once the kernel's socket buffers are full: on loopback TCP they
hold a few MiB, more than a worker's small messages fill in a test's time. So A's last batch is a bulky
answer (tests/bulky_sim.py: 12 MB, after a 2 s compute the test stops A in): were the device to wait for
A to read it, B would get nothing until A's link ended. Over TCP the kernel ends a link whose peer keeps
its window shut for the front end's heartbeat timeout (TCP_USER_TIMEOUT, worker/fronts.py
give_up_when_silent); Unix-socket links (the local workers of `--frontends N`) have no such limit, so the
test sets that timeout to 30 s: only the worker's own drain watch (--stuck-after-s 2) cuts A off in time.

Two `inferd serve` processes (one front end each, remote workers only, so each has a port of its own
and the test knows which front end a request reaches) and one worker process; loads bounded in count
and time."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from inferd.kinds.llm.sim_llm import VOCAB, SimTokenizer, sim_llm_config, sim_llm_tokens
from inferd.models.sim import sim_digest
from inferd.wire import protocol as p
from inferd.worker.main import Worker
from tests.bulky_sim import bulky_output
from tests.checked_load import Answer, Load, infer, tally, wait_answers, wait_for
from tests.conftest import ROOT, ServerProc, free_port, start_server

TOKEN = "join-secret-for-stuck-front-tests"
BULKY_BYTES = 12_000_000
STUCK_AFTER_S = 2.0
CONFIG = """
[server]
heartbeat_timeout_s = 30.0

[models.sim]
implementation = "tests.bulky_sim:BulkySim"
max_batch_size = 4
max_wait_ms = 2.0
batch_timeout_s = 60.0
params = {{ base_ms = 5.0, per_item_ms = 0.0, bulky_ms = 2000, bulky_bytes = {bulky}, started_log = "{started}" }}
"""


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/models/sim/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def answered_right(url: str) -> bool:
    """One request: True for its own answer; False for an error (a front end just resumed sheds load
    with 429 for a while: its event loop was "behind" while stopped); a wrong answer fails the test."""
    text = f"after-{time.monotonic_ns()}"
    answer = infer(url, text)
    if answer is None or answer.status != 200:
        return False
    assert answer.body == sim_digest("sim", 1, text), answer
    return True


def start_shared_worker(tmp_path: Path, ports: tuple[int, int]) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd.worker.main",
            "--connect",
            ",".join(f"127.0.0.1:{port}" for port in ports),
            "--model",
            "sim",
            "--token",
            TOKEN,
            "--worker-id",
            "shared-1",
            "--reconnect",
            "--stuck-after-s",
            str(STUCK_AFTER_S),
        ],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    return proc, log_path


def test_a_hung_front_end_neither_stalls_the_worker_it_shares_nor_gets_wrong_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERD_JOIN_TOKEN", TOKEN)
    started = tmp_path / "bulky-started.log"
    config = tmp_path / "inferd.toml"
    config.write_text(CONFIG.format(bulky=BULKY_BYTES, started=started))
    ports = (free_port(), free_port())
    servers: list[ServerProc] = []
    worker: subprocess.Popen[bytes] | None = None
    try:
        for port in ports:
            args = ("--model", "sim", "--workers", "0", "--worker-port", str(port), "--config", str(config))
            servers.append(start_server(tmp_path, *args, ready_path="/v2/health/live"))
        a, b = servers
        worker, worker_log = start_shared_worker(tmp_path, ports)
        wait_for(lambda: ready(a.url) and ready(b.url), 30, "the shared worker ready on both front ends")
        bulky: list[Answer | None] = []
        with Load(b.url, "b", clients=2, max_requests=2000, max_s=40) as b_load:
            with Load(a.url, "a", clients=1, max_requests=400, max_s=40) as a_load:
                wait_answers(b_load, 20)
                wait_answers(a_load, 5)
                asker = threading.Thread(target=lambda: bulky.append(infer(a.url, "!bulky-1")), daemon=True)
                asker.start()
                wait_for(
                    lambda: started.exists() and "!bulky-1" in started.read_text(), 20, "the bulky batch"
                )
                os.kill(a.proc.pid, signal.SIGSTOP)  # before its bulky answer is written
                try:
                    wait_answers(b_load, 30, within_s=20)  # B is served while A is stopped
                    cut = f"cutting off the front end at 127.0.0.1:{ports[0]}"
                    wait_for(lambda: cut in worker_log.read_text(), 20, "the worker cutting A off")
                    wait_answers(b_load, 30, within_s=20)  # ... and after A was cut off
                finally:
                    os.kill(a.proc.pid, signal.SIGCONT)
                asker.join(60)
                wait_for(lambda: answered_right(a.url), 30, "A served again by the worker")
        assert bulky and (
            bulky[0] is None
            or bulky[0].status != 200
            or bulky[0].body == bulky_output("!bulky-1", BULKY_BYTES)
        ), "A's bulky answer, if any, is its own"
        for load in (a_load, b_load):
            t = tally(load)
            assert t.misrouted == 0 and t.duplicated == 0, t
        t = tally(b_load)
        assert t.lost == 0 and t.refused == 0, f"B lost requests while A hung: {t}"
        assert "cutting off the front end" not in worker_log.read_text().replace(cut, ""), "only A is cut off"
    finally:
        for server in servers:
            os.kill(server.proc.pid, signal.SIGCONT)
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for server in servers:
            server.stop()


async def test_an_llm_worker_goes_on_for_one_front_end_while_another_reads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In one process: a worker's LLM engine serving two scripted front ends on Unix sockets (no kernel
    timeout ends such a link). X places 32 long sequences and then reads nothing: its token deltas
    fill the socket (about 200 KB) within a second or two. Y's sequences still run to their end, and the
    worker cuts X off; X, reading again, finds its connection ended."""
    config = sim_llm_config(params={"step_base_ms": 1.0, "per_token_ms": 0.0, "per_context_token_ms": 0.0})
    tok = SimTokenizer()
    welcome = p.Welcome(
        accepted=True, model_config_json=config.model_dump_json().encode(), heartbeat_s=0.2, credits=True
    )
    y_tokens: dict[str, list[int]] = {}
    y_done: dict[str, str] = {}
    x_ended = asyncio.Event()
    x_joins: list[bool] = []
    reading_again = asyncio.Event()

    async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert isinstance(await p.read_message(reader), p.Hello)
        writer.write(p.encode_frame(welcome))
        assert isinstance(await p.read_message(reader), p.Ready)

    async def front_y(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer)
        for i in range(4):
            writer.write(p.encode_frame(p.AddSequence(f"y-{i}", tok.encode(f"y prompt {i}"), 1500, seed=i)))
        try:
            while len(y_done) < 4:
                msg = await p.read_message(reader)
                for d in msg.all_deltas() if isinstance(msg, p.StepDeltas) else []:
                    y_tokens.setdefault(d.seq_id, []).extend(d.token_ids)
                    if d.finish_reason:
                        y_done[d.seq_id] = d.finish_reason
            writer.write(p.encode_frame(p.Drain()))
            while True:
                await p.read_message(reader)
        except p.ConnectionClosed:
            pass
        finally:
            writer.close()

    async def front_x(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = not x_joins
        x_joins.append(first)
        await join(reader, writer)
        if first:
            for i in range(32):
                writer.write(p.encode_frame(p.AddSequence(f"x-{i}", tok.encode(f"x {i}"), 1900, seed=i)))
            await reading_again.wait()  # reads nothing until then
        try:
            while True:
                await p.read_message(reader)
        except p.ConnectionClosed:
            if first:
                x_ended.set()
        finally:
            writer.close()

    y_server = await asyncio.start_unix_server(front_y, path=str(tmp_path / "y.sock"))
    x_server = await asyncio.start_unix_server(front_x, path=str(tmp_path / "x.sock"))
    worker = Worker(
        f"unix:{tmp_path / 'y.sock'},unix:{tmp_path / 'x.sock'}", "sim-llm", "", "w-0", stuck_after_s=1.0
    )
    try:
        with caplog.at_level(logging.WARNING, logger="inferd.worker"):
            code = await asyncio.wait_for(worker.run(), 30)  # Y drains it once its sequences are done
        reading_again.set()
        await asyncio.wait_for(x_ended.wait(), 10)
    finally:
        reading_again.set()
        for server in (y_server, x_server):
            server.close()
            await server.wait_closed()
    assert code == 0
    assert y_done == {f"y-{i}": "length" for i in range(4)}
    for i in range(4):
        assert [VOCAB[t] for t in y_tokens[f"y-{i}"]] == sim_llm_tokens(f"y prompt {i}", i, 1500)
    assert any(
        f"cutting off the front end at unix:{tmp_path / 'x.sock'}" in r.getMessage() for r in caplog.records
    )
