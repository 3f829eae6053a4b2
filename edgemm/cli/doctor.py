"""`edgemm doctor`: what this machine can do for edgemm, and what to fix, one line per check.

Each check is ok, warn (missing, but the current config does not need it) or fail
(the current config needs it). What the config needs comes from `placement`: a gpu,
dla0 or dla1 in any list needs TensorRT, a CUDA binding (cuda-python or pycuda), a CUDA
device that initialises and the engines for those devices in the engine folder
(model.engines); a DLA needs that core.
`edgemm doctor` exits 0 without failures, 3 with any. It only looks: it never changes
the power mode, permissions or anything else.
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
from edgemm.server.sockets import creatable_socket, socket_choices
from edgemm.backends.tensorrt.manifest import MANIFEST, MAX_MANIFEST_BYTES, rebuild_command
from edgemm.backends.errors import CudaError, CudaMissing
from edgemm.backends.tensorrt.cuda import installed_bindings, load_cuda
from edgemm.errors import EdgemmError, one_line
from edgemm.util.files import load_yaml, read_regular_file
from edgemm.engine.loading import default_engines_dir, default_model_dir
from edgemm.model.manifest import COMPONENTS, ModelManifest, load_manifest
from edgemm.model.manifest_types import AUTO, AUTO_ORDER
from edgemm.power.telemetry import Sensors, read_text

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


def run_checks(cfg: Config, engines: Path | None = None) -> list[Check]:
    """Every check, in the order shown. `engines`: the engine folder (holding manifest.yaml,
    or one folder per model); None = model.engines, else where `edgemm engines build` writes."""
    root = Path(cfg.power.root)
    sensors = Sensors.discover(root, cfg.power.nvpmodel_query)
    trt = module_version("tensorrt")
    return [python_check(), tensorrt_check(cfg, trt), dla_check(cfg, sensors.dla_cores), *cuda_checks(cfg, root),
            gstreamer_check(cfg), *camera_checks(root), socket_check(cfg),
            engines_check(cfg, engines, trt), *telemetry_checks(sensors)]


def accelerators(cfg: Config) -> dict[str, list[str]]:
    """component → the TensorRT devices (gpu, dla0, dla1) its placement list names."""
    return {kind: [d for d in getattr(cfg.placement, kind) if d != "cpu"] for kind in COMPONENTS}


def tensorrt_devices(cfg: Config) -> list[str]:
    """Every gpu/dla device any placement list names: each needs TensorRT engines."""
    return sorted({d for devices in accelerators(cfg).values() for d in devices})


def needs_tensorrt(cfg: Config) -> bool:
    return bool(tensorrt_devices(cfg))


def needs_gpu(cfg: Config) -> bool:
    return needs_tensorrt(cfg) or bool({"cuda", "tensorrt"} & set(cfg.backend.providers))


def why_needed(cfg: Config) -> str:
    devices = tensorrt_devices(cfg)
    return f"placement lists {', '.join(devices)}" if devices else "no placement needs it"


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
    return Check("tensorrt", needed(needs_tensorrt(cfg)),
                 f"not importable: on JetPack install python3-libnvinfer ({why_needed(cfg)}; "
                 "gpu and dla devices run TensorRT engines)")


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


def cuda_checks(cfg: Config, root: Path) -> list[Check]:
    """`cuda`: whether a CUDA device initialises, started by the runtime's own code
    (edgemm.backends.tensorrt.cuda.load_cuda: cuda-python, else pycuda), so that doctor and the runtime
    cannot disagree; with the toolkit's version when /usr/local/cuda says it. `cuda binding`:
    which binding started it, or which are installed and failed."""
    info = read_text(root / "usr/local/cuda/version.json")
    toolkit = None
    if info:
        try:
            toolkit = f"CUDA {json.loads(info)['cuda']['version']}"
        except (ValueError, KeyError, TypeError):
            toolkit = "CUDA at /usr/local/cuda (version unreadable)"
    elif ctypes.util.find_library("cudart"):
        toolkit = "libcudart found"
    level, binding_level = needed(needs_gpu(cfg)), needed(needs_tensorrt(cfg))
    why = "needed for gpu/dla placement and providers cuda/tensorrt"
    try:
        cuda = load_cuda()
        device = cuda.device_info(0) if cuda.device_count() > 0 else None
    except CudaMissing as e:  # neither binding is installed: nothing can initialise a device
        return [Check("cuda", level, (f"{toolkit}, but " if toolkit else "not found, and ")
                      + f"no cuda-python or pycuda to initialise a device ({why})"),
                Check("cuda binding", binding_level, f"{e} ({why_needed(cfg)})")]
    except CudaError as e:
        installed = installed_bindings()
        return [Check("cuda", level, f"no device initialised: {one_line(str(e))}"
                      + (f" ({toolkit}; {why})" if toolkit else f" ({why})")),
                Check("cuda binding", binding_level,
                      f"{', '.join(installed)} installed, but "
                      + ("neither started" if len(installed) > 1 else "it did not start")
                      + f" CUDA (the cuda line says why; {why_needed(cfg)})")]
    binding = Check("cuda binding", "ok", f"{cuda.name} started CUDA")
    if device is None:
        return [Check("cuda", level, f"the driver sees no CUDA device through {cuda.name} ({why})"), binding]
    kind = "integrated" if device.integrated else "discrete"
    return [Check("cuda", "ok", f"GPU 0 {device.name} (compute {device.compute_capability}, {kind}) through "
                                f"{cuda.name}" + (f", {toolkit}" if toolkit else "")), binding]


def gstreamer_check(cfg: Config) -> Check:
    try:
        from edgemm.util.opencv import cv2
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
                 "install with the jetson extra: docs/jetson.md, 'Install as a service on a Jetson')")


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
    if cfg.server.socket is None:
        chosen = creatable_socket()
        if chosen is None:
            return Check("socket directory", "warn", f"cannot create {' or '.join(socket_choices())} "
                                                     "(under systemd, RuntimeDirectory=edgemm creates /run/edgemm; "
                                                     "else set server.socket, --socket or --port)")
        return Check("socket directory", "ok", f"{Path(chosen).parent} writable (edgemm serve listens on {chosen})")
    folder = Path(cfg.server.socket).parent
    if not folder.is_dir():
        return Check("socket directory", "warn", f"{folder} does not exist (under systemd, RuntimeDirectory=edgemm "
                                                 "creates it; else set server.socket)")
    if not os.access(folder, os.W_OK | os.X_OK):
        return Check("socket directory", "fail", f"{folder} is not writable by this user")
    return Check("socket directory", "ok", f"{folder} writable")


def engines_check(cfg: Config, engines: Path | None, trt: str | None) -> Check:
    model_dir, model = model_folder(cfg)
    name = model.name if model else model_dir.name
    if engines is None:  # the model's own engine folder, as the runtime looks for it
        engines = Path(cfg.model.engines) if cfg.model.engines else default_engines_dir(name)
        model_engines = engines
    else:  # given: the model's own folder (manifest.yaml in it), or a folder of models
        model_engines = engines if (engines / MANIFEST).is_file() else engines / name
    manifests = [engines / MANIFEST] if (engines / MANIFEST).is_file() else sorted(engines.glob(f"*/{MANIFEST}"))
    entries_by_folder: dict[Path, list[dict]] = {}
    stale = []
    for manifest in manifests:
        try:  # edgemm/backends/tensorrt/manifest.py: each engine records the TensorRT that built it
            raw = read_regular_file(manifest, MAX_MANIFEST_BYTES, OSError, "for an engine manifest")  # no FIFO wait
            entries = (load_yaml(raw.decode("utf-8")) or {}).get("engines") or []
            built = sorted({str(e["tensorrt"]) for e in entries if e.get("tensorrt")})
        except (OSError, yaml.YAMLError, UnicodeDecodeError, AttributeError, TypeError):
            return Check("engines", "fail", f"{manifest}: unreadable manifest")
        entries_by_folder[manifest.parent] = entries
        if trt and any(version != trt for version in built):
            stale.append(f"{manifest.parent.name} (built with {', '.join(built)})")
    if stale:
        return Check("engines", "fail", f"TensorRT here is {trt}; rebuild with tools/build_engines.py: "
                                        + ", ".join(stale))
    if needs_tensorrt(cfg):
        missing = missing_engines(cfg, model_dir, model, model_engines, entries_by_folder.get(model_engines, []))
        if missing:
            return Check("engines", "fail", missing)
    if not manifests:
        return Check("engines", "warn", f"none built in {engines} (edgemm engines build; only gpu/dla "
                                        "placements use them)")
    return Check("engines", "ok", f"{len(manifests)} model(s) in {engines}"
                 + ("" if trt else " (TensorRT not importable: versions not compared)"))


def model_folder(cfg: Config) -> tuple[Path, ModelManifest | None]:
    """The configured model folder and its manifest (None when it does not read: the
    runtime reports that itself, with its own message)."""
    path = Path(cfg.model.path) if cfg.model.path else default_model_dir()
    try:
        return path, load_manifest(path)
    except EdgemmError:
        return path, None


def missing_engines(cfg: Config, model_dir: Path, model: ModelManifest | None, folder: Path,
                    entries: list[dict]) -> str | None:
    """What placement asks for that the model's engine folder (its manifest's `entries`)
    lacks, with the command that builds the first of it; None when every listed gpu/dla
    device has its engines."""
    precision = cfg.model.precision
    if precision not in (AUTO, *AUTO_ORDER["tensorrt"]):
        return (f"placement lists {', '.join(tensorrt_devices(cfg))} but model.precision is {precision}: "
                "TensorRT engines are int8 or fp16 (set model.precision: auto, int8 or fp16)")
    # auto: an engine of either precision will do (the runtime takes int8, else fp16)
    wanted = AUTO_ORDER["tensorrt"] if precision == AUTO else (precision,)
    precision = wanted[0]  # the one a missing engine is built in
    tiers = list(model.tiers) if model else []
    lacking: list[tuple[str, str, str | None]] = []  # (component, device, tiers or None)
    for kind, devices in accelerators(cfg).items():
        for device in devices:
            built = [e for e in entries if isinstance(e, dict) and (e.get("component"), e.get("device")) == (kind, device)
                     and e.get("precision") in wanted]
            if not built:
                lacking.append((kind, device, None))
            elif device.startswith("dla") and not any(e.get("tier") is None for e in built):
                absent = [t for t in tiers if t not in {e.get("tier") for e in built}]
                if absent:
                    lacking.append((kind, device, ",".join(absent)))
    if not lacking:
        return None
    shown = ", ".join(f"{kind} on {device}" + (f" (tiers {t})" if t else "") for kind, device, t in lacking)
    kind, device, tier = lacking[0]
    return (f"placement needs {precision} engines that {folder} lacks: {shown}; build with: "
            + rebuild_command(model_dir, folder, kind, device, precision, tier))


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
