"""LLM device cost models: what one engine step costs on one device, and what the serving path adds.

One step is one forward pass over every chunk the scheduler planned (inferd.kinds.llm.plan.StepPlan):

    step_s = step_base_s + per_token_s * tokens + per_context_token_s * context

`tokens` counts prefill chunk tokens and one token per decoding sequence, `context` the tokens each
chunk attends over (its start plus its length), the same form as sim-llm's own cost model. The base
is the weights' read (memory bound), the per-token term the matmuls (compute bound), the per-context
term the KV cache's read. A profile also holds the engine's budgets (`scheduler`, inferd's
SchedulerConfig fields: seats, tokens per step, KV blocks) and the front end's CPU per request and per
streamed token, for the planner.

Profiles are JSON files with "kind": "llm". They are fitted from a measured run (`inferd bench-llm
--save-profile FILE`) or given from published figures (the bundled ones in fleetsim/profiles/), and
`source` says which.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from inferd.config import ConfigError

BUNDLED = ("h100-llama3-8b",)
"""Profiles shipped in inferd/fleetsim/profiles/ (NAME.json)."""
FORMAT = "llm"
"""The file's "kind" field: which simulator's cost model the file holds (a file format tag, required:
a file without one is a batch device profile, fleetsim/profiles.py)."""
DEFAULT_FRONTEND_S = 1 / 7000
"""One front end process's CPU per request when a profile does not say: the measured ceiling of ~7,000
req/s of docs/benchmarks.md ("The front end's own ceiling", batch requests)."""


@dataclass(frozen=True, slots=True)
class LLMProfile:
    """One LLM device (an engine on one accelerator), and the serving path around it."""

    name: str
    step_base_s: float
    per_token_s: float
    per_context_token_s: float = 0.0
    jitter_cv: float = 0.0
    """Coefficient of variation of a step's cost around the model."""
    overhead_s: float = 0.0
    """Latency the serving path adds to the first token and to the end of each stream (HTTP, IPC)."""
    frontend_s: float = DEFAULT_FRONTEND_S
    """Front-end CPU per request (parse, route, open the stream)."""
    frontend_token_s: float = 0.0
    """Front-end CPU per streamed token (one SSE chunk each while the client keeps up)."""
    frontend_prompt_token_s: float = 0.0
    """Front-end CPU per prompt token (tokenizing the prompt)."""
    max_model_len: int = 4096
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The engine's budgets: inferd.kinds.llm.plan.SchedulerConfig fields."""
    device_memory_gib: float = 0.0
    """The accelerator's memory (for the plan's record; KV room is scheduler.num_blocks)."""
    host_memory_gib: float = 2.0
    """The worker process's host memory (weights staged, runtime)."""
    source: str = "unspecified"
    kind: str = FORMAT

    def step_s(self, tokens: int, context: int) -> float:
        return self.step_base_s + self.per_token_s * tokens + self.per_context_token_s * context

    def frontend_cpu_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Front-end CPU seconds one request costs."""
        return (
            self.frontend_s
            + prompt_tokens * self.frontend_prompt_token_s
            + output_tokens * self.frontend_token_s
        )

    def kv_tokens(self) -> int:
        """Tokens of KV cache one device holds (num_blocks x block_size)."""
        return int(self.scheduler.get("num_blocks", 1024)) * int(self.scheduler.get("block_size", 16))

    def model_params(self) -> dict[str, Any]:
        """`params` of the simulated model: the engine's budgets and context length."""
        return {"max_model_len": self.max_model_len, "scheduler": dict(self.scheduler)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> LLMProfile:
        if raw.get("kind") != FORMAT:
            raise ConfigError(
                f"device profile {where} is a {raw.get('kind', 'batch')!r} profile, not an llm one"
            )
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - fields - {"notes"})
        if unknown:
            raise ConfigError(f"device profile {where}: unknown fields {unknown}; known: {sorted(fields)}")
        profile = cls(**{k: v for k, v in raw.items() if k in fields})
        if min(profile.step_base_s, profile.per_token_s, profile.per_context_token_s) < 0:
            raise ConfigError(f"device profile {where}: step costs must be >= 0")
        if profile.step_base_s + profile.per_token_s <= 0:
            raise ConfigError(f"device profile {where}: step_base_s and per_token_s cannot both be 0")
        return profile

    @classmethod
    def load(cls, path: Path) -> LLMProfile:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"device profile {path}: {exc}") from None
        return cls.from_dict(raw, str(path))


