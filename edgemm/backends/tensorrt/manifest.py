"""engines/<model>/manifest.yaml: what each built plan is, and whether it still fits.

One entry per plan: component, device (gpu | dla0 | dla1), precision, tier (DLA plans
have static shapes: one per tier; GPU plans cover every tier with profiles), the input
shape profiles, the TensorRT version, GPU compute capability and DLA core it was built
for, the sha256 of the plan and of its source ONNX, build flags and build time.

`check_entry` compares an entry with the running platform before anything is
deserialised; each mismatch is one line ending in the exact command that rebuilds it.
"""
from __future__ import annotations

import hashlib
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from edgemm.backends.tensorrt.platform import Platform, dla_core
from edgemm.errors import EngineError
from edgemm.util.files import load_yaml, read_regular_file

MANIFEST = "manifest.yaml"
# a manifest is a few KB (one entry per engine): a FIFO, /dev/zero or a huge file named
# manifest.yaml is refused before it is read, so it cannot block or bloat start-up
MAX_MANIFEST_BYTES = 1024 * 1024
FORMAT = 1

# {input name: {"min": [...], "opt": [...], "max": [...]}} — one dict per optimisation profile
Profile = dict[str, dict[str, list[int]]]


@dataclass
class EngineEntry:
    component: str  # vision_encoder | embed_tokens | decoder
    device: str  # gpu | dla0 | dla1
    precision: str  # int8 | fp16
    tier: str | None  # the tier of a static-shape (DLA) plan; None = the plan covers every tier
    file: str  # plan file name, next to the manifest
    profiles: list[Profile]
    tensorrt: str
    compute_capability: str
    dla_core: int | None
    plan_sha256: str
    onnx: str  # source graph, relative to the model folder
    onnx_sha256: str
    flags: list[str] = field(default_factory=list)  # BuilderFlag names, STRONGLY_TYPED, DLA_core=N …
    quantization: str = "none"  # none | explicit (QDQ) | calibration-cache | strongly-typed
    gpu_fallback: list[str] = field(default_factory=list)  # layers of a DLA plan that run on the GPU
    dla_loadables: int = 0  # DLA subgraphs in the plan (estimated at build); a DLA core takes 16 at most
    # a strongly typed DLA plan's inputs/outputs that are FP32 in the ONNX graph and FP16 in the plan
    # (the build converts them): the runtime feeds and reads them as FP32, as the rest of edgemm has them
    fp16_io: list[str] = field(default_factory=list)
    build_seconds: float = 0.0

    @property
    def key(self) -> tuple:
        return (self.component, self.device, self.precision, self.tier)


@dataclass
class EngineManifest:
    model: str
    model_dir: str  # the folder the plans were built from (for rebuild commands)
    engines: list[EngineEntry] = field(default_factory=list)
    format: int = FORMAT

    def find(self, component: str, device: str, precision: str) -> list[EngineEntry]:
        return [e for e in self.engines
                if (e.component, e.device, e.precision) == (component, device, precision)]

    def loadables_per_core(self) -> dict[str, int]:
        """DLA device → the DLA loadables of all its plans (what must fit in one core)."""
        out: dict[str, int] = {}
        for e in self.engines:
            if e.dla_core is not None:
                out[e.device] = out.get(e.device, 0) + e.dla_loadables
        return dict(sorted(out.items()))

    def put(self, entry: EngineEntry) -> None:
        """Add `entry`, replacing the one with the same component, device, precision and tier."""
        self.engines = [e for e in self.engines if e.key != entry.key] + [entry]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rebuild_command(model_dir: str | Path, out: str | Path, component: str, device: str,
                    precision: str, tier: str | None = None) -> str:
    """The command that (re)builds one component's plans; what every mismatch message ends with."""
    words = ["edgemm", "engines", "build", str(model_dir), "--out", str(out), "--device", device,
             "--precision", precision, "--components", component]
    if tier is not None:
        words += ["--tiers", tier]
    return shlex.join(words)


def write_manifest(folder: Path, manifest: EngineManifest) -> Path:
    path = folder / MANIFEST
    data = {"format": manifest.format, "model": manifest.model, "model_dir": manifest.model_dir,
            "dla_loadables": manifest.loadables_per_core(),  # per DLA core, for the reader; not read back
            "engines": [asdict(e) for e in sorted(manifest.engines, key=lambda e: tuple(map(str, e.key)))]}
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("# written by edgemm engines build (tools/build_engines.py); do not edit\n"
                   + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)  # readers never see half a manifest
    return path


