"""Telemetry from fake sysfs trees (real Orin layouts), the sampler, and the placement policy."""
from __future__ import annotations

import os
import time

import pytest
from tests.support.fake_jetson import FakeJetson, agx_orin, orin_nano, orin_nx

from edgemm.config import PlacementConfig, PowerConfig, load_config
from edgemm.engine.route import Route
from edgemm.power.policy import Governor, Load, PowerPolicy, holds
from edgemm.power.telemetry import Sampler, Sensors, Telemetry

# ---- telemetry -------------------------------------------------------------------------------


def test_orin_nx_total_is_vdd_in(tmp_path):
    orin_nx(tmp_path)
    t = Sensors.discover(tmp_path).read()
    assert t.rails_w == {"VDD_IN": 5.0, "VDD_CPU_GPU_CV": 1.5, "VDD_SOC": 1.25}  # mV × mA
    assert t.total_w == 5.0  # the module input, not the sum of rails it already contains
    assert t.temps_c["tj-thermal"] == 46.0 and t.temps_c["cpu-thermal"] == 45.5
    assert t.temps_c["cv0-thermal"] is None  # -256 °C means offline: absent, not cold
    assert t.hottest == ("tj-thermal", 46.0)
    assert t.gpu_load == pytest.approx(0.12)
    assert t.nvpmodel == "MAXN (0)" and t.dla_cores == 2


def test_agx_orin_total_is_the_sum_of_rails(tmp_path):
    agx_orin(tmp_path)
    t = Sensors.discover(tmp_path).read()
    assert set(t.rails_w) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}  # NC skipped
    assert t.total_w == pytest.approx(4.0 + 2.0 + 3.0 + 1.0)
    assert t.gpu_load == pytest.approx(0.5)  # the JetPack 5 ga10b devfreq path
    assert t.nvpmodel == "15W (2)" and t.dla_cores == 2


def test_orin_nano_has_no_dla(tmp_path):
    orin_nano(tmp_path)
    assert Sensors.discover(tmp_path).read().dla_cores == 0


def test_nothing_there_is_absent_never_zero(tmp_path):
    t = Sensors.discover(tmp_path).read()
    assert t.rails_w == {} and t.temps_c == {}
    assert t.total_w is None and t.gpu_load is None and t.nvpmodel is None and t.hottest is None
    assert t.dla_cores is None  # no /sys/bus/platform here: unknown, which is not "0 cores"


def test_missing_rail_file_makes_that_rail_and_the_total_absent(tmp_path):
    jetson = orin_nx(tmp_path)
    sensors = Sensors.discover(tmp_path)
    jetson.rail_file("VDD_IN").unlink()
    t = sensors.read()
    assert t.rails_w["VDD_IN"] is None and t.total_w is None  # not 0, and not the sum of the other rails
    assert t.rails_w["VDD_SOC"] == 1.25


def test_unreadable_rail_on_agx_makes_the_sum_absent(tmp_path):
    jetson = agx_orin(tmp_path)
    sensors = Sensors.discover(tmp_path)
    path = jetson.rail_file("VDD_CPU_CV")
    path.unlink()
    path.mkdir()  # reading a folder fails with EISDIR, even as root
    assert sensors.read().total_w is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied_is_absent(tmp_path):
    jetson = orin_nx(tmp_path)
    jetson.zone_file("tj-thermal").chmod(0)
    assert Sensors.discover(tmp_path).read().temps_c["tj-thermal"] is None


def test_garbage_and_missing_sensor_files(tmp_path):
    jetson = orin_nx(tmp_path)
    jetson.zone_file("gpu-thermal").write_text("not a number\n")
    jetson.gpu_load_file().unlink()
    (tmp_path / "var/lib/nvpmodel/status").write_text("pmode:0007\n")
    t = Sensors.discover(tmp_path).read()
    assert t.temps_c["gpu-thermal"] is None
    assert t.gpu_load is None  # no load file: the GPU is not found at all
    assert t.nvpmodel == "mode 7"  # an id the conf does not name


def test_readings_follow_the_files(tmp_path):
    jetson = orin_nx(tmp_path)
    sensors = Sensors.discover(tmp_path)
    jetson.set_temp("tj-thermal", 91.5)
    jetson.set_rail("VDD_IN", 5000, 3000)
    jetson.set_gpu_load(999)
    t = sensors.read()
    assert t.hottest == ("tj-thermal", 91.5) and t.total_w == 15.0 and t.gpu_load == pytest.approx(0.999)


# ---- the sampler -----------------------------------------------------------------------------


