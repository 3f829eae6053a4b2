"""`edgemm doctor`: what this machine can do for edgemm, and what to fix, one line per check.

Each check is ok, warn (missing, but the current config does not need it) or fail
(the current config needs it). `edgemm doctor` exits 0 without failures, 3 with any.
It only looks: it never changes the power mode, permissions or anything else.
"""
from __future__ import annotations

import ctypes.util
import importlib
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from edgemm.config import Config
from edgemm.telemetry import Sensors, read_text

FAILED_EXIT_CODE = 3


@dataclass
class Check:
    name: str
    level: str  # ok | warn | fail
    detail: str

    def line(self) -> str:
        return f"{self.level:<5} {self.name}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


def run_checks(cfg: Config, engines: Path) -> list[Check]:
    root = Path(cfg.power.root)
    sensors = Sensors.discover(root, cfg.power.nvpmodel_query)
    trt = module_version("tensorrt")
    return [python_check(), tensorrt_check(cfg, trt), dla_check(cfg, sensors.dla_cores), cuda_check(cfg, root),
            pycuda_check(cfg), gstreamer_check(cfg), *camera_checks(root), socket_check(cfg),
            engines_check(cfg, engines, trt), *telemetry_checks(sensors)]


def needs_gpu(cfg: Config) -> bool:
    placed = cfg.placement.vision_encoder + cfg.placement.embed_tokens + cfg.placement.decoder
    return cfg.backend.name == "tensorrt" or bool({"cuda", "tensorrt"} & set(cfg.backend.providers)) \
        or any(device != "cpu" for device in placed)


def needed(required: bool) -> str:
    return "fail" if required else "warn"


def module_version(name: str) -> str | None:
    """The module's version, '?' if it has none, None if it does not import."""
    try:
        module = importlib.import_module(name)
    except Exception:  # ImportError, or a binding that fails to load its library
        return None
    return str(getattr(module, "__version__", None) or getattr(module, "VERSION_TEXT", None) or "?")


# ---- the checks --------------------------------------------------------------------------------

def python_check() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    return Check("python", "ok" if sys.version_info >= (3, 10) else "fail", version)


def tensorrt_check(cfg: Config, version: str | None) -> Check:
    if version is not None:
        return Check("tensorrt", "ok", version)
    return Check("tensorrt", needed(cfg.backend.name == "tensorrt"),
                 "not importable: on JetPack install python3-libnvinfer (needed for backend.name: tensorrt)")


def dla_check(cfg: Config, cores: int | None) -> Check:
    listed = sorted({d for stage in (cfg.placement.vision_encoder, cfg.placement.embed_tokens,
                                     cfg.placement.decoder) for d in stage if d.startswith("dla")})
    missing = [d for d in listed if int(d[3:]) >= (cores or 0)]
    if cores is None:
        return Check("dla", needed(bool(listed)), "cannot tell: no /sys/bus/platform/devices here")
    if missing:
        return Check("dla", "fail", f"placement lists {', '.join(missing)} but this module has {cores} DLA cores "
                                    "(Orin Nano has none): remove them from placement")
    return Check("dla", "ok", f"{cores} cores" if cores else "none on this module (not used by placement)")


def cuda_check(cfg: Config, root: Path) -> Check:
    info = read_text(root / "usr/local/cuda/version.json")
    if info:
        try:
            return Check("cuda", "ok", json.loads(info)["cuda"]["version"])
        except (ValueError, KeyError, TypeError):
            return Check("cuda", "ok", "installed (/usr/local/cuda, version unreadable)")
    if ctypes.util.find_library("cudart"):
        return Check("cuda", "ok", "libcudart found")
    return Check("cuda", needed(needs_gpu(cfg)), "not found: JetPack installs it at /usr/local/cuda "
                 "(needed for gpu/dla placement, backend tensorrt, providers cuda/tensorrt)")


def pycuda_check(cfg: Config) -> Check:
    version = module_version("pycuda")
    if version is not None:
        return Check("pycuda", "ok", version)
    return Check("pycuda", needed(cfg.backend.name == "tensorrt"),
                 "not importable: pip install 'edgemm[tensorrt]' (builds against the local CUDA)")


