"""The LLM simulator against a real sim-llm server on this machine: `inferd fleet-sim validate`'s sim-llm
case (2 workers, profile fitted on a calibration run, 50% and 80% of its capacity) is within its
tolerances: completed requests/s within 5% and the p99 of whole-request latency within 20%."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.fleetsim.validate_llm import LLMCase, run_llm_case

pytestmark = pytest.mark.slow


def test_sim_llm_at_two_workers_matches_the_simulator(tmp_path: Path) -> None:
    # the CLI's default window (12 s, ~480 requests at 80%): a p99 over fewer requests rests on 2 or 3 of
    # them, and one late step of this shared host then moves it past the 20% tolerance
    results = run_llm_case(LLMCase(), 12.0, 2.0, tmp_path)
    assert [r.load for r, _, _ in results] == [0.5, 0.8]
    for result, real, sim in results:
        assert sum(real.errors.values()) == 0, real.errors
        assert sim.ok == sim.requests
        assert result.ok, result
