"""`inferd plan llm --zones N`: the fleet over N zones, each sized so that the N - 1 left carry the whole
load when one is lost; what that headroom costs against the plan for no zone's loss; one zone is the plan
as it was. The arithmetic (fleetsim/zone_plan.py), the plan's resources, reasoning and JSON, the command."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from inferd.cli.main import app
from inferd.fleetsim.llm_plan import LLMTargets, plan_llm
from inferd.fleetsim.llm_profile import bundled
from inferd.fleetsim.zone_plan import size_zones


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("zones", [2, 3, 4, 5])
@pytest.mark.parametrize("rps", [1.0, 37.0, 500.0, 10_000.0, 123_456.0])
def test_any_zones_left_carry_the_load_and_no_fewer_devices_would(rps: float, zones: int, shared: bool) -> None:
    rate, fe_rps = 28.7, 76.0
    z = size_zones(rps, rate, fe_rps, zones, shared)
    assert (z.devices, z.frontends) == (zones * z.devices_per_zone, zones * z.frontends_per_zone)
    left = zones - 1
    # the zones left, at r per device and fe_rps per front end, carry everything
    assert left * z.devices_per_zone * rate >= rps and left * z.frontends_per_zone * fe_rps >= rps
    assert z.to_dict(None)["rate_per_device_one_lost"] <= round(rate, 3)
    if shared:  # and one device fewer per zone would not
        assert left * (z.devices_per_zone - 1) * rate < rps
    else:  # partitioned: each front end's own devices carry its share at <= r
        each = z.devices_per_zone // z.frontends_per_zone
        assert z.devices_per_zone == z.frontends_per_zone * each and each * rate * z.frontends_per_zone * left >= rps
    assert left * (z.frontends_per_zone - 1) * fe_rps < rps
    # the headroom is against the plan for no zone's loss, which one zone is
    one = size_zones(rps, rate, fe_rps, 1, shared)
    assert (one.devices, one.frontends) == (z.no_loss_devices, z.no_loss_frontends)
    d = z.to_dict(2.0)
    assert d["headroom_devices"] == z.devices - one.devices >= 0
    assert d["headroom_cost_per_hour"] == pytest.approx(2.0 * d["headroom_devices"])
    assert d["rate_per_device_all_up"] < d["rate_per_device_one_lost"]


def test_one_zone_is_the_plan_as_it_was() -> None:
    rate, fe_rps = 28.7, 76.0
    shared, split = size_zones(10_000, rate, fe_rps, 1, True), size_zones(10_000, rate, fe_rps, 1, False)
    assert shared.frontends == split.frontends == math.ceil(10_000 / fe_rps) + 1  # the spare
    assert shared.devices == math.ceil(10_000 / rate)
    assert split.devices == split.frontends * math.ceil(10_000 / split.frontends / rate)
    d = shared.to_dict(2.0)
    assert d["survives_zone_loss"] is False and d["headroom_devices"] == d["headroom_frontends"] == 0
    assert d["rps_per_zone_one_lost"] is None and d["rate_per_device_one_lost"] is None
    with pytest.raises(ValueError, match="zones must be at least 1, not 0"):
        size_zones(10_000, rate, fe_rps, 0, True)


def test_three_zones_cost_about_half_again_and_two_about_double() -> None:
    rate, fe_rps = 28.7, 76.0
    one = size_zones(100_000, rate, fe_rps, 1, True).devices
    assert size_zones(100_000, rate, fe_rps, 3, True).devices / one == pytest.approx(1.5, abs=0.01)
    assert size_zones(100_000, rate, fe_rps, 2, True).devices / one == pytest.approx(2.0, abs=0.01)


def test_the_plan_counts_every_zone_in_its_resources_cost_and_reasoning() -> None:
    profile = bundled()
    t = LLMTargets(10_000, 500, 200, 1000, 100, device_cost_per_hour=2.0)
    one = plan_llm(profile, t, check=False)
    three = plan_llm(profile, t, check=False, zones=3)
    r = one.details["rate_per_device"]
    assert three.details["rate_per_device"] == r  # zones change how many devices, not what each does
    z = three.zones
    assert z is not None and z["zones"] == 3 and z["survives_zone_loss"]
    assert three.resources.devices == 3 * math.ceil(10_000 / 2 / one.details["analytic_rate_per_device"])
    assert three.resources.devices == 3 * z["devices_per_zone"] and three.resources.frontends == 3 * z["frontends_per_zone"]
    assert z["no_loss_devices"] == one.resources.devices and z["no_loss_frontends"] == one.resources.frontends
    assert z["headroom_devices"] == three.resources.devices - one.resources.devices > 0
    assert three.resources.cores == three.resources.frontends + 2 * three.resources.devices
    assert three.resources.processes == three.resources.frontends + three.resources.devices
    assert three.cost is not None and three.cost.per_hour == pytest.approx(2.0 * three.resources.devices)
    assert z["headroom_cost_per_hour"] == pytest.approx(2.0 * z["headroom_devices"])
    assert three.inputs["zones"] == 3 and one.inputs["zones"] == 1
    (step,) = [s for s in three.reasoning if s.startswith("zones: 3")]
    assert f"{z['headroom_devices']:,} devices" in step and "+50%" in step
    assert any(s.startswith("zones: 1 (no zone's loss planned for") for s in one.reasoning)
    # the steps before the zones' say the plan for no zone's loss; the cores' step counts every zone
    assert any(s.startswith(f"devices = ceil(10000 / {r:.2f}) = {one.resources.devices:,}") for s in three.reasoning)
    assert any(s.startswith(f"cores = {three.resources.frontends} front ends") for s in three.reasoning)
    with pytest.raises(ValueError, match="zones must be at least 1"):
        plan_llm(profile, t, check=False, zones=0)


def test_plan_llm_says_its_zones_in_text_and_json() -> None:
    runner = CliRunner()
    base = ["plan", "llm", "--rps", "10000", "--no-check", "--device-cost-per-hour", "2"]
    out = json.loads(runner.invoke(app, [*base, "--zones", "3", "--json"]).output)
    assert out["zones"]["zones"] == 3 and out["inputs"]["zones"] == 3
    assert out["resources"]["devices"] == 3 * out["zones"]["devices_per_zone"]
    text = runner.invoke(app, [*base, "--zones", "3"])
    assert text.exit_code == 0, text.output
    z = out["zones"]
    assert f"zones:        3, each {z['devices_per_zone']:,} devices" in text.output
    assert f"headroom +{z['headroom_devices']:,} devices (+50% over the {z['no_loss_devices']:,}" in text.output
    plain = runner.invoke(app, base)
    assert "zones:        1 (no zone's loss planned for" in plain.output
    assert json.loads(runner.invoke(app, [*base, "--json"]).output)["zones"]["zones"] == 1
    refused = runner.invoke(app, [*base, "--zones", "0"])
    assert refused.exit_code == 2
