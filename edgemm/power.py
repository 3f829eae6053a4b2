"""Jetson telemetry from sysfs, sampled in the background, and the placement policy.

    sysfs under power.root ─► Sensors.read() ─► Telemetry ─► Sampler (short history)
                                                    │
    queue depth, recent latency ─► Load ────────────┼─► PowerPolicy.decide ─► Route
    offload state (off | open | half_open | closed) ┘     (a device per stage + why)

Everything is read from plain files, so neither root nor the jtop daemon is needed:

- power rails: INA3221 monitors found by `/sys/bus/i2c/devices/*/name`, their
  `hwmon/hwmon*/in<N>_label`, `in<N>_input` (mV) and `curr<N>_input` (mA). The board
  total is `VDD_IN` where there is one (Orin NX / Nano), else the sum of the rails (AGX Orin);
- thermal zones: `/sys/devices/virtual/thermal/thermal_zone*/{type,temp}` (milli-°C);
- GPU load: the devfreq device whose `device/of_node/name` is the GPU, `device/load` (per-mille);
- power mode: `/var/lib/nvpmodel/status` (`pmode:0002`), named by `/etc/nvpmodel.conf`;
- DLA cores: `/sys/bus/platform/devices/*.nvdla<N>`.

A sensor that is not there is None, never 0: "no reading" must not look like "cool and idle".

The policy is a pure function of (telemetry, load, offload state, config, previous
placement); the previous placement is an input only for hysteresis. `Governor` is the
small stateful part the daemon keeps: the last placement, the recent latency, energy.
"""
from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from edgemm.config import Config, PlacementConfig, PowerConfig

STAGES = ("vision_encoder", "embed_tokens", "decoder")
GPU_NAMES = ("gv11b", "gp10b", "ga10b", "gb10b", "gpu")  # devfreq of_node names of Jetson iGPUs
OFFLINE_C = -100.0  # an offline zone reads -256 °C; nothing on a running board is this cold
SLO_RISK = 0.8  # the SLO is "at risk" from 80 % of it: move to the GPU before it is missed
LATENCY_WEIGHT = 0.2  # weight of the newest request in the latency average


# ---- reading files ------------------------------------------------------------------------

