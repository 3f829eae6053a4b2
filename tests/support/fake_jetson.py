"""Fake Jetson sysfs trees in a temporary folder, with the layouts of real modules.

    jetson = orin_nx(tmp_path)          # VDD_IN, VDD_CPU_GPU_CV, VDD_SOC at 1-0040; 2 DLA cores
    jetson.set_temp("tj-thermal", 97)   # then Sensors.discover(tmp_path).read()

Layouts as on JetPack 5/6: INA3221 under /sys/bus/i2c/devices/1-004x/hwmon/hwmonN
(in<N>_label, in<N>_input in mV, curr<N>_input in mA, in7 = "sum of shunt voltages"),
thermal zones under /sys/devices/virtual/thermal, the GPU as a devfreq device whose
`device` link leads to the GPU's platform folder (`load` in per-mille, `of_node/name`).
"""
from __future__ import annotations

import os
from pathlib import Path

NVPMODEL_CONF = """\
< PARAM TYPE=FILE NAME=CPU_ONLINE >
CORE_0 /sys/devices/system/cpu/cpu0/online
< POWER_MODEL ID=0 NAME=MAXN >
CPU_ONLINE CORE_0 1
< POWER_MODEL ID=1 NAME=10W >
CPU_ONLINE CORE_0 1
< POWER_MODEL ID=2 NAME=15W >
CPU_ONLINE CORE_0 1
< PM_CONFIG DEFAULT=2 >
"""


class FakeJetson:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.zone_count = 0
        self.hwmon_count = 0
        (self.root / "sys/bus/platform/devices").mkdir(parents=True, exist_ok=True)

    def write(self, relative: str, text: str) -> Path:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        return path

    def add_ina3221(self, address: str, channels: dict[str, tuple[float, float]]) -> None:
        """channels: label → (mV, mA), on in1.. in order; plus the 'sum of shunt voltages' channel."""
        hwmon = f"sys/bus/i2c/devices/{address}/hwmon/hwmon{self.hwmon_count}"
        self.hwmon_count += 1
        self.write(f"sys/bus/i2c/devices/{address}/name", "ina3221")
        for n, (label, (mv, ma)) in enumerate(channels.items(), start=1):
            self.write(f"{hwmon}/in{n}_label", label)
            self.write(f"{hwmon}/in{n}_input", str(int(mv)))
            self.write(f"{hwmon}/curr{n}_input", str(int(ma)))
        self.write(f"{hwmon}/in7_label", "sum of shunt voltages")
        self.write(f"{hwmon}/in7_input", "1200")

    def rail_file(self, label: str, kind: str = "curr") -> Path:
        for path in self.root.glob("sys/bus/i2c/devices/*/hwmon/hwmon*/in*_label"):
            if path.read_text().strip() == label:
                n = path.name[2:-len("_label")]
                return path.parent / (f"curr{n}_input" if kind == "curr" else f"in{n}_input")
        raise KeyError(label)

    def set_rail(self, label: str, mv: float, ma: float) -> None:
        self.rail_file(label, "volt").write_text(f"{int(mv)}\n")
        self.rail_file(label, "curr").write_text(f"{int(ma)}\n")

    def add_zone(self, kind: str, celsius: float) -> None:
        self.write(f"sys/devices/virtual/thermal/thermal_zone{self.zone_count}/type", kind)
        self.write(f"sys/devices/virtual/thermal/thermal_zone{self.zone_count}/temp", str(int(celsius * 1000)))
        self.zone_count += 1

    def zone_file(self, kind: str) -> Path:
        for path in self.root.glob("sys/devices/virtual/thermal/thermal_zone*/type"):
            if path.read_text().strip() == kind:
                return path.parent / "temp"
        raise KeyError(kind)

    def set_temp(self, kind: str, celsius: float) -> None:
        self.zone_file(kind).write_text(f"{int(celsius * 1000)}\n")

    def add_gpu(self, device: str, of_name: str, load_permille: int) -> None:
        """device: '17000000.gpu' (JetPack 6) or '17000000.ga10b' (JetPack 5)."""
        platform = f"sys/devices/platform/bus@0/{device}"
        self.write(f"{platform}/load", str(load_permille))
        self.write(f"{platform}/of_node/name", of_name)
        self.write(f"{platform}/devfreq/{device}/cur_freq", "306000000")
        os.symlink("../..", self.root / platform / "devfreq" / device / "device")
        (self.root / "sys/class/devfreq").mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../devices/platform/bus@0/{device}/devfreq/{device}", self.root / "sys/class/devfreq" / device)

    def gpu_load_file(self) -> Path:
        return next(self.root.glob("sys/devices/platform/bus@0/*/load"))

    def set_gpu_load(self, permille: int) -> None:
        self.gpu_load_file().write_text(f"{permille}\n")

    def add_dla(self, cores: int) -> None:
        for n, address in zip(range(cores), ("15880000", "158c0000")):
            (self.root / f"sys/bus/platform/devices/{address}.nvdla{n}").mkdir(parents=True)

    def set_mode(self, mode: int) -> None:
        self.write("etc/nvpmodel.conf", NVPMODEL_CONF)
        self.write("var/lib/nvpmodel/status", f"pmode:{mode:04d} fmode:fanNull")

    def add_camera(self, name: str = "video0") -> Path:
        path = self.write(f"dev/{name}", "")
        return path


def thermal(jetson: FakeJetson, cpu: float, gpu: float, tj: float) -> None:
    jetson.add_zone("cpu-thermal", cpu)
    jetson.add_zone("gpu-thermal", gpu)
    jetson.add_zone("cv0-thermal", -256)  # offline while the DLA sleeps, as on a real Orin
    jetson.add_zone("soc0-thermal", min(cpu, gpu))
    jetson.add_zone("tj-thermal", tj)


def orin_nx(root: Path, dla: int = 2) -> FakeJetson:
    """Orin NX 16GB: one INA3221 at 1-0040 whose first channel is the module input VDD_IN."""
    jetson = FakeJetson(root)
    jetson.add_ina3221("1-0040", {"VDD_IN": (5000, 1000), "VDD_CPU_GPU_CV": (5000, 300),
                                  "VDD_SOC": (5000, 250)})
    thermal(jetson, cpu=45.5, gpu=44.0, tj=46.0)
    jetson.add_gpu("17000000.gpu", "gpu", 120)
    jetson.add_dla(dla)
    jetson.set_mode(0)
    return jetson


def orin_nano(root: Path) -> FakeJetson:
    """Orin Nano: the NX's power monitor layout, and no DLA."""
    return orin_nx(root, dla=0)


def agx_orin(root: Path) -> FakeJetson:
    """AGX Orin: no VDD_IN; rails at 1-0040 and 1-0041 (with not-connected channels)."""
    jetson = FakeJetson(root)
    jetson.add_ina3221("1-0040", {"VDD_GPU_SOC": (5000, 800), "VDD_CPU_CV": (5000, 400),
                                  "VIN_SYS_5V0": (5000, 600)})
    jetson.add_ina3221("1-0041", {"NC": (0, 0), "VDDQ_VDD2_1V8AO": (5000, 200), "NC ": (0, 0)})
    jetson.write("sys/bus/i2c/devices/1-0050/name", "24c02")  # an EEPROM: not a power monitor
    thermal(jetson, cpu=50.0, gpu=48.0, tj=51.0)
    jetson.add_gpu("17000000.ga10b", "ga10b", 500)
    jetson.add_dla(2)
    jetson.set_mode(2)
    return jetson
