"""Build TensorRT engines for a model folder: `edgemm engines build` / tools/build_engines.py.

    edgemm engines build models/tiny-vlm --device gpu --precision int8   # into the engines root (loading.default_engines_dir)
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
  by edgemm.backends.tensorrt.qdq into a Q/DQ-free graph + calibration cache.
  INT8 on TensorRT >= 11.4.1: a strongly typed network from the QDQ graph, parsed with
  ADJUST_FOR_DLA, its FP32 inputs and outputs made FP16 first (the DLA's boundary types).
  TensorRT 10.8 … 11.4.0 have no DLA support: refused.
- TensorRT 11 and later drop the precision flags: every network is strongly typed, INT8
  from the QDQ graph and FP16 from the model's `_fp16` graph.

Argument problems (unknown tier, decoder on a DLA, a module without DLA cores …) are found
before TensorRT is touched, and reported as one line.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import onnx

from edgemm.backends.tensorrt.manifest import (EngineEntry, EngineManifest, Profile, read_manifest, sha256,
                                     write_manifest, MANIFEST)
from edgemm.backends.tensorrt.platform import (DEVICES, Platform, TrtLog, dla_core, import_tensorrt, probe,
                                     require_device, trt_log, version_tuple)
from edgemm.backends.tensorrt.qdq import translate_file
from edgemm.errors import EngineError, InputError, ModelError
from edgemm.model.family import PatchCounter, encoder_patches
from edgemm.model.quantization import TENSORRT_UNPARSABLE, describe, graph_kind
from edgemm.model.manifest import COMPONENTS, ModelManifest

PRECISIONS = ("int8", "fp16")
LAST_CALIBRATION_CACHE_DLA = (10, 7)  # TensorRT <= 10.7: DLA INT8 needs implicit quantisation
STRONGLY_TYPED = (11,)  # TensorRT 11 dropped the precision flags: types come from the graph
FIRST_STRONGLY_TYPED_DLA = (11, 4, 1)  # DLA returned in 11.4.1 (10.8 … 11.4.0 have none)
DLA_LOADABLES_PER_CORE = 16  # the most DLA loadables one DLA core holds at a time


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


# What the named dimensions of the Hugging Face ONNX exports (Optimum, transformers.js) are:
# a profile gives every role a (min, opt, max) size, and every input's axes take theirs by name.
DIMENSIONS = {
    "batch_size": "batch", "batch": "batch",
    "num_images": "tiles", "num_tiles": "tiles",  # tiled encoders (idefics3 / SmolVLM): tiles per image
    "num_patches": "patches",  # flattened patches (Qwen2-VL): every image of the call, one row each
    "height": "height", "width": "width",
    "sequence_length": "sequence",  # the new tokens of this call
    "past_sequence_length": "past",
    "total_sequence_length": "total", "past_sequence_length + sequence_length": "total",  # past + new
}
Sizes = dict[str, tuple[int, int, int]]  # role → (min, opt, max)


def _input_dims(path: Path) -> dict[str, list]:
    """input name → dims (int, or the symbolic name) as the ONNX graph declares them."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    return {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                     for d in i.type.tensor_type.shape.dim]
            for i in graph.input if i.name not in initializers}


def _profile(dims: dict[str, list], sizes: Sizes, graph: str) -> Profile:
    """Every input's min/opt/max shape: static axes as declared, named ones by their role's size.
    An axis that is dynamic without a name, or whose name has no size here, refuses the build."""
    profile: Profile = {}
    for name, axes in dims.items():
        shapes: list[list[int]] = [[], [], []]
        for axis, dim in enumerate(axes):
            if isinstance(dim, int) and dim > 0:
                triple = (dim, dim, dim)
            elif not dim:
                raise EngineError(f"cannot profile input {name!r} of {graph}: its axis {axis} is dynamic "
                                  "without a name (re-export the graph with named dynamic axes)")
            elif DIMENSIONS.get(dim) not in sizes:
                known = ", ".join(n for n, role in DIMENSIONS.items() if role in sizes)
                raise EngineError(f"cannot profile input {name!r} of {graph}: its axis {axis} is {dim!r}, "
                                  f"not a dimension edgemm sizes here ({known})")
            else:
                triple = sizes[DIMENSIONS[dim]]
            for shape, size in zip(shapes, triple):
                shape.append(size)
        profile[name] = dict(zip(("min", "opt", "max"), shapes))
    return profile


