"""`inferd fleet-sim ... --shared-devices/--partitioned-devices` run in-process with the simulation spied
on: the flag must reach the simulated fleet's spec (the JSON's "shared_devices" only echoes it), and
without either flag several front ends share the devices."""

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
    """Runs `args` (several front ends) with --shared-devices, --partitioned-devices and neither,
    `module.name` (the command's simulate) spied on."""
    simulate: Callable[[Any], Any] = getattr(module, name)
    simulated: list[bool] = []

    def spy(spec: Any) -> Any:
        simulated.append(spec.shared_devices)
        return simulate(spec)

    monkeypatch.setattr(module, name, spy)
    inferd_log = logging.getLogger("inferd")
    level = inferd_log.level  # a command may quiet inferd's loggers, as a process of its own may
    try:
        for flag, shared in ((["--shared-devices"], True), (["--partitioned-devices"], False), ([], True)):
            sim = CliRunner().invoke(app, [*args, "--warmup", "1", *flag, "--json"])
            assert sim.exit_code == 0, sim.output
            out = json.loads(sim.output)
            assert out["shared_devices"] is shared and out["ok"] == out["requests"] > 0
    finally:
        inferd_log.setLevel(level)  # not for the tests after this one
    assert simulated == [True, False, True]
