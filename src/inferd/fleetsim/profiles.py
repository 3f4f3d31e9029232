"""Device cost models: what one batch of n items costs on one device, and what the serving path adds.

A profile is fitted from a measured run (`inferd bench --save-profile FILE` records each answer's batch
size and compute time from the lifecycle headers, its framework overhead, and the server's CPU per
request), or given from published figures, and then says so in `source`. Profiles are JSON files:

    {"name": "sim@this-host", "kind": "batch", "base_s": 0.0201, "per_item_s": 0.000101,
     "jitter_cv": 0.02, "overhead_s": 0.0011, "frontend_s": 0.00012, "source": "measured: ..."}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from inferd.config import ConfigError

FORMAT = "batch"
"""The file's "kind" field: which simulator's cost model the file holds (a file format tag, read by
`BatchProfile.load`; a file without one is a batch profile, as the first files were)."""


@dataclass(frozen=True, slots=True)
class BatchProfile:
    """One device of a batch model, and the serving path around it."""

    name: str
    base_s: float
    """Fixed cost of a batch on the device."""
    per_item_s: float
    """Cost of each item of a batch."""
    jitter_cv: float = 0.0
    """Coefficient of variation of a batch's cost around the line (from the fit's residuals)."""
    overhead_s: float = 0.0
    """Latency the serving path adds to every answer outside queue and compute: HTTP, IPC, the reply
    (the median measured overhead)."""
    frontend_s: float = 0.0
    """Front-end CPU per request: one front end process serves at most 1 / frontend_s requests/s."""
    source: str = "unspecified"
    kind: str = FORMAT

    def batch_s(self, n: int) -> float:
        return self.base_s + self.per_item_s * n

    def capacity_per_device(self, max_batch_size: int) -> float:
        """Requests/s one device sustains with full batches."""
        return max_batch_size / self.batch_s(max_batch_size)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> BatchProfile:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"device profile {path}: {exc}") from None
        if raw.get("kind", FORMAT) != FORMAT:
            raise ConfigError(f"device profile {path} is a {raw.get('kind')!r} profile, not a batch one")
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise ConfigError(f"device profile {path}: unknown fields {unknown}; known: {sorted(fields)}")
        profile = cls(**raw)
        if profile.base_s < 0 or profile.per_item_s < 0 or profile.base_s + profile.per_item_s <= 0:
            raise ConfigError(f"device profile {path}: base_s and per_item_s must be >= 0, not both 0")
        return profile


def fit_cost_line(points: dict[int, tuple[int, float, float]]) -> tuple[float, float, float]:
    """(base_s, per_item_s, jitter_cv) by weighted least squares over batches. `points` maps a batch size
    to (batches seen, summed compute seconds, summed squared compute seconds); the cv is the root mean
    square of each batch's relative distance from the line. One size only: per_item_s is 0."""
    sizes = sorted(n for n, (count, _, _) in points.items() if count > 0)
    if not sizes:
        raise ValueError("no batches measured: nothing to fit")
    weights = [points[n][0] for n in sizes]
    means = [points[n][1] / points[n][0] for n in sizes]
    total = sum(weights)
    base, slope = means[0], 0.0
    if len(sizes) > 1:
        mx = sum(w * x for w, x in zip(weights, sizes, strict=True)) / total
        my = sum(w * y for w, y in zip(weights, means, strict=True)) / total
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, sizes, strict=True))
        sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, sizes, means, strict=True))
        slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        base = max(0.0, my - slope * mx)
    squares = 0.0
    for n in sizes:
        count, total_s, total_sq = points[n]
        line = base + slope * n
        if line > 0:
            squares += (total_sq - 2 * line * total_s + count * line * line) / (line * line)
    return base, slope, math.sqrt(max(0.0, squares) / total)


def profile_from_phase(phase: Any, name: str, source: str, frontend_s: float = 0.0) -> BatchProfile:
    """A profile fitted on one measured phase of `inferd bench` (bench/report.py PhaseReport): the cost
    line and jitter from its answers' batch sizes and compute times, the median framework overhead, and
    the front end's CPU per request when it was measured (else 0)."""
    points = {
        int(n): (answers / int(n), total / int(n), squares / int(n))
        for n, (answers, total, squares) in phase.batch_costs.items()
        if int(n) > 0
    }
    base, per_item, cv = fit_cost_line(points)
    overhead_ms = phase.overhead_ms.get("p50") or 0.0
    return BatchProfile(
        name=name,
        base_s=round(base, 6),
        per_item_s=round(per_item, 8),
        jitter_cv=round(cv, 4),
        overhead_s=round(overhead_ms / 1000.0, 6),
        frontend_s=round(frontend_s, 7),
        source=source,
    )


def server_cpu_s(url: str) -> float | None:
    """The server's front-end CPU seconds so far (`process_cpu_seconds_total` on its /metrics; with several
    front ends, their sum), or None when it does not say."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=5) as r:  # nosec B310  # the bench's http(s) URL
            text = r.read().decode()
    except OSError:
        return None
    samples = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "process_cpu_seconds_total"
    ]
    return sum(samples) if samples else None


def save_measured_profile(
    path: Path, report: Any, url: str, model: str, rate: float, duration_s: float, cpu_before: float | None
) -> BatchProfile:
    """`inferd bench --save-profile`: fit the measured phase and write the profile."""
    import socket

    cpu_after = server_cpu_s(url)
    per_request = 0.0
    if cpu_before is not None and cpu_after is not None and report.sent:
        per_request = (cpu_after - cpu_before) / report.sent
    source = f"measured: inferd bench --model {model} --rate {rate:g} --duration {duration_s:g} on {socket.gethostname()}"
    profile = profile_from_phase(report.measured, f"{model}@{socket.gethostname()}", source, per_request)
    profile.save(path)
    return profile
