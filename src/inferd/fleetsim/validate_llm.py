"""The sim-llm case of `inferd fleet-sim validate`: a real `inferd serve` with sim-llm on W workers
against the LLM simulator (fleetsim/llm_fleet.py), at 50% and 80% of the fitted capacity.

1. `inferd serve --model sim-llm --workers W` starts with the case's step costs and engine budgets
   (per_context_token_ms = 0: the fitted profile's form, base + per token, is then the device's);
2. a calibration run at 30% of the nominal capacity (`inferd bench-llm`'s generator) is fitted into an
   LLM profile (fleetsim/llm_profile.py profile_from_llm_run): the profile comes from another run than
   the ones validated;
3. for each load, a real open-loop run and a simulated one with the very same requests (arrival times,
   prompt and output lengths: bench/llm_workload.py plan_requests);
4. compared: throughput (completed requests/s) within 5%, and the p99 of whole-request latency (e2e,
   arrival to the last token) within 20%. e2e rather than TTFT: at these loads a request's TTFT is one
   or two steps, a few ms, where the host's scheduling noise is as large as the figure itself.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec, plan_requests
from inferd.fleetsim.llm_fleet import LLMFleetSpec, simulate_llm
from inferd.fleetsim.llm_plan import LLMTargets, max_rate
from inferd.fleetsim.llm_profile import LLMProfile, profile_from_llm_run
from inferd.fleetsim.llm_report import LLMSimReport
from inferd.fleetsim.validate import CaseResult, serve

CALIBRATION_LOAD = 0.3


@dataclass(frozen=True, slots=True)
class LLMCase:
    name: str = "sim-llm 2 workers (e2e p99)"
    workers: int = 2
    step_base_ms: float = 5.0
    per_token_ms: float = 0.05
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist(64, 256))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist(32, 96))
    loads: tuple[float, ...] = (0.5, 0.8)
    scheduler: dict[str, int] = field(
        default_factory=lambda: {"max_num_seqs": 32, "max_num_batched_tokens": 512, "num_blocks": 1024}
    )

    def config_toml(self) -> str:
        s = ", ".join(f"{k} = {v}" for k, v in self.scheduler.items())
        return (
            "[models.sim-llm]\n"
            f"params = {{ step_base_ms = {self.step_base_ms}, per_token_ms = {self.per_token_ms}, "
            f"per_context_token_ms = 0.0, scheduler = {{ {s} }} }}\n"
        )

    def capacity(self, profile: LLMProfile) -> float:
        """Requests/s of the case's workers under the profile: 90% of saturation, within max_num_seqs."""
        t = LLMTargets(1.0, int(self.prompt_tokens.mean), int(self.output_tokens.mean), 1e9, 1e9, None, 0.9)
        return self.workers * max_rate(profile, t)[0].rate

    def nominal(self) -> LLMProfile:
        return LLMProfile(
            "nominal", self.step_base_ms / 1000, self.per_token_ms / 1000, scheduler=self.scheduler
        )


@contextlib.contextmanager
def llm_server(case: LLMCase, log_dir: Path) -> Iterator[str]:
    """`inferd serve` with only sim-llm at the case's costs and workers; yields its URL."""
    with serve("sim-llm", case.workers, case.config_toml(), log_dir) as (url, _):
        yield url


def load_spec(
    case: LLMCase, url: str, rate: float, duration_s: float, warmup_s: float, seed: int
) -> LLMLoadSpec:
    return LLMLoadSpec(
        url=url, model="sim-llm", rate=rate, duration_s=duration_s, warmup_s=warmup_s,
        prompt_tokens=case.prompt_tokens, output_tokens=case.output_tokens, seed=seed, timeout_s=60.0,
    )  # fmt: skip


def simulated(case: LLMCase, profile: LLMProfile, spec: LLMLoadSpec) -> LLMSimReport:
    """The same requests (times and lengths) through the simulator."""
    plan = plan_requests(spec)
    arrivals = np.asarray([r.offset_s for r in plan], dtype=float)
    prompts = np.asarray([r.prompt_tokens for r in plan])
    outputs = np.asarray([r.max_tokens for r in plan])
    slo = {"ttft_ms": spec.ttft_slo_ms, "itl_ms": spec.itl_slo_ms}
    return simulate_llm(
        LLMFleetSpec(
            profile, case.workers, arrivals, prompts, outputs, warmup_s=spec.warmup_s, slo=slo, seed=7
        )
    )


def calibrate(case: LLMCase, url: str, duration_s: float) -> LLMProfile:
    spec = load_spec(case, url, CALIBRATION_LOAD * case.capacity(case.nominal()), duration_s, 1.0, 99)
    report = run_llm_load_blocking(spec)
    source = (
        f"measured: inferd bench-llm at {spec.rate:.1f} req/s for {duration_s:g} s on {socket.gethostname()}"
    )
    return profile_from_llm_run(report.measured, case.name, source, case.workers, None, dict(case.scheduler))


def run_llm_case(
    case: LLMCase, duration_s: float, warmup_s: float, log_dir: Path
) -> list[tuple[CaseResult, Any, LLMSimReport]]:
    """Each load's comparison, with the real phase report and the simulated one."""
    out = []
    with llm_server(case, log_dir) as url:
        profile = calibrate(case, url, max(6.0, duration_s / 2))
        capacity = case.capacity(profile)
        for load in case.loads:
            spec = load_spec(case, url, load * capacity, duration_s, warmup_s, 7)
            real = run_llm_load_blocking(spec).measured
            sim = simulated(case, profile, spec)
            out.append((compare_llm(case, load, spec.rate, real, sim), real, sim))
    return out


def compare_llm(
    case: LLMCase,
    load: float,
    rate: float,
    real: Any,
    sim: LLMSimReport,
    tolerances: tuple[float, float] = (0.05, 0.2),
) -> CaseResult:
    real_p99 = real.e2e_ms.get("p99")
    thr_error = abs(sim.throughput_rps - real.request_rps) / max(real.request_rps, 1e-9)
    p99_error = (
        None if real_p99 is None or sim.e2e_p99_ms is None else abs(sim.e2e_p99_ms - real_p99) / real_p99
    )
    ok = thr_error <= tolerances[0] and p99_error is not None and p99_error <= tolerances[1]
    return CaseResult(
        case.name, case.workers, load, round(rate, 2), round(real.request_rps, 2), round(sim.throughput_rps, 2),
        None if real_p99 is None else round(real_p99, 1), sim.e2e_p99_ms, None, 0.0, round(thr_error, 4),
        None if p99_error is None else round(p99_error, 4), ok,
    )  # fmt: skip


def validate_llm(duration_s: float, warmup_s: float) -> list[CaseResult]:
    """The sim-llm case (about 45 s on a quiet 2-core machine)."""
    with tempfile.TemporaryDirectory(prefix="inferd-fleet-sim-llm-") as tmp:
        return [result for result, _, _ in run_llm_case(LLMCase(), duration_s, warmup_s, Path(tmp))]