def _tiles(model: ModelManifest, tier) -> int:
    """The most encoder images (tiles plus the global image or thumbnail) a tiled family makes
    at `tier`: its image tokens (the most it gives) over the tokens of one tile."""
    return model.encoder_images(tier)


def encoder_profiles(dims: dict[str, list], model: ModelManifest, tiers: list, max_batch: int, static: bool,
                     graph: str = "vision_encoder") -> list[Profile]:
    """One range over the tiers on the GPU; a static profile on a DLA (one tier, batch 1).

    Plain pixels [B,3,H,W] take the tier's height and width. A tiled family's pixels
    [B,T,3,tile,tile] (and its pixel_attention_mask [B,T,tile,tile]) have the tile's side at
    every tier; the tier sets the number of tiles T, and a DLA plan takes one tile at a time.
    A family whose encoder takes flattened patches says how many a tier gives (encoder_patches)."""
    patches = encoder_patches(model)
    if patches is not None:
        return [_profile(dims, _patch_sizes(model, patches, tiers, max_batch, static), graph)]
    if model.preprocessing.resize == "tiles":
        side = model.family_config["tile"]
        if static:
            sizes: Sizes = {"batch": (1, 1, 1), "tiles": (1, 1, 1), "height": (side,) * 3, "width": (side,) * 3}
        else:
            most = max(_tiles(model, t) for t in tiers)
            sizes = {"batch": (1, 1, max_batch), "tiles": (1, _tiles(model, tiers[-1]), most),
                     "height": (side,) * 3, "width": (side,) * 3}
    elif static:
        tier = tiers[0]
        sizes = {"batch": (1, 1, 1), "height": (tier.height,) * 3, "width": (tier.width,) * 3}
    else:
        top = tiers[-1]
        sizes = {"batch": (1, 1, max_batch),
                 "height": (min(t.height for t in tiers), top.height, max(t.height for t in tiers)),
                 "width": (min(t.width for t in tiers), top.width, max(t.width for t in tiers))}
    return [_profile(dims, sizes, graph)]


def _patch_sizes(model: ModelManifest, patches: PatchCounter, tiers: list, max_batch: int, static: bool) -> Sizes:
    """Flattened patches [N, patch values] and their grid [images, 3] (Qwen2-VL): N is set by
    each image's own grid under the tier's budget, from one image token's patches up to, for
    each of max_batch images, the most any image gets at the tiers (an elongated image may pass
    its budget); the top budget is the optimum. A DLA plan is static: one image at the tier's
    own (square) grid."""
    if static:
        square = patches(model, tiers[0]).square
        return {"patches": (square,) * 3, "tiles": (1, 1, 1)}
    counts = [patches(model, tier) for tier in tiers]
    least, top, most = min(c.least for c in counts), max(c.budget for c in counts), max(c.most for c in counts)
    return {"patches": (least, top, most * max_batch), "tiles": (1, 1, max_batch)}


def embed_profiles(dims: dict[str, list], max_beams: int, max_context: int,
                   graph: str = "embed_tokens") -> list[Profile]:
    return [_profile(dims, {"batch": (1, 1, max_beams), "sequence": (1, min(32, max_context), max_context)},
                     graph)]


