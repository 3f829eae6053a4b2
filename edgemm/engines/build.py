"""Build TensorRT engines for a model folder: `edgemm engines build` / tools/build_engines.py.

    edgemm engines build models/tiny-vlm --out engines/tiny-vlm --device gpu --precision int8
    edgemm engines build models/tiny-vlm --device dla0 --precision int8 --tiers low,mid,high

What gets built, per device and precision:

- GPU INT8: explicit quantisation, straight from the `_int8` QDQ graph (BuilderFlag.INT8 and
  FP16 for the layers left in float). GPU FP16: the fp32 graph with BuilderFlag.FP16.
  One plan per component covering every tier with optimisation profiles; the decoder gets
  two: prefill (past length 0, up to max_context tokens) and decode with the KV cache
  (past length 1 … max_context-1; one new token, or up to max_context-1 for the rest of a
  prompt that continues from a cached image prefix, as ONNX Runtime takes it).
- DLA (vision encoder only; AGX Orin and Orin NX): static shapes, so one plan per tier,
  with GPU_FALLBACK (the layers that fall back are listed in the manifest).
  INT8 on TensorRT <= 10.7 (JetPack 6): implicit quantisation from the QDQ graph translated
  by edgemm.engines.qdq into a Q/DQ-free graph + calibration cache.
  INT8 on TensorRT >= 11.4.1: a strongly typed network from the QDQ graph.
  TensorRT 10.8 … 11.4.0 have no DLA support: refused.
- TensorRT 11 and later drop the precision flags: every network is strongly typed, INT8
  from the QDQ graph and FP16 from the model's `_fp16` graph.

Argument problems (unknown tier, decoder on a DLA, a module without DLA cores …) are found
before TensorRT is touched, and reported as one line.
"""
from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import onnx

from edgemm.engines.manifest import (EngineEntry, EngineManifest, Profile, read_manifest, sha256,
                                     write_manifest, MANIFEST)
from edgemm.engines.platform import (DEVICES, Platform, dla_core, import_tensorrt, probe, require_device,
                                     version_tuple)
from edgemm.engines.qdq import translate_file
from edgemm.errors import EngineError, InputError
from edgemm.model.manifest import COMPONENTS, ModelManifest

PRECISIONS = ("int8", "fp16")
LAST_CALIBRATION_CACHE_DLA = (10, 7)  # TensorRT <= 10.7: DLA INT8 needs implicit quantisation
STRONGLY_TYPED = (11,)  # TensorRT 11 dropped the precision flags: types come from the graph
FIRST_STRONGLY_TYPED_DLA = (11, 4, 1)  # DLA returned in 11.4.1 (10.8 … 11.4.0 have none)
_PAST = re.compile(r"past_key_values\.\d+\.(key|value)$")


@dataclass
class BuildRequest:
    model_dir: Path
    out: Path
    device: str = "gpu"
    precision: str = "int8"
    tiers: list[str] | None = None  # None = every tier of the model
    components: list[str] | None = None  # None = all on gpu, the vision encoder on a DLA
    timing_cache: Path | None = None
    max_batch: int = 4  # most images per encoder call (server.max_batch) on the GPU
    max_beams: int = 16  # most decoder rows (generation.num_beams)
    workspace_mib: int = 1024


@dataclass
class EngineJob:
    component: str
    device: str
    precision: str
    tier: str | None
    onnx: Path  # the source graph in the model folder
    profiles: list[Profile] = field(default_factory=list)

    @property
    def file(self) -> str:
        return f"{self.component}.{self.device}.{self.precision}{'.' + self.tier if self.tier else ''}.plan"


