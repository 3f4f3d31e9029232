"""Network faults between the router and a remote worker: partition, delay, loss, flapping, late results.

The remote worker (`inferd worker --connect`) runs in a network namespace of its own (tests/netns.py),
the router listens on the host end of the veth pair (its worker port over TLS, as off loopback it must be), and a local worker beside the router takes over what
the remote one held. nftables rules inside the namespace drop packets; a userspace relay (tests/relay.py)
adds delay or holds the worker's data. Clients send unique inputs and `sim` answers sha256-derived
digests, so every answer is checked against its own request (tests/checked_load.py); the model logs each
execution (tests/counting_sim.py), so re-runs are counted. Needs root, `ip` and `nft` (scripts/setup --test): without them the tests fail.

Each test prints one line of figures ("netfault ..."); run with -s to see them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import trustme

from tests.checked_load import Load, assert_exactly_once, report, tally, wait_answers, wait_for
from tests.conftest import ROOT, ServerProc, free_port, start_server
from tests.netns import NetNs
from tests.relay import Relay

TOKEN = "join-secret-for-network-faults"
HEARTBEAT_TIMEOUT_S = 2.0
"""The router's heartbeat_timeout_s here (workers beat every second)."""
REMOTE = "remote-1"
BASE_MS = 100.0
"""Cost of one sim batch: long enough that the remote worker always holds a batch under load. The batch
timeout is set far above it, so that silence (the heartbeat timeout), not a hung batch, gives a
partitioned worker away."""


# ---- argv: the one place that says how router and worker are started ----------------------------------
@dataclass(frozen=True)
class WorkerTls:
    """The worker port's certificate (for the host end of the veth pair) and the CA workers verify it by:
    off loopback a join token crosses only TLS (or plain TCP where both sides say --insecure)."""

    certfile: Path
    keyfile: Path
    ca_file: Path

    @staticmethod
    def issue(tmp_path: Path, host: str) -> WorkerTls:
        ca = trustme.CA()
        cert = ca.issue_cert(host)
        paths = WorkerTls(tmp_path / "worker-port.pem", tmp_path / "worker-port.key", tmp_path / "ca.pem")
        cert.cert_chain_pems[0].write_to_path(paths.certfile)
        cert.private_key_pem.write_to_path(paths.keyfile)
        ca.cert_pem.write_to_path(paths.ca_file)
        return paths


def router_args(
    config: Path, worker_host: str, worker_port: int, local_workers: int, tls: WorkerTls
) -> list[str]:
    """`inferd serve` arguments (start_server adds the ports): the worker port speaks TLS, the HTTP API
    (which the test's clients use on loopback) plain HTTP."""
    return [
        "--worker-ssl-certfile",
        str(tls.certfile),
        "--worker-ssl-keyfile",
        str(tls.keyfile),
        "--config",
        str(config),
        "--model",
        "sim",
        "--workers",
        str(local_workers),
        "--worker-host",
        worker_host,
        "--worker-port",
        str(worker_port),
    ]


def worker_argv(connect: str, tls: WorkerTls) -> list[str]:
    """`inferd worker` command line: it joins over TLS, verifying the router against the test's CA."""
    command = [sys.executable, "-m", "inferd.cli.main", "worker", "--ca-file", str(tls.ca_file)]
    return [*command, "--connect", connect, "--model", "sim", "--worker-id", REMOTE]


def write_config(tmp_path: Path, idempotent: bool) -> tuple[Path, Path]:
    exec_log = tmp_path / "executions.log"
    config = tmp_path / "inferd.toml"
    config.write_text(
        f"""
[server]
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}

[models.sim]
implementation = "tests.counting_sim:CountingSim"
idempotent = {"true" if idempotent else "false"}
max_batch_size = 4
max_wait_ms = 5.0
batch_timeout_s = 10.0
params = {{ base_ms = {BASE_MS}, per_item_ms = 0.0, exec_log = "{exec_log}" }}
"""
    )
    return config, exec_log