def bundled(name: str = BUNDLED[0]) -> LLMProfile:
    """A profile shipped with inferd (published figures), by name."""
    if name not in BUNDLED:
        raise ConfigError(f"no bundled LLM profile {name!r}; bundled: {list(BUNDLED)}")
    text = resources.files("inferd.fleetsim").joinpath("profiles", f"{name}.json").read_text()
    return LLMProfile.from_dict(json.loads(text), f"bundled {name}")


def fit_llm_steps(ttft_fit: tuple[float, ...], itl_mean_s: float, tokens_per_s: float) -> tuple[float, float]:
    """(step_base_s, per_token_s) from what `inferd bench-llm` measures on one device, context folded into
    the per-token term (per_context_token_s = 0):

    - per_token_s: the slope of TTFT against prompt length, by least squares over the ok streams
      (`ttft_fit`: n, sum x, sum y, sum xx, sum xy): a longer prompt costs its extra prefill tokens;
    - step_base_s: from the mean ITL, the mean step time while streams decode: a step computes
      tokens_per_s x mean_step tokens (prompt and output) on average, so
      mean_step = base + per_token x tokens_per_s x mean_step, i.e. base = mean_step (1 - per_token x tokens_per_s).
    With every prompt one length the slope is unknown (0) and the base is the mean step; a slope that
    leaves under 10% of the step for the base (queueing grew with prompt length) is cut to that."""
    n, sx, sy, sxx, sxy = (list(ttft_fit) + [0.0] * 5)[:5]
    denominator = n * sxx - sx * sx
    per_token = max(0.0, (n * sxy - sx * sy) / denominator) if n > 1 and denominator > 0 else 0.0
    base = itl_mean_s * (1.0 - per_token * tokens_per_s)
    if base < 0.1 * itl_mean_s:
        base = 0.1 * itl_mean_s
        per_token = 0.9 / tokens_per_s if tokens_per_s > 0 else 0.0
    return base, per_token


def profile_from_llm_run(
    phase: Any,
    name: str,
    source: str,
    devices: int,
    cpu_per_request_s: float | None,
    scheduler: dict[str, Any],
) -> LLMProfile:
    """A profile fitted on one measured phase of `inferd bench-llm` (bench/llm_report.py LLMPhaseReport)
    against `devices` workers. The front end's measured CPU per request (if known) is split into
    DEFAULT_FRONTEND_S per request and the rest per streamed token. The serving overhead is the TTFT
    line's intercept less the 1.5 mean steps a new request waits on average (the step in progress, then
    its own prefill step)."""
    itl_mean_s = (phase.itl_ms.get("mean") or 0.0) / 1000.0
    if itl_mean_s <= 0 or not phase.ok:
        raise ValueError("the run has no inter-token gaps to fit: offer more load or longer outputs")
    tokens_per_s = (phase.prompt_tokens + phase.output_tokens) / phase.span_s / devices
    base, per_token = fit_llm_steps(phase.ttft_fit, itl_mean_s, tokens_per_s)
    n, sx, sy = phase.ttft_fit[:3]
    intercept = sy / n - per_token * sx / n
    overhead = max(0.0, intercept - 1.5 * itl_mean_s)
    frontend_s, frontend_token_s = DEFAULT_FRONTEND_S, 0.0
    if cpu_per_request_s is not None and phase.ok:
        per_request = min(cpu_per_request_s, DEFAULT_FRONTEND_S)
        mean_output = phase.output_tokens / phase.ok
        frontend_s = per_request
        frontend_token_s = max(0.0, cpu_per_request_s - per_request) / max(1.0, mean_output)
    return LLMProfile(
        name=name,
        step_base_s=round(base, 6),
        per_token_s=round(per_token, 9),
        overhead_s=round(overhead, 6),
        frontend_s=round(frontend_s, 7),
        frontend_token_s=round(frontend_token_s, 8),
        scheduler=scheduler,
        source=source,
    )


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(Poisson(mean) <= k) >= q."""
    term = total = math.exp(-mean)
    k = 0
    while total < q and k < 100_000:
        k += 1
        term *= mean / k
        total += term
    return k