def test_sampler_keeps_a_short_history_in_the_background(tmp_path):
    jetson = orin_nx(tmp_path)
    sampler = Sampler(Sensors.discover(tmp_path), period_s=0.05, history=3).start()
    try:
        assert sampler.latest() is not None  # a reading as soon as it starts
        jetson.set_temp("tj-thermal", 70)
        deadline = time.monotonic() + 5
        while sampler.latest().hottest[1] != 70 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sampler.latest().hottest == ("tj-thermal", 70.0)
        time.sleep(0.3)
        assert len(sampler.history()) == 3
    finally:
        sampler.stop()
    assert not sampler._thread.is_alive()


def test_energy_per_request(tmp_path):
    jetson = orin_nx(tmp_path)
    sampler = Sampler(Sensors.discover(tmp_path), history=10)
    sampler.sample()  # 5 W
    now = time.monotonic()
    assert sampler.energy_j(now - 2.0, now) == pytest.approx(10.0)  # shorter than a period: last reading
    jetson.set_rail("VDD_IN", 5000, 3000)  # 15 W
    start = time.monotonic()
    sampler.sample()
    sampler.sample()
    assert sampler.energy_j(start, start + 1.0) == pytest.approx(15.0)
    assert Sampler(Sensors.discover(tmp_path / "nothing")).energy_j(0, 1) is None


# ---- the policy: a scenario table -------------------------------------------------------------

PLACEMENT = PlacementConfig(vision_encoder=["gpu", "dla0", "dla1"], embed_tokens=["cpu", "gpu"],
                            decoder=["gpu", "cpu"])
POWER = PowerConfig(throttle_c=85, critical_c=95, budget_w=15, slo_ms=200, hysteresis_c=5, hysteresis_pct=10)
POLICY = PowerPolicy(POWER, PLACEMENT, allow=("critical", "slo"))


def reading(tj: float = 46.0, watts: float = 6.0, dla: int | None = 2) -> Telemetry:
    return Telemetry(time.monotonic(), {"VDD_IN": watts}, watts, {"cpu-thermal": 40.0, "tj-thermal": tj},
                     0.1, "MAXN (0)", dla)


