"""Hypothesis settings of the fuzz tests, chosen by HYPOTHESIS_PROFILE (read only here, by tests).

- "ci" (the default): a short pass, under a minute for every fuzz test together.
- "long": many more examples per test; run it by hand (docs/reliability.md, "Fuzzing").

Each fuzz test takes `fuzz(scale)`: its share of the profile's examples (slow targets ask for fewer),
so the other hypothesis tests of a session keep their own settings.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_EXAMPLES = {"ci": 400, "long": 5_000}
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci").removeprefix("fuzz-")
if _PROFILE not in _EXAMPLES:
    _PROFILE = "ci"
LONG = _PROFILE == "long"


def time_limit(ci_s: int) -> int:
    """A fuzz file's pytest-timeout: `ci_s` in the short pass, 30 times that in the long one."""
    return ci_s * 30 if LONG else ci_s


def fuzz(scale: float = 1.0) -> settings:
    """Settings for one fuzz test: `scale` x the profile's example count, no per-example deadline (a loaded
    2-core box would flake), the pytest-timeout of the file bounds the whole test instead."""
    return settings(
        max_examples=max(10, int(_EXAMPLES[_PROFILE] * scale)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        derandomize=not LONG,
    )