# ---- the fleet under test ---------------------------------------------------------------------------------
@dataclass
class Fleet:
    router: ServerProc
    ns: NetNs
    worker: subprocess.Popen[bytes]
    exec_log: Path
    relay: Relay | None

    def runs(self) -> list[tuple[int, float, str]]:
        """Every execution of an input, on any worker (warm-up excluded): (pid, wall time, input)."""
        text = self.exec_log.read_text() if self.exec_log.exists() else ""
        rows = [line.split(" ", 2) for line in text.splitlines()]  # a line being written may be partial
        return [(int(r[0]), float(r[1]), r[2]) for r in rows if len(r) == 3 and r[2] != "warmup"]

    def executions(self) -> Counter[str]:
        """How many times each input ran."""
        return Counter(item for _, _, item in self.runs())

    def events(self, pattern: str, after: float = 0.0) -> list[tuple[float, str]]:
        """Router log lines matching `pattern`, with their wall-clock time, logged after `after`."""
        found = []
        for line in self.router.log().splitlines():
            m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
            if m and re.search(pattern, line):
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if t >= after:
                    found.append((t, line))
        return found

    def wait_event(self, pattern: str, after: float, within_s: float) -> float:
        """When the router logged `pattern` (after `after`), waiting up to `within_s` for it."""
        wait_for(lambda: bool(self.events(pattern, after)), within_s, f"router log line /{pattern}/")
        return self.events(pattern, after)[0][0]

    def held_batches(self, after: float) -> int:
        """How many batches the remote worker held when the router gave it up (after `after`)."""
        self.wait_event(LOST, after, 10)
        m = re.search(LOST, self.events(LOST, after)[0][1])
        assert m is not None
        return int(m.group(1))

    def wait_remote_ready(self, after: float, within_s: float) -> float:
        """When the remote worker registered (after `after`)."""
        return self.wait_event(READY, after, within_s)

    def wait_remote_run(self, after: float, within_s: float) -> float:
        """When the remote worker first ran a batch after `after`: it serves again."""

        def first() -> float | None:
            return min(
                (at for pid, at, _ in self.runs() if pid == self.worker.pid and at > after), default=None
            )

        wait_for(lambda: first() is not None, within_s, "batch run by the remote worker")
        served = first()
        assert served is not None
        return served


KILLED = rf"killing worker {REMOTE} "
READY = rf"worker {REMOTE} \(pid \d+\) of model sim v\d+ is ready"
LOST = rf"worker {REMOTE} \(pid \d+\) of model sim lost: .*; (\d+) batch\(es\) in flight"