def read_manifest(folder: Path, rebuild: str) -> EngineManifest:
    """The manifest in `folder`; any problem → EngineError ending in `rebuild`."""
    path = folder / MANIFEST

    def unreadable(detail: str) -> EngineError:
        if detail == "not found":
            return EngineError(f"no engine manifest {path}; build the engines with: {rebuild}")
        return EngineError(f"{path}: {detail}; rebuild with: {rebuild}")
    raw = read_regular_file(path, MAX_MANIFEST_BYTES, unreadable, "for an engine manifest")
    try:
        data = load_yaml(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise EngineError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); rebuild with: {rebuild}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise EngineError(f"{path} has manifest format {found!r}, this edgemm reads format {FORMAT}; "
                          f"rebuild with: {rebuild}")
    known = {f.name for f in fields(EngineEntry)}
    try:
        engines = [EngineEntry(**{k: v for k, v in e.items() if k in known}) for e in data.get("engines") or []]
        return EngineManifest(model=str(data["model"]), model_dir=str(data.get("model_dir", "")),
                              engines=engines)
    except (TypeError, KeyError, AttributeError) as e:
        raise EngineError(f"{path} is incomplete ({e}); rebuild with: {rebuild}") from None


def check_entry(entry: EngineEntry, folder: Path, model_dir: Path, platform: Platform, rebuild: str,
                rebuild_file: str | None = None) -> Path:
    """Refuse a plan that cannot load here; return its path. Cheap checks first, hashes last.

    `rebuild` fixes a platform mismatch (it hits every plan of the component alike);
    `rebuild_file` (default: `rebuild`) fixes a problem with this one plan.
    """
    name = entry.file
    if entry.tensorrt != platform.tensorrt:
        raise EngineError(f"engine {name} was built with TensorRT {entry.tensorrt}, this is TensorRT "
                          f"{platform.tensorrt}; rebuild with: {rebuild}")
    if entry.compute_capability != platform.compute_capability:
        raise EngineError(f"engine {name} was built for compute capability {entry.compute_capability}, "
                          f"this GPU ({platform.gpu}) has {platform.compute_capability}; rebuild with: {rebuild}")
    core = dla_core(entry.device)
    if core is not None and core >= platform.dla_cores:
        have = "no DLA cores" if platform.dla_cores == 0 else f"{platform.dla_cores} DLA core(s)"
        raise EngineError(f"engine {name} runs on DLA core {core}, this module ({platform.gpu}) has {have}; "
                          f"place {entry.component} on another device or rebuild with: {rebuild}")
    rebuild_file = rebuild_file or rebuild
    plan = folder / name
    if not plan.is_file():
        raise EngineError(f"engine file {plan} is missing; rebuild with: {rebuild_file}")
    if sha256(plan) != entry.plan_sha256:
        raise EngineError(f"engine file {plan} does not match the sha256 in {folder / MANIFEST}; "
                          f"rebuild with: {rebuild_file}")
    source = model_dir / entry.onnx
    if not source.is_file() or sha256(source) != entry.onnx_sha256:
        raise EngineError(f"engine {name} was built from another {source} (its sha256 changed); "
                          f"rebuild with: {rebuild}")
    return plan


def select_engines(folder: Path, model_dir: Path, model: str, component: str, device: str,
                   precision: str, tiers: list[str], platform: Platform) -> list[tuple[EngineEntry, Path]]:
    """The checked plans that run `component` on `device` at `precision`: one per tier on DLA,
    one covering every tier on the GPU. Raises EngineError naming what to rebuild."""
    rebuild = rebuild_command(model_dir, folder, component, device, precision)
    manifest = read_manifest(folder, rebuild)
    if manifest.model != model:
        raise EngineError(f"{folder / MANIFEST} describes model {manifest.model!r}, not {model!r}; "
                          f"rebuild with: {rebuild}")
    entries = manifest.find(component, device, precision)
    if not entries:
        raise EngineError(f"{folder / MANIFEST} has no {precision} engine for {component} on {device}; "
                          f"build it with: {rebuild}")
    covering = [e for e in entries if e.tier is None]
    if covering:
        entries = covering[:1]
    else:
        missing = [t for t in tiers if t not in {e.tier for e in entries}]
        if missing:
            raise EngineError(f"{folder / MANIFEST} has no {device} engine for {component} at tier(s) "
                              f"{', '.join(missing)}; build with: "
                              + rebuild_command(model_dir, folder, component, device, precision, ",".join(missing)))
        entries = sorted((e for e in entries if e.tier in tiers), key=lambda e: tiers.index(e.tier))
    return [(e, check_entry(e, folder, model_dir, platform, rebuild,
                            rebuild_command(model_dir, folder, component, device, precision, e.tier)))
            for e in entries]
