"""Jetson telemetry from sysfs, sampled in the background.

    sysfs under power.root ─► Sensors.read() ─► Telemetry ─► Sampler (short history)

Everything is read from plain files, so neither root nor the jtop daemon is needed:

- power rails: INA3221 monitors found by `/sys/bus/i2c/devices/*/name`, their
  `hwmon/hwmon*/in<N>_label`, `in<N>_input` (mV) and `curr<N>_input` (mA). The board
  total is `VDD_IN` where there is one (Orin NX / Nano), else the sum of the rails (AGX Orin);
- thermal zones: `/sys/devices/virtual/thermal/thermal_zone*/{type,temp}` (milli-°C);
- GPU load: the devfreq device whose `device/of_node/name` is the GPU, `device/load` (per-mille);
- power mode: `/var/lib/nvpmodel/status` (`pmode:0002`), named by `/etc/nvpmodel.conf`;
- DLA cores: `/sys/bus/platform/devices/*.nvdla<N>`.

A sensor that is not there is None, never 0: "no reading" must not look like "cool and idle".
The placement policy that reads it is edgemm/power/policy.py.
"""
from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from edgemm.config import PowerConfig

GPU_NAMES = ("gv11b", "gp10b", "ga10b", "gb10b", "gpu")  # devfreq of_node names of Jetson iGPUs
OFFLINE_C = -100.0  # an offline zone reads -256 °C; nothing on a running board is this cold


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
        return {"rails_w": {k: round_or_none(v) for k, v in self.rails_w.items()}, "total_w": round_or_none(self.total_w),
                "temps_c": {k: round_or_none(v) for k, v in self.temps_c.items()},
                "hottest": {"zone": hottest[0], "c": round(hottest[1], 1)} if hottest else None,
                "gpu_load": round_or_none(self.gpu_load), "nvpmodel": self.nvpmodel, "dla_cores": self.dla_cores}


def round_or_none(value: float | None, digits: int = 3) -> float | None:
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