def _input_dims(path: Path) -> dict[str, list]:
    """input name → dims (int, or the symbolic name) as the ONNX graph declares them."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    return {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                     for d in i.type.tensor_type.shape.dim]
            for i in graph.input if i.name not in initializers}


def _shape(dims: list, fill: dict[int, int]) -> list[int]:
    """Static dims as declared; dynamic ones from `fill` (position → size)."""
    return [d if isinstance(d, int) and d > 0 else fill[i] for i, d in enumerate(dims)]


def _profile(dims: dict[str, list], ranges: dict[str, tuple[dict, dict, dict]]) -> Profile:
    return {name: {k: _shape(dims[name], fill) for k, fill in zip(("min", "opt", "max"), ranges[name])}
            for name in dims if name in ranges}


def encoder_profiles(dims: dict[str, list], tiers: list, max_batch: int, static: bool) -> list[Profile]:
    """Pixel shapes [B,3,H,W]: one static profile per tier on a DLA, one range over tiers on the GPU."""
    name = next(iter(dims))
    low, top = tiers[0], tiers[-1]
    if static:
        return [_profile(dims, {name: ({0: 1, 2: low.height, 3: low.width},) * 3})]
    return [_profile(dims, {name: ({0: 1, 2: min(t.height for t in tiers), 3: min(t.width for t in tiers)},
                                   {0: 1, 2: top.height, 3: top.width},
                                   {0: max_batch, 2: max(t.height for t in tiers), 3: max(t.width for t in tiers)})})]


def embed_profiles(dims: dict[str, list], max_beams: int, max_context: int) -> list[Profile]:
    return [_profile(dims, {n: ({0: 1, 1: 1}, {0: 1, 1: min(32, max_context)}, {0: max_beams, 1: max_context})
                            for n in dims})]


def decoder_profiles(dims: dict[str, list], max_beams: int, max_context: int) -> list[Profile]:
    """Prefill (no past, 1..max_context new tokens) and decode (1..max_context-1 past; one new
    token, or up to max_context-1: the rest of a prompt after a cached prefix goes in one call)."""
    def ranges(new: tuple[int, int, int], past: tuple[int, int, int]) -> dict:
        batch = (1, 1, max_beams)
        out = {}
        for name in dims:
            if _PAST.match(name):  # [B, heads, past, head_dim]
                out[name] = tuple({0: b, 2: p} for b, p in zip(batch, past))
            elif name == "attention_mask":  # [B, past + new]
                out[name] = tuple({0: b, 1: p + s} for b, p, s in zip(batch, past, new))
            elif name in ("inputs_embeds", "position_ids"):  # [B, new, (D)]
                out[name] = tuple({0: b, 1: s} for b, s in zip(batch, new))
            else:  # use_cache_branch [1], num_logits_to_keep []: declared static
                out[name] = ({}, {}, {})
        return out
    prefill = ranges(new=(1, min(64, max_context), max_context), past=(0, 0, 0))
    decode = ranges(new=(1, 1, max_context - 1), past=(1, max_context // 2, max_context - 1))
    return [_profile(dims, prefill), _profile(dims, decode)]


def plan_jobs(request: BuildRequest, model: ModelManifest, platform: Platform) -> list[EngineJob]:
    """What to build, checked against the model and the module; nothing touches TensorRT."""
    if request.device not in DEVICES:
        raise InputError(f"unknown device {request.device!r} (devices: {', '.join(DEVICES)})")
    if request.precision not in PRECISIONS:
        raise InputError(f"unknown precision {request.precision!r} (engines: {', '.join(PRECISIONS)})")
    on_dla = dla_core(request.device) is not None
    components = request.components or (["vision_encoder"] if on_dla else list(COMPONENTS))
    for component in components:
        if component not in COMPONENTS:
            raise InputError(f"unknown component {component!r} (components: {', '.join(COMPONENTS)})")
        if on_dla and component != "vision_encoder":
            raise InputError(f"{component} cannot be built for {request.device}: a DLA takes static shapes, "
                             f"so only the vision encoder goes there; build {component} with --device gpu")
    tier_names = request.tiers or list(model.tiers)
    tiers = [model.tier(name) for name in tier_names]  # InputError names the model's tiers
    require_device(platform, request.device)
    version = version_tuple(platform.tensorrt)
    if on_dla and (LAST_CALIBRATION_CACHE_DLA < version[:2] and version < FIRST_STRONGLY_TYPED_DLA):
        raise EngineError(f"TensorRT {platform.tensorrt} does not support the DLA (10.7 was the last "
                          "release before 11.4.1 that did); use --device gpu")
    typed = version >= STRONGLY_TYPED
    jobs = []
    for component in components:
        source = model.graph_path(component, "fp32" if request.precision == "fp16" and not typed else request.precision)
        dims = _input_dims(source)
        if component == "vision_encoder" and on_dla:
            jobs += [EngineJob(component, request.device, request.precision, tier.name, source,
                               encoder_profiles(dims, [tier], 1, static=True)) for tier in tiers]
        elif component == "vision_encoder":
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  encoder_profiles(dims, tiers, request.max_batch, static=False)))
        elif component == "embed_tokens":
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  embed_profiles(dims, request.max_beams, model.max_context)))
        else:
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  decoder_profiles(dims, request.max_beams, model.max_context)))
    return jobs


def quantization_mode(job: EngineJob, trt_version: str) -> str:
    """How precision reaches the builder: strongly-typed (TensorRT 11+), else for INT8 explicit (QDQ)
    or calibration-cache (DLA on TensorRT <= 10.7), and 'none' for FP16 by builder flag."""
    version = version_tuple(trt_version)
    if version >= STRONGLY_TYPED:
        return "strongly-typed"
    if job.precision != "int8":
        return "none"
    if dla_core(job.device) is not None and version[:2] <= LAST_CALIBRATION_CACHE_DLA:
        return "calibration-cache"
    return "explicit"


def _cache_calibrator(trt, cache: bytes):
    """An IInt8EntropyCalibrator2 that only hands TensorRT the translated scales: no batches."""
    class CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            trt.IInt8EntropyCalibrator2.__init__(self)

        def get_batch_size(self):
            return 1

        def get_batch(self, names):
            return None  # every scale comes from the cache

        def read_calibration_cache(self):
            return cache

        def write_calibration_cache(self, data):
            pass
    return CacheCalibrator()


def _network(trt, builder, logger, source: Path, strongly_typed: bool):
    flags = 0
    if version_tuple(trt.__version__) < (10,):  # implicit batch is gone from 10 on; 8.x needs the flag
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(source)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT could not parse {source}: {errors}")
    return network, parser


def build_one(trt, job: EngineJob, request: BuildRequest, platform: Platform,
              timing_cache: bytes) -> tuple[EngineEntry, bytes]:
    """Build and write one plan; returns its manifest entry and the updated timing cache."""
    mode = quantization_mode(job, trt.__version__)
    core = dla_core(job.device)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        source, cache = job.onnx, None
        if mode == "calibration-cache":
            source, cache_path = Path(tmp) / "noqdq.onnx", Path(tmp) / "calibration.cache"
            translate_file(job.onnx, source, cache_path, trt.__version__)
            cache = cache_path.read_bytes()
        network, _parser = _network(trt, builder, logger, source, mode == "strongly-typed")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, request.workspace_mib << 20)
        if mode == "strongly-typed":
            flags.append("STRONGLY_TYPED")  # types come from the graph; precision flags are not allowed
        else:
            flags.append("FP16")
            config.set_flag(trt.BuilderFlag.FP16)
            if job.precision == "int8":
                flags.append("INT8")
                config.set_flag(trt.BuilderFlag.INT8)
        if core is not None:
            config.default_device_type = trt.DeviceType.DLA
            config.DLA_core = core
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
            flags += ["GPU_FALLBACK", f"DLA_core={core}"]
        profiles = []
        for shapes in job.profiles:
            profile = builder.create_optimization_profile()
            for name, dims in shapes.items():
                profile.set_shape(name, dims["min"], dims["opt"], dims["max"])
            config.add_optimization_profile(profile)
            profiles.append(profile)
        if cache is not None:
            config.int8_calibrator = _cache_calibrator(trt, cache)
            config.set_calibration_profile(profiles[0])
        timing = config.create_timing_cache(timing_cache)
        config.set_timing_cache(timing, ignore_mismatch=False)
        fallback = ([network.get_layer(i).name for i in range(network.num_layers)
                     if not config.can_run_on_DLA(network.get_layer(i))] if core is not None else [])
        started = time.perf_counter()
        plan = builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - started
    if plan is None:
        raise EngineError(f"TensorRT could not build {job.file} (its log above says why)")
    path = request.out / job.file
    path.write_bytes(bytes(plan))
    entry = EngineEntry(
        component=job.component, device=job.device, precision=job.precision, tier=job.tier, file=job.file,
        profiles=job.profiles, tensorrt=platform.tensorrt, compute_capability=platform.compute_capability,
        dla_core=core, plan_sha256=sha256(path), onnx=job.onnx.name, onnx_sha256=sha256(job.onnx),
        flags=flags, quantization=mode, gpu_fallback=fallback, build_seconds=round(seconds, 2))
    return entry, bytes(config.get_timing_cache().serialize())


def _existing(request: BuildRequest, model: ModelManifest) -> EngineManifest:
    """The manifest to add to: the folder's own if it is this model's, else a new one."""
    if (request.out / MANIFEST).is_file():
        try:
            manifest = read_manifest(request.out, "")
            if manifest.model == model.name:
                return manifest
        except EngineError:
            pass  # an unreadable or old manifest is replaced
    return EngineManifest(model=model.name, model_dir=str(model.path))


def build_engines(request: BuildRequest, model: ModelManifest, platform: Platform | None = None,
                  echo=click.echo) -> list[EngineEntry]:
    """Check the request, then build each plan with a progress bar; the manifest is rewritten
    after every plan, so an interrupted run keeps what it finished."""
    platform = platform or probe()
    jobs = plan_jobs(request, model, platform)
    trt = import_tensorrt()
    request.out.mkdir(parents=True, exist_ok=True)
    manifest = _existing(request, model)
    timing = request.timing_cache.read_bytes() if request.timing_cache and request.timing_cache.is_file() else b""
    built = []
    with click.progressbar(jobs, label=f"building {len(jobs)} engine(s) on {platform.gpu}", file=None,
                           item_show_func=lambda job: job.file if job else "") as bar:
        for job in bar:
            entry, timing = build_one(trt, job, request, platform, timing)
            manifest.put(entry)
            write_manifest(request.out, manifest)
            built.append(entry)
            fell_back = f", {len(entry.gpu_fallback)} layer(s) on the GPU" if entry.gpu_fallback else ""
            echo(f"\nbuilt {entry.file} in {entry.build_seconds:.1f} s ({entry.quantization}{fell_back})", err=True)
    if request.timing_cache:
        request.timing_cache.write_bytes(timing)
    return built