CLOUD = {"vision_encoder": "cloud", "embed_tokens": "cloud", "decoder": "cloud"}
SCENARIOS = {
    # name: (telemetry, load, offload state, expected stages, words in the reason)
    "cool/idle": (reading(), Load(0, 50), "closed",
                  {"vision_encoder": "gpu", "embed_tokens": "cpu", "decoder": "gpu"}, "cool and idle"),
    "hot": (reading(tj=88), Load(0, 50), "closed",
            {"vision_encoder": "dla0", "embed_tokens": "cpu", "decoder": "gpu"}, "hot: tj-thermal at 88.0"),
    "critical": (reading(tj=97), Load(0, 50), "closed", CLOUD, "critical"),
    "critical, offload off": (reading(tj=97), Load(0, 50), "off",
                              {"vision_encoder": "dla0", "embed_tokens": "cpu", "decoder": "gpu"}, "offload is off"),
    "over budget": (reading(watts=21), Load(0, 50), "closed",
                    {"vision_encoder": "dla0", "embed_tokens": "cpu", "decoder": "gpu"}, "over budget: 21.0 W"),
    "SLO at risk": (reading(), Load(2, 60), "closed",  # 3 × 60 = 180 ms ≥ 80 % of 200
                    {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}, "SLO at risk"),
    "SLO missed": (reading(), Load(4, 60), "closed", CLOUD, "SLO would be missed"),
    "SLO missed, offload off": (reading(), Load(4, 60), "off",
                                {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}, "offload is off"),
    "SLO missed, breaker open": (reading(), Load(4, 60), "open",
                                 {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}, "breaker open"),
    "critical, breaker half open": (reading(tj=97), Load(0, 50), "half_open", CLOUD, "critical"),
    "hot, no DLA on the module": (reading(tj=88, dla=0), Load(0, 50), "closed",
                                  {"vision_encoder": "gpu", "embed_tokens": "cpu", "decoder": "gpu"}, "no DLA"),
    "no telemetry (not a Jetson)": (None, Load(), "off",
                                    {"vision_encoder": "gpu", "embed_tokens": "cpu", "decoder": "gpu"}, "configured"),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_policy_scenarios(name):
    telemetry, load, offload, expected, words = SCENARIOS[name]
    placement = POLICY.decide(telemetry, load, offload)
    assert placement.stages == expected, placement.reason
    assert words in placement.reason
    assert POLICY.decide(telemetry, load, offload) == placement  # a pure function


def test_hot_is_not_offloaded_unless_allowed():
    assert not POLICY.decide(reading(tj=88), Load(), "closed").cloud
    assert PowerPolicy(POWER, PLACEMENT, allow=("hot",)).decide(reading(tj=88), Load(), "closed").cloud


def test_only_dla_listed_and_no_dla_falls_back_to_gpu():
    policy = PowerPolicy(POWER, PlacementConfig(vision_encoder=["dla0"]))
    assert policy.decide(reading(dla=0), Load()).stages["vision_encoder"] == "gpu"
    assert policy.decide(reading(dla=1), Load()).stages["vision_encoder"] == "dla0"
    dla1 = PowerPolicy(POWER, PlacementConfig(vision_encoder=["dla1", "cpu"]))
    assert dla1.decide(reading(dla=1), Load()).stages["vision_encoder"] == "cpu"  # one core: dla1 is not there


def test_default_config_keeps_everything_on_cpu_and_local():
    policy = PowerPolicy.from_config(load_config(None))
    for telemetry in (None, reading(), reading(tj=99), reading(watts=80)):
        placement = policy.decide(telemetry, Load(100, 1000), "off")
        assert set(placement.stages.values()) == {"cpu"} and not placement.cloud


# ---- hysteresis -------------------------------------------------------------------------------


def run(policy: PowerPolicy, temps: list[float], offload: str = "closed") -> list[str]:
    previous, seen = None, []
    for tj in temps:
        previous = policy.decide(reading(tj=tj), Load(0, 50), offload, previous)
        seen.append(previous.stages["vision_encoder"])
    return seen


def test_temperature_wobbling_at_the_threshold_does_not_flap():
    wobble = [84, 86, 84.5, 85.5, 83, 86, 82, 81]  # around throttle_c = 85, never below 80
    assert run(POLICY, wobble) == ["gpu"] + ["dla0"] * 7
    assert run(POLICY, [86, 79.9, 84, 85]) == ["dla0", "gpu", "gpu", "dla0"]  # leaves below 80, re-enters at 85


def test_critical_wobble_stays_in_the_cloud_until_well_below():
    assert run(POLICY, [96, 94, 95.5, 91, 89.9]) == ["cloud", "cloud", "cloud", "cloud", "dla0"]


def test_budget_and_slo_hysteresis():
    over = POLICY.decide(reading(watts=16), Load(0, 50))
    assert "over_budget" in over.conditions
    assert "over_budget" in POLICY.decide(reading(watts=14), Load(0, 50), previous=over).conditions  # > 13.5
    assert "over_budget" not in POLICY.decide(reading(watts=13), Load(0, 50), previous=over).conditions
    assert "over_budget" not in POLICY.decide(reading(watts=14), Load(0, 50)).conditions  # not before: not now
    missed = POLICY.decide(reading(), Load(4, 60), "closed")
    assert missed.cloud
    assert POLICY.decide(reading(), Load(3, 46), "closed", missed).cloud  # 184 ms: still ≥ 180 (200 - 10 %)
    assert not POLICY.decide(reading(), Load(2, 46), "closed", missed).cloud  # 138 ms


def test_holds():
    assert holds(85, 85, 80, False) and not holds(84.9, 85, 80, False)
    assert holds(80, 85, 80, True) and not holds(79.9, 85, 80, True)
    assert not holds(15, 15, 13.5, False, strict=True)


# ---- the governor: the daemon's memory ----------------------------------------------------------


def test_governor_tracks_latency_decisions_and_energy(tmp_path):
    orin_nx(tmp_path)  # 5 W
    sampler = Sampler(Sensors.discover(tmp_path))
    sampler.sample()
    governor = Governor(PowerPolicy(POWER, PLACEMENT, ("slo",)), sampler)
    assert governor.decide(0, "closed").stages["vision_encoder"] == "gpu"
    assert governor.observe(100.0) == pytest.approx(0.5)  # 5 W × 0.1 s
    assert governor.latency_ms == 100.0
    governor.observe(200.0)
    assert governor.latency_ms == pytest.approx(120.0)  # a moving average, not the last value
    assert governor.decide(1, "closed").cloud  # 2 × 120 ms > 200 ms SLO
    figures = governor.figures()
    assert figures["decisions"] == {"local": 1, "cloud": 1}
    assert figures["energy_j"]["requests"] == 2 and figures["energy_j"]["total"] == pytest.approx(1.5)


def test_governor_without_sensors_reports_no_energy():
    governor = Governor(PowerPolicy(), None)
    assert governor.observe(50.0) is None and governor.figures()["energy_j"]["mean"] is None


def test_placement_to_dict():
    placement = Route({"vision_encoder": "dla0"}, "hot", frozenset({"hot"}))
    assert placement.to_dict() == {"stages": {"vision_encoder": "dla0"}, "reason": "hot", "conditions": ["hot"]}


def test_fake_tree_end_to_end(tmp_path):
    jetson: FakeJetson = agx_orin(tmp_path)
    jetson.set_temp("gpu-thermal", 90)
    placement = POLICY.decide(Sensors.discover(tmp_path).read(), Load(), "off")
    assert placement.stages["vision_encoder"] == "dla0" and "gpu-thermal at 90.0" in placement.reason