def read_text(path: Path) -> str | None:
    """The file's stripped text, or None when it is missing or unreadable."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except (OSError, ValueError):
        return None


def read_number(path: Path | None) -> float | None:
    """The first number in a sysfs file (some append units, e.g. '32760 ma'), or None."""
    text = read_text(path) if path is not None else None
    try:
        return float(text.split()[0]) if text else None
    except ValueError:
        return None


# ---- one reading ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Telemetry:
    time: float  # time.monotonic() of the reading
    rails_w: dict[str, float | None] = field(default_factory=dict)  # rail → watts; None = present but unreadable
    total_w: float | None = None  # board power: VDD_IN, else the sum of all rails; None if unknown
    temps_c: dict[str, float | None] = field(default_factory=dict)  # zone type → °C; None = offline or unreadable
    gpu_load: float | None = None  # 0..1
    nvpmodel: str | None = None  # e.g. "MAXN (0)"
    dla_cores: int | None = None  # None = could not tell

    @property
    def hottest(self) -> tuple[str, float] | None:
        readable = [(c, zone) for zone, c in self.temps_c.items() if c is not None]
        return (max(readable)[1], max(readable)[0]) if readable else None

    def to_dict(self) -> dict:
        hottest = self.hottest
        return {"rails_w": {k: _round(v) for k, v in self.rails_w.items()}, "total_w": _round(self.total_w),
                "temps_c": {k: _round(v) for k, v in self.temps_c.items()},
                "hottest": {"zone": hottest[0], "c": round(hottest[1], 1)} if hottest else None,
                "gpu_load": _round(self.gpu_load), "nvpmodel": self.nvpmodel, "dla_cores": self.dla_cores}


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ---- where the sensors are (found once, read every sample) -----------------------------------

@dataclass(frozen=True)
class Rail:
    name: str
    millivolts: Path
    milliamps: Path


@dataclass
class Sensors:
    root: Path
    rails: list[Rail] = field(default_factory=list)
    zones: dict[str, Path] = field(default_factory=dict)  # zone type → temp file
    gpu_load: Path | None = None
    nvpmodel_status: Path | None = None
    mode_names: dict[str, str] = field(default_factory=dict)  # nvpmodel id → name
    nvpmodel_fixed: str | None = None  # from `nvpmodel -q`, when the status file is unreadable
    dla_cores: int | None = None

    @classmethod
    def discover(cls, root: str | Path = "/", nvpmodel_query: bool = False) -> "Sensors":
        root = Path(root)
        sensors = cls(root, find_rails(root), find_zones(root), find_gpu_load(root),
                      dla_cores=count_dla(root))
        status = root / "var/lib/nvpmodel/status"
        sensors.nvpmodel_status = status if status.exists() else None
        sensors.mode_names = mode_names(root / "etc/nvpmodel.conf")
        if nvpmodel_query and read_text(status) is None:
            sensors.nvpmodel_fixed = query_nvpmodel()  # once: a subprocess per sample would cost too much
        return sensors

    def files(self) -> dict[str, list[Path]]:
        """The telemetry files found, by kind (for `edgemm doctor`)."""
        return {"power rails": [f for r in self.rails for f in (r.millivolts, r.milliamps)],
                "thermal zones": list(self.zones.values()),
                "GPU load": [self.gpu_load] if self.gpu_load else [],
                "power mode": [self.nvpmodel_status] if self.nvpmodel_status else []}

    def read(self) -> Telemetry:
        rails = {rail.name: rail_watts(rail) for rail in self.rails}
        temps = {zone: celsius(path) for zone, path in self.zones.items()}
        load = read_number(self.gpu_load)
        return Telemetry(time.monotonic(), rails, board_watts(rails), temps,
                         None if load is None else load / 1000.0, self.power_mode(), self.dla_cores)

    def power_mode(self) -> str | None:
        text = read_text(self.nvpmodel_status) if self.nvpmodel_status else None
        match = re.search(r"pmode:0*(\d+)", text or "")
        if match is None:
            return self.nvpmodel_fixed
        mode = match.group(1)
        return f"{self.mode_names[mode]} ({mode})" if mode in self.mode_names else f"mode {mode}"


def find_rails(root: Path) -> list[Rail]:
    rails: list[Rail] = []
    for device in sorted((root / "sys/bus/i2c/devices").glob("*")):
        if "ina3221" not in (read_text(device / "name") or ""):
            continue
        for hwmon in sorted(device.glob("hwmon/hwmon*")):
            for label in sorted(hwmon.glob("in*_label")):
                channel = label.name[2:-len("_label")]
                name = read_text(label) or f"{device.name}/in{channel}"
                # "NC" channels are not connected; "sum of shunt voltages" is no rail of its own
                if name.startswith("NC") or name.startswith("sum of shunt"):
                    continue
                if any(r.name == name for r in rails):
                    name = f"{name}@{device.name}"
                rails.append(Rail(name, hwmon / f"in{channel}_input", hwmon / f"curr{channel}_input"))
    return rails


def find_zones(root: Path) -> dict[str, Path]:
    zones: dict[str, Path] = {}
    folders = (root / "sys/devices/virtual/thermal").glob("thermal_zone*")
    for folder in sorted(folders, key=lambda p: int(p.name[len("thermal_zone"):] or 0)):
        name = read_text(folder / "type") or folder.name
        if "pmic" in name.lower():  # PMIC-Die reports a fixed placeholder, not a temperature
            continue
        zones[name if name not in zones else f"{name}.{folder.name}"] = folder / "temp"
    return zones


def find_gpu_load(root: Path) -> Path | None:
    for entry in sorted((root / "sys/class/devfreq").glob("*")):
        of_name = read_text(entry / "device/of_node/name") or entry.name.rsplit(".", 1)[-1]
        if of_name in GPU_NAMES and (entry / "device/load").exists():
            return entry / "device/load"
    return None


def count_dla(root: Path) -> int | None:
    folder = root / "sys/bus/platform/devices"
    if not folder.is_dir():
        return None  # no sysfs here: cannot tell (None), which is not "no DLA" (0)
    return len({m.group(1) for p in folder.iterdir() if (m := re.search(r"\.nvdla(\d+)$", p.name))})


def mode_names(conf: Path) -> dict[str, str]:
    """{'0': 'MAXN', ...} from '< POWER_MODEL ID=0 NAME=MAXN >' lines of /etc/nvpmodel.conf."""
    return dict(re.findall(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)", read_text(conf) or ""))


def query_nvpmodel() -> str | None:
    try:
        out = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("NV Power Mode")), None)
    mode = lines[-1] if lines and lines[-1].isdigit() else None
    return f"{name} ({mode})" if name and mode else name


def rail_watts(rail: Rail) -> float | None:
    mv, ma = read_number(rail.millivolts), read_number(rail.milliamps)
    return None if mv is None or ma is None else mv * ma / 1e6


def board_watts(rails: dict[str, float | None]) -> float | None:
    """VDD_IN is the module's input (Orin NX / Nano); without it (AGX Orin) the rails add up.
    A sum with an unreadable rail in it would understate the board, so it is None instead."""
    if "VDD_IN" in rails:
        return rails["VDD_IN"]
    if not rails or any(w is None for w in rails.values()):
        return None
    return sum(w for w in rails.values() if w is not None)


def celsius(path: Path) -> float | None:
    milli = read_number(path)
    return None if milli is None or milli / 1000.0 <= OFFLINE_C else milli / 1000.0


# ---- the background sampler -------------------------------------------------------------------

class Sampler:
    """Reads the sensors every `period_s` in a daemon thread; keeps the last `history` readings."""

    def __init__(self, sensors: Sensors, period_s: float = 1.0, history: int = 60):
        self.sensors, self.period_s = sensors, period_s
        self._history: deque[Telemetry] = deque(maxlen=history)
        self._lock = threading.Lock()  # the sampler thread appends while others read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: PowerConfig) -> "Sampler":
        return cls(Sensors.discover(cfg.root, cfg.nvpmodel_query), cfg.sample_period_s, cfg.history)

    def sample(self) -> Telemetry:
        reading = self.sensors.read()
        with self._lock:
            self._history.append(reading)
        return reading

    def start(self) -> "Sampler":
        if self._thread is None:
            self.sample()  # a reading exists as soon as start() returns
            self._thread = threading.Thread(target=self._run, name="edgemm-power", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def latest(self) -> Telemetry | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self) -> list[Telemetry]:
        with self._lock:
            return list(self._history)

    def energy_j(self, start: float, end: float) -> float | None:
        """Board energy between two monotonic times: mean board power of the readings in the
        interval (or the last one before it, for requests shorter than a period) × duration."""
        readings = [t for t in self.history() if t.total_w is not None]
        inside = [t.total_w for t in readings if start <= t.time <= end]
        if not inside:
            before = [t.total_w for t in readings if t.time <= end]
            inside = before[-1:]
        if not inside or end < start:
            return None
        return sum(inside) / len(inside) * (end - start)


# ---- the policy ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Load:
    queue_depth: int = 0  # requests admitted locally and not finished
    latency_ms: float | None = None  # recent local request latency; None until one was measured

    @property
    def predicted_ms(self) -> float | None:
        """What a new request would take: everything ahead of it, then itself."""
        return None if self.latency_ms is None else (self.queue_depth + 1) * self.latency_ms


@dataclass(frozen=True)
class Route:
    """Where each stage of one request runs, and why: the policy's per-request choice
    (what PreparedRequest.route holds). Not edgemm.placement.Placement, which records
    where a component was loaded."""
    stages: dict[str, str]  # stage → gpu | dla0 | dla1 | cpu | cloud
    reason: str
    conditions: frozenset[str] = frozenset()  # critical, hot, over_budget, slo_miss, slo_at_risk

    @property
    def cloud(self) -> bool:
        return all(device == "cloud" for device in self.stages.values())

    def to_dict(self) -> dict:
        return {"stages": dict(self.stages), "reason": self.reason, "conditions": sorted(self.conditions)}


# condition → the offload.allow name that lets it go to the cloud, most urgent first
OFFLOAD_FOR = {"critical": "critical", "slo_miss": "slo", "hot": "hot", "over_budget": "budget"}
THERMAL = {"critical", "hot", "over_budget"}


@dataclass(frozen=True)
class PowerPolicy:
    power: PowerConfig = field(default_factory=PowerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    allow: tuple[str, ...] = ()  # offload.allow: conditions that may send a request to the cloud

    @classmethod
    def from_config(cls, cfg: Config) -> "PowerPolicy":
        return cls(cfg.power, cfg.placement, tuple(cfg.offload.allow))

    def decide(self, telemetry: Telemetry | None, load: Load, offload: str = "off",
               previous: Route | None = None) -> Route:
        """Where each stage runs and why. `offload`: off | open | half_open | closed (breaker state)."""
        found = self.conditions(telemetry, load, previous.conditions if previous else frozenset())
        wanted = [c for c in OFFLOAD_FOR if c in found and OFFLOAD_FOR[c] in self.allow]
        if wanted and offload in ("closed", "half_open"):
            return Route({stage: "cloud" for stage in STAGES}, f"{found[wanted[0]]} → cloud", frozenset(found))
        mode = "efficient" if THERMAL & found.keys() else "fast" if found else "preferred"
        dla = telemetry.dla_cores if telemetry else None
        stages = {stage: pick_device(getattr(self.placement, stage), mode, dla) for stage in STAGES}
        calm = "cool and idle" if telemetry and telemetry.hottest else "no thermal readings"
        why = "; ".join(found.values()) or calm
        if wanted:
            why += f"; offload {'is off' if offload == 'off' else 'breaker ' + offload}"
        why += " → " + {"efficient": "DLA first, to save power", "fast": "GPU first, for latency",
                        "preferred": "configured order"}[mode]
        if any(d.startswith("dla") for d in self.candidates()) and not dla:
            why += " (no DLA on this module)"
        return Route(stages, why, frozenset(found))

    def candidates(self) -> list[str]:
        return [d for stage in STAGES for d in getattr(self.placement, stage)]

    def conditions(self, telemetry: Telemetry | None, load: Load, before: frozenset[str]) -> dict[str, str]:
        """Active conditions → evidence. One that held before ends only past its hysteresis band."""
        cfg, found = self.power, {}
        hottest = telemetry.hottest if telemetry else None
        if hottest is not None:
            zone, c = hottest
            for name, limit in (("critical", cfg.critical_c), ("hot", cfg.throttle_c)):
                if holds(c, limit, limit - cfg.hysteresis_c, name in before):
                    found[name] = f"{name}: {zone} at {c:.1f} °C (threshold {limit:g} °C)"
        keep = 1 - cfg.hysteresis_pct / 100
        watts = telemetry.total_w if telemetry else None
        if cfg.budget_w is not None and watts is not None \
                and holds(watts, cfg.budget_w, cfg.budget_w * keep, "over_budget" in before, strict=True):
            found["over_budget"] = f"over budget: {watts:.1f} W (budget {cfg.budget_w:g} W)"
        predicted = load.predicted_ms
        if cfg.slo_ms is not None and predicted is not None:
            slo = cfg.slo_ms
            if holds(predicted, slo, slo * keep, "slo_miss" in before, strict=True):
                found["slo_miss"] = f"SLO would be missed: {predicted:.0f} ms predicted (SLO {slo:g} ms)"
            elif holds(predicted, slo * SLO_RISK, slo * SLO_RISK * keep, "slo_at_risk" in before):
                found["slo_at_risk"] = f"SLO at risk: {predicted:.0f} ms predicted (SLO {slo:g} ms)"
        return found


def holds(value: float, enter: float, leave: float, was: bool, strict: bool = False) -> bool:
    """A condition starts at `enter` (above it, if strict) and, once on, lasts until below `leave`."""
    started = value > enter if strict else value >= enter
    return started or (was and value >= leave)


def pick_device(candidates: list[str], mode: str, dla_cores: int | None) -> str:
    """The stage's device: DLA cores the module lacks are skipped; `mode` reorders what's left."""
    usable = [d for d in candidates if not d.startswith("dla") or int(d[3:]) < (dla_cores or 0)]
    if not usable:
        return "gpu"  # only DLA listed and none here: TensorRT's GPU fallback
    if mode == "efficient":
        return next((d for d in usable if d.startswith("dla")), usable[0])
    if mode == "fast":
        return "gpu" if "gpu" in usable else usable[0]
    return usable[0]


def reachable_devices(candidates: list[str]) -> list[str]:
    """Every device `pick_device` can give a stage with this list, in list order, on any
    module (0–2 DLA cores) in any mode: what is worth loading so the policy can move it."""
    picked = {pick_device(candidates, mode, cores) for mode in ("preferred", "efficient", "fast")
              for cores in (0, 1, 2)}
    return [d for d in candidates if d in picked]


# ---- the daemon's side: memory for hysteresis, latency and energy --------------------------------

class Governor:
    """Keeps what the pure policy needs from the past: the last placement and recent latency.

    Used from the daemon's event loop only. Energy per request is the board energy over the
    request's time (so concurrent requests each see the whole board: an upper bound).
    """

    def __init__(self, policy: PowerPolicy, sampler: Sampler | None):
        self.policy, self.sampler = policy, sampler
        self.last: Route | None = None
        self.latency_ms: float | None = None
        self.decisions: dict[str, int] = {}  # "cloud" / "local" → count
        self.energy_total_j = 0.0
        self.energy_requests = 0
        self.last_energy_j: float | None = None

    def decide(self, queue_depth: int, offload: str) -> Route:
        telemetry = self.sampler.latest() if self.sampler else None
        self.last = self.policy.decide(telemetry, Load(queue_depth, self.latency_ms), offload, self.last)
        kind = "cloud" if self.last.cloud else "local"
        self.decisions[kind] = self.decisions.get(kind, 0) + 1
        return self.last

    def observe(self, total_ms: float, local: bool = True) -> float | None:
        """One answered request that took `total_ms`, ending now: updates the latency (local
        requests only: the policy predicts local latency) and returns its energy in J, if known."""
        if local:
            self.latency_ms = total_ms if self.latency_ms is None else \
                (1 - LATENCY_WEIGHT) * self.latency_ms + LATENCY_WEIGHT * total_ms
        end = time.monotonic()
        energy = self.sampler.energy_j(end - total_ms / 1e3, end) if self.sampler else None
        if energy is not None:
            self.energy_total_j += energy
            self.energy_requests += 1
            self.last_energy_j = energy
        return energy

    def figures(self) -> dict:
        mean = self.energy_total_j / self.energy_requests if self.energy_requests else None
        return {"decisions": dict(self.decisions), "latency_ms": _round(self.latency_ms, 1),
                "energy_j": {"last": _round(self.last_energy_j), "mean": _round(mean),
                             "total": round(self.energy_total_j, 3), "requests": self.energy_requests}}
