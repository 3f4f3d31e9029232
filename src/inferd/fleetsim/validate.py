"""`inferd fleet-sim validate`: run small cases for real on this machine and in simulation, and compare.

For each case (a `sim` device of a given cost, W workers, F front ends):
1. a real `inferd serve` starts (W local workers; with F > 1, `--frontends F`, every worker joined to
   every front end and granting it batch credits, simulated as devices shared by every front end under
   the worker's own credit ledger);
2. a calibration run at 30% of the nominal capacity is measured, and a device profile is fitted from
   it (cost line, overhead, front-end CPU): the profile comes from another run than the ones validated;
3. for each load (50% and 80% of the fitted capacity), a real open-loop Poisson run (`inferd bench`'s
   load generator) and a simulated one with the same arrival times (the same seed), on the same model
   configuration, run through inferd's own runtime in the simulator;
4. each case's throughput and p99 are compared: within 5% and 20% by default.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess  # nosec B404  # starts `inferd serve` itself (sys.executable), never a shell
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.bench.load_spec import LoadSpec
from inferd.bench.loadgen import run_load_blocking
from inferd.bench.open_loop import arrival_offsets
from inferd.config import ModelConfig
from inferd.fleetsim.batch_fleet import FleetSpec, simulate
from inferd.fleetsim.profiles import BatchProfile, profile_from_phase
from inferd.models.sim import sim_config

CALIBRATION_LOAD = 0.3


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    workers: int
    base_ms: float
    per_item_ms: float
    loads: tuple[float, ...] = (0.5, 0.8)
    max_batch_size: int = 100
    max_wait_ms: float = 10.0
    frontends: int = 1

    def model(self) -> ModelConfig:
        return sim_config(
            base_ms=self.base_ms,
            per_item_ms=self.per_item_ms,
            max_batch_size=self.max_batch_size,
            max_wait_ms=self.max_wait_ms,
        )


@dataclass(frozen=True, slots=True)
class CaseResult:
    case: str
    workers: int
    load: float
    rate: float
    real_rps: float
    sim_rps: float
    real_p99_ms: float | None
    sim_p99_ms: float | None
    real_batch: float | None
    sim_batch: float
    throughput_error: float
    p99_error: float | None
    ok: bool


# A device slow enough that 4 workers' full load stays within what one front end and the load generator
# sustain on 2 cores (~500 req/s per worker).
FULL = (
    Case("sim 1 worker", 1, 100.0, 1.0),
    Case("sim 2 workers", 2, 100.0, 1.0),
    Case("sim 4 workers", 4, 100.0, 1.0),
    Case("sim 2 workers, 2 front ends", 2, 100.0, 1.0, frontends=2),
    Case("sim 2 workers, 3 front ends", 2, 100.0, 1.0, frontends=3),
)
QUICK = (Case("sim 1 worker", 1, 100.0, 1.0), Case("sim 2 workers", 2, 100.0, 1.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(
    model: str, workers: int, config_toml: str, log_dir: Path, frontends: int = 1
) -> Iterator[tuple[str, int]]:
    """`inferd serve` with only `model`, its workers, `frontends` front ends and a config file; yields
    (url, pid), stops it after."""
    port = _free_port()
    config = log_dir / f"fleet-sim-{model}-{port}.toml"
    config.write_text(config_toml)
    log = (log_dir / f"fleet-sim-{model}-{port}.log").open("wb")
    cmd = [sys.executable, "-m", "inferd.cli.main", "serve", "--port", str(port), "--admin-port", "0", "--no-grpc"]
    cmd += ["--model", model, "--workers", str(workers), "--config", str(config)]
    cmd += ["--shutdown-grace-s", "0"] + (["--frontends", str(frontends)] if frontends > 1 else [])
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # nosec B603  # our own argv
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"inferd serve did not become ready; see {log.name}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def real_server(case: Case, log_dir: Path) -> contextlib.AbstractContextManager[tuple[str, int]]:
    """`inferd serve` with only `sim` at the case's cost and workers; yields (url, pid)."""
    return serve(
        "sim",
        case.workers,
        "[models.sim]\n"
        f"max_batch_size = {case.max_batch_size}\nmax_wait_ms = {case.max_wait_ms}\n"
        f"params = {{ base_ms = {case.base_ms}, per_item_ms = {case.per_item_ms} }}\n",
        log_dir,
        case.frontends,
    )


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:  # nosec B310  # http://127.0.0.1
            return r.status == 200
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (the front end), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def frontend_pids(pid: int, frontends: int) -> list[int]:
    """The front-end processes of the server `pid`: itself, or with several, the parent's children."""
    if frontends == 1:
        return [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def calibrate(case: Case, url: str, pid: int, duration_s: float) -> BatchProfile:
    """A profile fitted on a run at CALIBRATION_LOAD of the case's nominal capacity."""
    nominal = case.workers * case.model().max_batch_size / ((case.base_ms + case.per_item_ms * 100) / 1000)
    spec = LoadSpec(url=url, rate=CALIBRATION_LOAD * nominal, duration_s=duration_s, warmup_s=1.0, seed=99)
    pids = frontend_pids(pid, case.frontends)
    before = sum(map(cpu_seconds, pids))
    report = run_load_blocking(spec)
    per_request = (sum(map(cpu_seconds, pids)) - before) / max(1, report.sent)
    source = f"measured: inferd bench at {spec.rate:.0f} req/s for {duration_s:g} s on {socket.gethostname()}"
    return profile_from_phase(report.measured, f"{case.name}@{socket.gethostname()}", source, per_request)


def run_case(case: Case, duration_s: float, warmup_s: float, log_dir: Path) -> list[CaseResult]:
    results = []
    with real_server(case, log_dir) as (url, pid):
        profile = calibrate(case, url, pid, max(4.0, duration_s / 2))
        capacity = case.workers * profile.capacity_per_device(case.max_batch_size)
        for load in case.loads:
            spec = LoadSpec(url=url, rate=load * capacity, duration_s=duration_s, warmup_s=warmup_s, seed=7)
            real = run_load_blocking(spec).measured
            arrivals = np.asarray(arrival_offsets(spec), dtype=float)
            sim = simulate(
                FleetSpec(
                    case.model(), profile, case.workers, arrivals, case.frontends, warmup_s=warmup_s, seed=7
                )
            )  # fmt: skip
            results.append(compare(case, load, spec.rate, real, sim))
    return results


def compare(
    case: Case, load: float, rate: float, real: Any, sim: Any, tolerances: tuple[float, float] = (0.05, 0.2)
) -> CaseResult:
    real_p99 = real.latency_ms.get("p99")
    thr_error = abs(sim.throughput_rps - real.achieved_rps) / max(real.achieved_rps, 1e-9)
    p99_error = None if real_p99 is None or sim.p99_ms is None else abs(sim.p99_ms - real_p99) / real_p99
    ok = thr_error <= tolerances[0] and p99_error is not None and p99_error <= tolerances[1]
    return CaseResult(
        case.name,
        case.workers,
        load,
        round(rate, 1),
        round(real.achieved_rps, 1),
        round(sim.throughput_rps, 1),
        real_p99,
        sim.p99_ms,
        real.batch_size.get("mean"),
        sim.answer_batch_size,
        round(thr_error, 4),
        None if p99_error is None else round(p99_error, 4),
        ok,
    )


def validate(quick: bool, duration_s: float, warmup_s: float) -> list[CaseResult]:
    cases = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="inferd-fleet-sim-") as tmp:
        return [r for case in cases for r in run_case(case, duration_s, warmup_s, Path(tmp))]


def to_json(results: list[CaseResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=1)