def decoder_profiles(dims: dict[str, list], max_beams: int, max_context: int,
                     graph: str = "decoder") -> list[Profile]:
    """Prefill (no past, 1..max_context new tokens) and decode (1..max_context-1 past; one new
    token, or up to max_context-1: the rest of a prompt after a cached prefix goes in one call).
    The attention mask's total length is past + new at each of min, opt and max."""
    def sizes(new: tuple[int, int, int], past: tuple[int, int, int]) -> Sizes:
        return {"batch": (1, 1, max_beams), "sequence": new, "past": past,
                "total": tuple(p + s for p, s in zip(past, new))}
    prefill = sizes(new=(1, min(64, max_context), max_context), past=(0, 0, 0))
    decode = sizes(new=(1, 1, max_context - 1), past=(1, max_context // 2, max_context - 1))
    return [_profile(dims, prefill, graph), _profile(dims, decode, graph)]


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
        refuse_unparsable(source, component, model)
        dims, graph = _input_dims(source), str(source.relative_to(model.path))
        if component == "vision_encoder" and on_dla and model.preprocessing.resize == "tiles":
            # a tile has the same shape at every tier: one plan, one tile per call, serves them all
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  encoder_profiles(dims, model, tiers, 1, static=True, graph=graph)))
        elif component == "vision_encoder" and on_dla:
            jobs += [EngineJob(component, request.device, request.precision, tier.name, source,
                               encoder_profiles(dims, model, [tier], 1, static=True, graph=graph)) for tier in tiers]
        elif component == "vision_encoder":
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  encoder_profiles(dims, model, tiers, request.max_batch, static=False, graph=graph)))
        elif component == "embed_tokens":
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  embed_profiles(dims, request.max_beams, model.max_context, graph)))
        else:
            jobs.append(EngineJob(component, request.device, request.precision, None, source,
                                  decoder_profiles(dims, request.max_beams, model.max_context, graph)))
    return jobs


def refuse_unparsable(source: Path, component: str, model: ModelManifest) -> None:
    """A graph of a kind TensorRT's ONNX parser has no ops for (dynamic int8, as published `_int8`
    folders hold; MatMulNBits 4-bit; bnb4) is refused before any plan: one line naming the file,
    its kind and how to make the QDQ graph TensorRT builds INT8 from."""
    kind = graph_kind(source)
    if kind in TENSORRT_UNPARSABLE:
        fp32 = "" if model.has_graph(component, "fp32") else \
            "download the fp32 graphs (onnx/*.onnx without a suffix), then "
        raise ModelError(f"{source}: {kind} ({describe(kind)}), which TensorRT's ONNX parser cannot take; "
                         f"{fp32}make the QDQ int8 variant from the fp32 graphs: python tools/quantize.py "
                         f"{model.path} (it replaces the _int8 graphs with QDQ ones)")


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


def describe_jobs(jobs: list[EngineJob], trt_version: str) -> list[str]:
    """What `edgemm engines build --dry-run` prints: each plan, its source graph, how its precision
    reaches the builder, and every input's min/opt/max shape per optimisation profile."""
    lines = []
    for job in jobs:
        lines.append(f"{job.file}: from {job.onnx.name} ({quantization_mode(job, trt_version)}), "
                     f"{len(job.profiles)} profile(s)")
        for index, profile in enumerate(job.profiles):
            for name, shape in profile.items():
                lines.append(f"  profile {index} {name}: min {shape['min']} opt {shape['opt']} max {shape['max']}")
    return lines


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