def gstreamer_check(cfg: Config) -> Check:
    try:
        from edgemm.opencv import cv2
        info = cv2.getBuildInformation()
    except Exception as e:  # OpenCVUnavailable's message says what to install
        return Check("opencv", "fail", str(e))
    match = re.search(r"GStreamer:\s*(.+)", info)
    answer = match.group(1).strip() if match else "NO"
    if answer.upper().startswith("YES"):
        return Check("opencv gstreamer", "ok", f"{cv2.__version__}, GStreamer {answer}")
    uses_csi = any(s.source.startswith("csi://") for s in cfg.streams)
    return Check("opencv gstreamer", needed(uses_csi),
                 f"OpenCV {cv2.__version__} lacks GStreamer, so csi:// cameras cannot open: use JetPack's "
                 "python3-opencv instead of the pip wheel (pip uninstall opencv-python-headless; "
                 "install with the jetson extra: README, 'Install as a service on a Jetson')")


def camera_checks(root: Path) -> list[Check]:
    devices = sorted((root / "dev").glob("video*"))
    if not devices:
        return [Check("cameras", "warn", "no /dev/video* devices (none connected; csi:// cameras need the Argus daemon)")]
    checks = []
    for device in devices:
        if os.access(device, os.R_OK | os.W_OK):
            checks.append(Check("camera", "ok", f"/dev/{device.name} readable and writable"))
        else:
            checks.append(Check("camera", "fail", f"/dev/{device.name}: permission denied "
                                                  "(add the service user to group video)"))
    return checks


def socket_check(cfg: Config) -> Check:
    folder = Path(cfg.server.socket).parent
    if not folder.is_dir():
        return Check("socket directory", "warn", f"{folder} does not exist (under systemd, RuntimeDirectory=edgemm "
                                                 "creates it; else set server.socket)")
    if not os.access(folder, os.W_OK | os.X_OK):
        return Check("socket directory", "fail", f"{folder} is not writable by this user")
    return Check("socket directory", "ok", f"{folder} writable")


def engines_check(cfg: Config, engines: Path, trt: str | None) -> Check:
    manifests = sorted(engines.glob("*/manifest.yaml"))
    if not manifests:
        return Check("engines", needed(cfg.backend.name == "tensorrt"),
                     f"none built in {engines} (tools/build_engines.py; only backend tensorrt uses them)")
    stale = []
    for manifest in manifests:
        try:  # edgemm/engines/manifest.py: each engine records the TensorRT that built it
            entries = (yaml.safe_load(manifest.read_text()) or {}).get("engines") or []
            built = sorted({str(e["tensorrt"]) for e in entries if e.get("tensorrt")})
        except (OSError, yaml.YAMLError, AttributeError, TypeError):
            return Check("engines", "fail", f"{manifest}: unreadable manifest")
        if trt and any(version != trt for version in built):
            stale.append(f"{manifest.parent.name} (built with {', '.join(built)})")
    if stale:
        return Check("engines", "fail", f"TensorRT here is {trt}; rebuild with tools/build_engines.py: "
                                        + ", ".join(stale))
    return Check("engines", "ok", f"{len(manifests)} model(s) in {engines}"
                 + ("" if trt else " (TensorRT not importable: versions not compared)"))


def telemetry_checks(sensors: Sensors) -> list[Check]:
    checks = []
    for kind, files in sensors.files().items():
        if not files:
            checks.append(Check(kind, "warn", f"none found under {sensors.root} (not a Jetson? the policy "
                                              "treats them as absent)"))
            continue
        unreadable = [str(f) for f in files if read_text(f) is None]
        if unreadable:
            checks.append(Check(kind, "fail", f"unreadable: {', '.join(unreadable[:3])}"
                                              + (" …" if len(unreadable) > 3 else "")))
        else:
            checks.append(Check(kind, "ok", f"{len(files)} file(s) readable"))
    return checks