@contextmanager
def fleet(
    tmp_path: Path, *, idempotent: bool = True, local_workers: int = 1, relay_delay_s: float | None = None
) -> Iterator[Fleet]:
    """Router (with `local_workers` beside it) on the host end of a fresh veth pair, one remote worker in
    the namespace, optionally through a relay; everything is torn down whatever happens."""
    config, exec_log = write_config(tmp_path, idempotent)
    with ExitStack() as stack:
        ns = stack.enter_context(NetNs())
        worker_port = free_port()
        tls = WorkerTls.issue(tmp_path, ns.host_addr)
        router = start_server(
            tmp_path,
            *router_args(config, ns.host_addr, worker_port, local_workers, tls),
            ready_path="/v2/health/live",
        )
        stack.callback(router.stop)
        connect_port, relay = worker_port, None
        if relay_delay_s is not None:
            relay = stack.enter_context(Relay((ns.host_addr, 0), (ns.host_addr, worker_port), relay_delay_s))
            connect_port = relay.start()
        log = stack.enter_context(open(tmp_path / "remote-worker.log", "wb"))
        worker = subprocess.Popen(
            ns.argv(worker_argv(f"{ns.host_addr}:{connect_port}", tls)),
            env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        stack.callback(stop_process, worker)
        f = Fleet(router, ns, worker, exec_log, relay)
        f.wait_remote_ready(0.0, 60)
        yield f


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(autouse=True)
def join_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_JOIN_TOKEN", TOKEN)


# ---- the faults -------------------------------------------------------------------------------------------------
def test_partition_is_detected_and_held_batches_rerun_and_worker_rejoins(tmp_path: Path) -> None:
    with fleet(tmp_path) as f, Load(f.router.url, "partition") as load:
        wait_answers(load, 40)
        cut = time.time()
        f.ns.partition()
        killed = f.wait_event(KILLED, cut, 3 * HEARTBEAT_TIMEOUT_S)
        held = f.held_batches(cut)
        wait_answers(load, 40)  # the local worker carries on alone
        healed = time.time()
        f.ns.heal()
        rejoined = f.wait_remote_ready(healed, 30)
        wait_answers(load, 40)
    t = tally(load)
    rerun = sum(1 for n in f.executions().values() if n > 1)
    report(
        "partition",
        t,
        held_batches=held,
        rerun_items=rerun,
        detect_s=killed - cut,
        rejoin_s=rejoined - healed,
    )
    assert_exactly_once(t, load)
    assert t.refused == 0, [a for a in load.answers if a.status != 200][:3]
    assert held >= 1, "the remote worker held a batch when it was given up: the local one answered it"
    assert killed - cut <= HEARTBEAT_TIMEOUT_S + 2.0, "silence detected within the heartbeat timeout"


def test_delay_of_200ms_each_way_slows_answers_but_kills_nothing(tmp_path: Path) -> None:
    with fleet(tmp_path, local_workers=0, relay_delay_s=0.2) as f, Load(f.router.url, "delay", 4, 24) as load:
        load.finish()
    t = tally(load)
    fastest = min(a.latency_s for a in load.answers)
    kills = len(f.events(KILLED))
    report("delay", t, fastest_s=fastest, kills=kills)
    assert_exactly_once(t, load)
    assert t.refused == 0
    assert fastest >= 0.4, "every batch crossed the relay both ways (2 x 200 ms)"
    assert kills == 0, "a steady 200 ms delay is not silence: heartbeats arrive late but regularly"


def test_five_percent_loss_each_way_loses_no_answer(tmp_path: Path) -> None:
    with fleet(tmp_path, local_workers=0) as f:  # every answer crosses the lossy link
        f.ns.loss(5)
        with Load(f.router.url, "loss") as load:
            wait_answers(load, 200, within_s=40)
        dropped_in, dropped_out = f.ns.lost_packets()
        f.ns.heal()
    t = tally(load)
    remote_runs = sum(1 for pid, _, _ in f.runs() if pid == f.worker.pid)
    kills = len(f.events(KILLED))
    slowest = max(a.latency_s for a in load.answers)
    report(
        "loss",
        t,
        remote_runs=remote_runs,
        kills=kills,
        dropped_in=dropped_in,
        dropped_out=dropped_out,
        slowest_s=slowest,
    )
    assert_exactly_once(t, load)
    assert t.refused == 0, [a for a in load.answers if a.status != 200][:3]
    assert remote_runs >= t.ok, "the remote worker served every answer over the lossy link"
    assert dropped_in > 0 and dropped_out > 0, "packets were lost both ways"


FLAPS = ((0.5, 0.5), (3.0, 0.5), (0.5, 0.5), (3.0, 0.8))
"""(partitioned, healed) seconds: short cuts under the heartbeat timeout, long ones over it."""


def test_flapping_link_loses_no_answer_and_the_worker_serves_again(tmp_path: Path) -> None:
    with fleet(tmp_path) as f, Load(f.router.url, "flap") as load:
        wait_answers(load, 20)
        start = time.time()
        for down_s, up_s in FLAPS:
            f.ns.partition()
            time.sleep(down_s)
            f.ns.heal()
            time.sleep(up_s)
        healed = time.time() - FLAPS[-1][1]
        served = f.wait_remote_run(healed, 30)
        wait_answers(load, 20)
    t = tally(load)
    kills = len(f.events(KILLED, start))
    joins = len(f.events(READY, start))
    report("flapping", t, kills=kills, rejoins=joins, serves_again_s=served - healed)
    assert_exactly_once(t, load)
    assert t.refused == 0, [a for a in load.answers if a.status != 200][:3]
    assert kills >= 1 and joins >= 1, "a long cut outlasted the heartbeat timeout; the worker came back"


def test_results_late_on_a_dead_connection_are_discarded(tmp_path: Path) -> None:
    with fleet(tmp_path, relay_delay_s=0.0) as f, Load(f.router.url, "late", 16) as load:
        assert f.relay is not None
        wait_answers(load, 40)
        held_at = time.time()
        f.relay.hold()  # the router hears nothing more from the worker; the worker still hears it
        killed = f.wait_event(KILLED, held_at, 3 * HEARTBEAT_TIMEOUT_S)
        f.held_batches(held_at)
        wait_answers(load, 40)
        late = f.relay.statistics().held_bytes
        released = time.time()
        f.relay.release()
        wait_for(lambda: f.relay.statistics().discarded_bytes > 0, 10, "discarded late bytes")
        rejoined = f.wait_remote_ready(released, 30)
        wait_answers(load, 20)
    t = tally(load)
    # a batch that started 50 ms before the hold finished (100 ms) after it: its result was held too
    held_runs = {item for pid, at, item in f.runs() if pid == f.worker.pid and held_at - 0.05 <= at <= killed}
    counts = f.executions()
    report(
        "late results",
        t,
        late_bytes=late,
        held_items=len(held_runs),
        detect_s=killed - held_at,
        rejoin_s=rejoined - released,
    )
    assert_exactly_once(t, load)
    assert t.refused == 0
    assert killed - held_at <= HEARTBEAT_TIMEOUT_S + 2.0, "silence detected within the heartbeat timeout"
    assert held_runs, "the remote worker ran batches whose results the relay held"
    assert all(counts[item] == 2 for item in held_runs), "each held result was computed again elsewhere"


def test_a_model_that_is_not_idempotent_answers_503_and_never_runs_twice(tmp_path: Path) -> None:
    with fleet(tmp_path, idempotent=False, relay_delay_s=0.0) as f, Load(f.router.url, "once", 16) as load:
        assert f.relay is not None
        wait_answers(load, 40)
        held_at = time.time()
        f.relay.hold()  # an asymmetric partition: the worker runs every batch it gets, unheard
        f.wait_event(KILLED, held_at, 3 * HEARTBEAT_TIMEOUT_S)
        held = f.held_batches(held_at)
        wait_answers(load, 40)
        released = time.time()
        f.relay.release()
        f.wait_remote_ready(released, 30)
        wait_answers(load, 20)
    t = tally(load)
    refused = [a for a in load.answers if a.status != 200]
    counts = f.executions()
    report("not idempotent", t, held_batches=held, max_runs=max(counts.values()))
    assert_exactly_once(t, load)
    assert refused and all(a.status == 503 and "not idempotent" in a.body for a in refused), refused[:3]
    assert max(counts.values()) == 1, [item for item, n in counts.items() if n > 1]