def _network(trt, builder, logger, source: Path, strongly_typed: bool, on_dla: bool = False):
    flags = 0
    version = version_tuple(trt.__version__)
    if version < (10,):  # implicit batch is gone from 10 on; 8.x needs the flag
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if on_dla and version >= FIRST_STRONGLY_TYPED_DLA:
        # NVIDIA's DLA guidance for strongly typed networks: let the parser reshape and rewrite
        # layers so that more of them run on the DLA instead of falling back to the GPU
        parser.set_flag(trt.OnnxParserFlag.ADJUST_FOR_DLA)
    if not parser.parse_from_file(str(source)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT could not parse {source}: {errors}")
    return network, parser


def _relative(graph: Path, model_dir: Path) -> str:
    """The graph's path inside the model folder, as the manifest records it (onnx/… in a Hugging
    Face folder), so that the load-time check finds the same file."""
    return str(graph.resolve().relative_to(Path(model_dir).resolve()))


def dla_loadables(network, config) -> int:
    """DLA loadables a plan holds, estimated before the build: every run of consecutive layers
    the DLA can take (in the network's topological order), between layers that fall back to the
    GPU, becomes a DLA subgraph of its own. The engine inspector on the Jetson has the real count."""
    runs, on_dla = 0, False
    for i in range(network.num_layers):
        runs_here = bool(config.can_run_on_DLA(network.get_layer(i)))
        runs += runs_here and not on_dla
        on_dla = runs_here
    return runs


def _rename_uses(graph, old: str, new: str) -> None:
    """Every node (in subgraphs too: If and Loop bodies read outer names) that reads `old` reads `new`."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                _rename_uses(sub, old, new)


def _unused(graph, name: str) -> str:
    names = ({t for n in graph.node for t in (*n.input, *n.output)}
             | {v.name for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)})
    candidate, n = f"{name}_fp32", 1
    while candidate in names:
        candidate, n = f"{name}_fp32_{n}", n + 1
    return candidate


def fp16_io(source: Path, out: Path) -> list[str]:
    """Write `source` to `out` with FP16 where it has FP32 network inputs and outputs; return their names.

    A DLA computes and exchanges tensors in FP16 or INT8 only, and a strongly typed network takes
    its types from the graph, so NVIDIA's DLA guidance is FP16 tensors at the DLA's boundaries
    (what modelopt's AutoCast does to the network I/O). Each FP32 input becomes FP16 followed by a
    Cast to FP32, each FP32 output a Cast to FP16 of what produced it: the names, and so the
    engine's bindings, stay the same; the graph in between is untouched."""
    head = onnx.load(str(source), load_external_data=False)
    external = any(onnx.external_data_helper.uses_external_data(t) for t in head.graph.initializer)
    model = onnx.load(str(source)) if external else head  # weights from next to the source
    graph, float32 = model.graph, onnx.TensorProto.FLOAT
    initializers = {t.name for t in graph.initializer}
    casts, converted = [], []
    for value in graph.input:
        if value.name in initializers or value.type.tensor_type.elem_type != float32:
            continue
        inside = _unused(graph, value.name)
        _rename_uses(graph, value.name, inside)
        value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
        casts.append(onnx.helper.make_node("Cast", [value.name], [inside], to=float32, name=f"{inside}_cast"))
        converted.append(value.name)
    ends = []
    for value in graph.output:
        if value.type.tensor_type.elem_type != float32:
            continue
        if value.name in converted:  # an input passed straight through: FP16 already
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
            continue
        inside = _unused(graph, value.name)
        for node in graph.node:
            node.output[:] = [inside if name == value.name else name for name in node.output]
        for info in (*graph.value_info, *graph.initializer):  # what else names it: its shape, or it is a constant
            if info.name == value.name:
                info.name = inside
        _rename_uses(graph, value.name, inside)  # a later node may read the output too
        value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
        ends.append(onnx.helper.make_node("Cast", [inside], [value.name], to=onnx.TensorProto.FLOAT16,
                                          name=f"{value.name}_cast"))
        converted.append(value.name)
    nodes = casts + list(graph.node) + ends  # topological order kept: the Casts first and last
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(out), save_as_external_data=external, all_tensors_to_one_file=True,
              location=f"{out.name}.data")
    return converted


@dataclass
class _Configured:
    """One job's network and builder config, ready to build (or to count its DLA loadables)."""
    builder: object
    network: object
    parser: object  # the network refers to the parser's weights: keep it alive until the build
    config: object
    mode: str
    flags: list[str]
    trt_log: TrtLog  # where TensorRT says why a build failed
    fp16_io: list[str] = field(default_factory=list)  # FP32 network inputs/outputs the build made FP16


def _configure(trt, job: EngineJob, request: BuildRequest, tmp: Path, timing_cache: bytes) -> _Configured:
    mode = quantization_mode(job, trt.__version__)
    core = dla_core(job.device)
    logger = trt_log(trt)
    builder = trt.Builder(logger.ilogger)
    flags: list[str] = []
    source, cache, converted = job.onnx, None, []
    if mode == "calibration-cache":
        source, cache_path = tmp / "noqdq.onnx", tmp / "calibration.cache"
        translate_file(job.onnx, source, cache_path, trt.__version__)
        cache = cache_path.read_bytes()
    elif mode == "strongly-typed" and core is not None:
        source = tmp / f"{job.onnx.stem}.fp16_io.onnx"  # the DLA's boundaries in FP16: see fp16_io
        converted = fp16_io(job.onnx, source)
    network, parser = _network(trt, builder, logger.ilogger, source, mode == "strongly-typed", core is not None)
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
        if version_tuple(trt.__version__) >= FIRST_STRONGLY_TYPED_DLA:
            flags.append("ADJUST_FOR_DLA")
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
    return _Configured(builder, network, parser, config, mode, flags, logger, converted)


def build_one(trt, job: EngineJob, request: BuildRequest, platform: Platform,
              timing_cache: bytes) -> tuple[EngineEntry, bytes]:
    """Build and write one plan; returns its manifest entry and the updated timing cache."""
    core = dla_core(job.device)
    with tempfile.TemporaryDirectory() as tmp:
        ready = _configure(trt, job, request, Path(tmp), timing_cache)
        network, config = ready.network, ready.config
        fallback = ([network.get_layer(i).name for i in range(network.num_layers)
                     if not config.can_run_on_DLA(network.get_layer(i))] if core is not None else [])
        loadables = dla_loadables(network, config) if core is not None else 0
        started = time.perf_counter()
        ready.trt_log.forget()
        plan = ready.builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - started
    if plan is None:
        raise EngineError(f"TensorRT could not build {job.file}: "
                          + (ready.trt_log.last_error() or "TensorRT logged no reason"))
    path = request.out / job.file
    path.write_bytes(bytes(plan))
    entry = EngineEntry(
        component=job.component, device=job.device, precision=job.precision, tier=job.tier, file=job.file,
        profiles=job.profiles, tensorrt=platform.tensorrt, compute_capability=platform.compute_capability,
        dla_core=core, plan_sha256=sha256(path), onnx=_relative(job.onnx, request.model_dir),
        onnx_sha256=sha256(job.onnx), flags=ready.flags, quantization=ready.mode, gpu_fallback=fallback,
        dla_loadables=loadables, fp16_io=ready.fp16_io, build_seconds=round(seconds, 2))
    return entry, bytes(config.get_timing_cache().serialize())


def check_dla_loadables(trt, jobs: list[EngineJob], request: BuildRequest, manifest: EngineManifest) -> None:
    """Refuse, before anything is built, a plan set that would put more loadables on a DLA core
    than it takes: these jobs' plans plus the manifest's other plans on the same core."""
    counted: dict[str, list[tuple[str, int]]] = {}
    for job in jobs:
        if dla_core(job.device) is None:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ready = _configure(trt, job, request, Path(tmp), b"")
            counted.setdefault(job.device, []).append((job.file, dla_loadables(ready.network, ready.config)))
    replaced = {job.file for job in jobs}
    for device, plans in counted.items():
        plans = [(e.file, e.dla_loadables) for e in manifest.engines
                 if e.device == device and e.file not in replaced] + plans
        total = sum(n for _, n in plans)
        if total > DLA_LOADABLES_PER_CORE:
            each = ", ".join(f"{file} {n}" for file, n in plans)
            raise EngineError(f"{device} would hold {total} DLA loadables, more than the {DLA_LOADABLES_PER_CORE} "
                              f"a DLA core takes ({each}); build fewer tiers there (--tiers) and the rest "
                              "on the other DLA core or the GPU")


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
    check_dla_loadables(trt, jobs, request, manifest)
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
