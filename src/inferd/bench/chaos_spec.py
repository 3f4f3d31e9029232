"""What `inferd bench --chaos` injects, how often, and where it finds the workers: `ChaosSpec`, and how
many injections its schedule holds for a window."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from inferd.bench.spec_checks import require

ChaosMode = Literal["none", "kill", "stop"]


@dataclass(frozen=True)
class ChaosSpec:
    """What to inject, how often, and where the admin API is."""

    mode: ChaosMode = "none"
    interval_s: float = 3.0
    """Seconds between injections."""
    start_s: float | None = None
    """First injection this many seconds into the measured window (None: `interval_s`)."""
    admin_url: str = "http://127.0.0.1:8002"  # the admin API of a server on port 8000
    admin_token: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer TOKEN` when set; never reported."""
    seed: int = 0
    """Seeds the choice of victims."""
    poll_s: float = 0.05
    """Admin poll period while measuring detection and replacement."""
    measure_timeout_s: float = 30.0
    """Longest one injection is measured; unmeasured times are reported as missing."""
    admin_timeout_s: float = 1.0
    """Per admin request."""
    after_window_s: float = 2.0
    """Requests intended within this long after an injection count as 'after injection'."""
    max_injections: int = 1000
    hostname: str | None = None
    """This machine's name as the admin API reports it (None: socket.gethostname())."""

    def __post_init__(self) -> None:
        checks = {
            "mode must be 'none', 'kill' or 'stop'": self.mode in ("none", "kill", "stop"),
            "interval_s must be > 0": self.interval_s > 0,
            "start_s must be >= 0": self.start_s is None or self.start_s >= 0,
            "poll_s must be > 0": self.poll_s > 0,
            "measure_timeout_s must be > 0": self.measure_timeout_s > 0,
            "admin_timeout_s must be > 0": self.admin_timeout_s > 0,
            "after_window_s must be > 0": self.after_window_s > 0,
            "max_injections must be >= 1": self.max_injections >= 1,
            "admin_url must be an http(s) URL": self.admin_url.startswith(("http://", "https://")),
        }
        require(checks, self)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def first_s(self) -> float:
        return self.interval_s if self.start_s is None else self.start_s

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "admin_token"}
        out["start_s"] = self.first_s
        out["admin_token_set"] = self.admin_token is not None
        return out


def planned_injections(spec: ChaosSpec, duration_s: float) -> int:
    """How many injections the schedule holds for a measured window of duration_s."""
    if not spec.enabled or spec.first_s >= duration_s:
        return 0
    return min(spec.max_injections, math.ceil((duration_s - spec.first_s) / spec.interval_s))
