"""`inferd fleet-sim ... --shared-devices` run in-process with the simulation spied on: the flag must reach
the simulated fleet's spec (the JSON's "shared_devices" only echoes it)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from typer.testing import CliRunner

from inferd.cli.main import app


def shared_devices_reach_the_fleet(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, args: list[str]
) -> None:
    """Runs `args` with and without --shared-devices, `module.name` (the command's simulate) spied on."""
    simulate: Callable[[Any], Any] = getattr(module, name)
    simulated: list[bool] = []

    def spy(spec: Any) -> Any:
        simulated.append(spec.shared_devices)
        return simulate(spec)

    monkeypatch.setattr(module, name, spy)
    inferd_log = logging.getLogger("inferd")
    level = inferd_log.level  # a command may quiet inferd's loggers, as a process of its own may
    try:
        for flag in (["--shared-devices"], []):
            sim = CliRunner().invoke(app, [*args, "--warmup", "1", *flag, "--json"])
            assert sim.exit_code == 0, sim.output
            out = json.loads(sim.output)
            assert out["shared_devices"] is bool(flag) and out["ok"] == out["requests"] > 0
    finally:
        inferd_log.setLevel(level)  # not for the tests after this one
    assert simulated == [True, False]
