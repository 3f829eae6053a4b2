"""Runtime: the public entry point. Load a model once, answer (image, prompt) requests.

    from edgemm import Runtime
    rt = Runtime.from_config("edgemm.yaml")        # or Runtime() for the built-in model
    result = rt.infer("photo.jpg", "how many shapes are there ?")
    print(result.text, result.timings_ms)

The CLI, the stream pipeline and the daemon all go through this class.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import cv2
import numpy as np

from edgemm.backends.base import Component, LoadedComponents
from edgemm.backends.onnxruntime import OnnxRuntimeBackend
from edgemm.cache import FeatureCache, feature_key
from edgemm.config import Config, ConfigError, load_config
from edgemm.errors import BackendError, EdgemmError, InputError
from edgemm.decode import BatchItem, DecodingBatch
from edgemm.detokenize import TextCallback, TextStream
from edgemm.generate import GenerationOptions, Generator, PrefixReuse
from edgemm.model.contract import check_component
from edgemm.model.family import Prompt, adapter_for
from edgemm.model.image import load_image
from edgemm.model.manifest import COMPONENTS, ModelManifest, ResolutionTier, load_manifest
from edgemm.placement import Placement, place
from edgemm.power import Route, reachable_devices
from edgemm.scheduler import POLICY_FILE, Decision, Scheduler, TierPolicy

log = logging.getLogger("edgemm")

PROMPT_CACHE_SIZE = 256  # distinct (prompt, tier, image size) whose ids are kept
SOURCE_TREE = Path(__file__).resolve().parent.parent
BUILTIN_MODEL = SOURCE_TREE / "models" / "tiny-vlm"


def usable_cpus() -> int:
    """CPUs this process may run on (systemd's CPUAffinity, taskset, cgroups), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_model_dir() -> Path:
    """$EDGEMM_MODEL, else the built-in tiny VLM next to the package."""
    return Path(os.environ.get("EDGEMM_MODEL", BUILTIN_MODEL))


def default_engines_dir(model_name: str) -> Path:
    """engines/<model name> in edgemm's source tree, where `edgemm engines build` writes by default."""
    return SOURCE_TREE / "engines" / model_name


@dataclass
class InferenceResult:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    tier: str
    image_tokens: int
    precision: str
    devices: dict[str, str]  # stage → device that ran it
    timings_ms: dict[str, float] = field(default_factory=dict)
    model: str = ""
    schedule: dict = field(default_factory=dict)  # why this tier: {tier, reason, stats}
    prefix_reused: bool = False  # the prompt's image prefix came from the cache (no prefill for it)
    decode_batch: int = 1  # most requests decoded together with this one at once (itself included)
    decoder_steps: int = 0  # decoder calls after the prefill that gave it tokens (beam search: rows stepped)

    def to_dict(self) -> dict:
        """The result as plain data for JSON. Containers are copied one level deep: asdict's
        full recursion was a noticeable part of the daemon's own time per request."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(tokens=list(self.tokens), devices=dict(self.devices), schedule=dict(self.schedule),
                 timings_ms={k: round(v, 3) for k, v in self.timings_ms.items()})
        return d


@dataclass
class PreparedRequest:
    """A request after stage 1, ready for the encoder."""
    pixel_values: np.ndarray  # [1,3,H,W] float32; [1,tiles,3,H,W] for tiled families
    tier: ResolutionTier
    prompt: Prompt
    options: GenerationOptions
    timings_ms: dict[str, float] = field(default_factory=dict)
    decision: Decision | None = None
    cache_key: bytes | None = None  # feature-cache key of the pixels (None with the cache off)
    route: Route | None = None  # where the power policy wants each stage (None: the first device loaded)


class Runtime:
    def __init__(self, config: Config | None = None, concurrent: bool = False):
        """`concurrent`: the encoder and the decoder will run at the same time (the pipeline
        of `serve` and `stream`); backend.intra_op_threads 0 then splits the cores between them."""
        self.config = config or load_config(None)
        self.concurrent = concurrent
        if concurrent:
            # decoding, resizing and the scheduler's statistics run on the pipeline's prepare
            # thread while onnxruntime keeps the cores busy; OpenCV's own pool would only wait
            # behind it (and the setting is process-wide: serve and stream own their process)
            cv2.setNumThreads(1)
        model_dir = Path(self.config.model.path) if self.config.model.path else default_model_dir()
        self.manifest: ModelManifest = load_manifest(model_dir)
        self.precision = self.config.model.precision
        self.adapter = adapter_for(self.manifest)
        self.components = self._load_components()
        self.generator = Generator(self.components.vision_encoder, self.components.embed_tokens,
                                   self.components.decoder, self.manifest.max_context,
                                   self.adapter.stop_ids)
        self._generators = {self.resolve(None): self.generator}  # (encoder, embed, decoder device) → Generator
        # (prompt, tier, image size) → ids; lru_cache is thread-safe (daemon and stream pipelines share this runtime)
        self._cached_prompt = functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)(self._read_only_prompt)
        self.scheduler = self._make_scheduler()
        self._tier_by_shape = {(t.height, t.width): t.name for t in self.manifest.tiers.values()}
        self.cache: FeatureCache | None = None  # made after the warm-up, so blank frames don't fill it
        if self.config.backend.warmup:
            self.warmup()
        if self.config.cache.max_bytes:
            self.cache = FeatureCache(self.config.cache.max_bytes)

    @classmethod
    def from_config(cls, source=None) -> "Runtime":
        """`source`: a Config, a YAML path, a dict, or None for all defaults."""
        return cls(source if isinstance(source, Config) else load_config(source))

    def _load_components(self) -> LoadedComponents:
        """Each component on the first device of its placement list that loads it; with
        placement.keep_alternatives, also on the other devices the power policy may give it."""
        if self.config.backend.name != "onnxruntime":
            raise BackendError(f"backend {self.config.backend.name!r} is not available in this build "
                               "(TensorRT engines are chosen per component with placement: gpu | dla0 | dla1)")
        self._ort: OnnxRuntimeBackend | None = None
        self._trt = None  # TensorRTBackend, made on the first gpu/dla placement
        self.placements: dict[str, Placement] = {}
        self.standby: dict[str, dict[str, Component]] = {}  # component → device → loaded, first device first
        loaded: dict[str, Component] = {}
        for kind in COMPONENTS:
            devices = getattr(self.config.placement, kind)
            loaded[kind], self.placements[kind] = place(kind, devices, self._load_on)
            self.standby[kind] = {self.placements[kind].device: loaded[kind]}
            if self.config.placement.keep_alternatives:
                self._load_alternatives(kind, devices)
        missing = self._ort.missing if self._ort is not None else []
        return LoadedComponents(loaded["vision_encoder"], loaded["embed_tokens"], loaded["decoder"],
                                extra={"missing_providers": missing,
                                       "placement": {k: p.to_dict() for k, p in self.placements.items()}})

    def _load_alternatives(self, kind: str, devices: list[str]) -> None:
        """Load `kind` on the devices after the first that the power policy could move it to
        (the first DLA when hot or over budget, the GPU when latency is at risk). The CPU
        stays a fallback for a missing engine, not a power choice, unless it is listed first."""
        placement = self.placements[kind]
        tried = {placement.device} | {d for d, _ in placement.skipped}
        for device in reachable_devices(devices):
            if device in tried:
                continue
            try:
                self.standby[kind][device] = self._load_on(kind, device)
            except EdgemmError as e:
                placement.skipped.append((device, str(e)))
                log.warning("%s: no standby on %s: %s", kind, device, e)
                continue
            placement.standby.append(device)

    def _load_on(self, kind: str, device: str) -> Component:
        """One component on one device: onnxruntime for cpu, a TensorRT engine otherwise."""
        if device == "cpu":
            path = self.manifest.graph_path(kind, self.precision)
            component = self._onnxruntime().load(kind, path, self.precision)
        else:
            path = self.engines_dir
            component = self._tensorrt().load_component(kind, device, self.precision)
        check_component(kind, component, str(path))
        return component

    @property
    def engines_dir(self) -> Path:
        return Path(self.config.model.engines) if self.config.model.engines else default_engines_dir(self.manifest.name)

    def _onnxruntime(self) -> OnnxRuntimeBackend:
        if self._ort is None:
            cfg = self.config.backend
            threads, spin = cfg.intra_op_threads, True
            if self.concurrent:  # two stages at once: half the cores each, no spinning on the other's cores
                threads, spin = threads or max(1, usable_cpus() // 2), False
            self._ort = OnnxRuntimeBackend(cfg.providers, threads, spin)
            if self._ort.missing:
                log.warning("onnxruntime here lacks %s; running on %s", ", ".join(self._ort.missing),
                            ", ".join(self._ort.providers))
        return self._ort

    def _tensorrt(self):
        if self._trt is None:
            from edgemm.backends.tensorrt import TensorRTBackend  # imports tensorrt + pycuda
            self._trt = TensorRTBackend.for_model(self.manifest, self.engines_dir)
        return self._trt

    def _make_scheduler(self) -> Scheduler:
        cfg = self.config.scheduler
        tiers = list(self.manifest.tiers)
        if cfg.policy == "top":
            return Scheduler(tiers, self.manifest.default_tier)
        if cfg.policy == "calibrated":
            policy = TierPolicy.load(self.manifest.path / POLICY_FILE)
        else:
            policy = TierPolicy(cfg.statistic, list(cfg.thresholds), tuple(cfg.detail_words), cfg.detail_tier)
        try:
            return Scheduler(tiers, self.manifest.default_tier, policy)
        except ValueError as e:
            where = "scheduler" if cfg.policy == "thresholds" else str(self.manifest.path / POLICY_FILE)
            raise ConfigError(f"{where}: {e} (model {self.manifest.name})") from None

    def warmup(self) -> None:
        """One tiny request per tier and one look by the scheduler, so the first real
        request doesn't pay for allocation."""
        routes = [None] + [Route({kind: device}, "warm-up") for kind, loaded in self.standby.items()
                           for device in list(loaded)[1:]]  # each standby component once too
        for route in routes:
            for tier in self.manifest.tiers.values():
                blank = np.zeros((tier.height, tier.width, 3), np.uint8)
                self.infer(blank, "warm up", tier=tier.name, max_new_tokens=1, route=route)
        self.scheduler.decide(blank, "warm up")

    def encoder_batch_speedup(self, tier: str, batch: int, repeats: int = 5) -> float:
        """Per-image speed of one encoder call on `batch` images over single-image calls
        (> 1: batching pays), on the first encoder device: the median over `repeats` pairs
        of one batched call and one single call, timed back to back on blank images. A CPU
        gains little or nothing (bigger activations, the same arithmetic); a GPU or DLA,
        whose per-call cost is mostly fixed, gains several times."""
        chosen = self.manifest.tiers[tier]
        one = self.pixels(np.zeros((chosen.height, chosen.width, 3), np.uint8), chosen)
        many = np.concatenate([one] * batch)

        def seconds(pixels: np.ndarray) -> float:
            started = time.perf_counter()
            self.generator.encode(pixels)
            return time.perf_counter() - started
        seconds(many)  # the batch shape's first run allocates
        ratios = sorted(batch * seconds(one) / seconds(many) for _ in range(repeats))
        self.generator.encoder.release_memory()  # the batch's memory (onnxruntime: at the next run)
        self.generator.encode(one)
        return ratios[len(ratios) // 2]

    @property
    def devices(self) -> dict[str, str]:
        """component → the device that runs it (cpu, gpu, dla0, dla1)."""
        return {c.name: c.device for c in self.components.all()}

    def placement_report(self) -> dict[str, dict]:
        """component → {device, backend, provider, precision, skipped: [{device, reason}]}, for status."""
        return {c.name: {**self.placements[c.name].to_dict(), "device": c.device, "provider": c.provider,
                         "precision": c.precision} for c in self.components.all()}

    def backend_seconds(self) -> float:
        """Total time spent inside raw backend run calls so far (for overhead accounting)."""
        return sum(c.stats.seconds for by_device in self.standby.values() for c in by_device.values())

    def resolve(self, route: Route | None) -> tuple[str, str, str]:
        """The devices that run (encoder, embedding, decoder) for a wished placement: the
        wished device where that component is loaded on it, else its first device."""
        wished = route.stages if route is not None else {}
        return tuple(wished[kind] if wished.get(kind) in self.standby[kind] else self.placements[kind].device
                     for kind in COMPONENTS)

    def generator_for(self, route: Route | None) -> Generator:
        """A Generator over the components `route` resolves to (made once per combination)."""
        devices = self.resolve(route)
        generator = self._generators.get(devices)
        if generator is None:
            parts = [self.standby[kind][device] for kind, device in zip(COMPONENTS, devices)]
            generator = self._generators[devices] = Generator(*parts, self.manifest.max_context,
                                                              self.adapter.stop_ids)
        return generator

    def check_size(self, image) -> None:
        """Refuse oversized encoded images before reading or decoding them."""
        limit = self.config.limits.max_image_bytes
        if isinstance(image, (bytes, bytearray, memoryview)):
            size = len(image)
        elif isinstance(image, (str, os.PathLike)) and os.path.isfile(image):
            size = os.path.getsize(image)
        else:
            return
        if size > limit:
            raise InputError(f"image is {size} bytes, above the {limit} byte limit (limits.max_image_bytes)")

    def load(self, image) -> np.ndarray:
        """A path, encoded bytes or an RGB array → RGB8 array, within the size limits."""
        self.check_size(image)
        return load_image(image, max_pixels=self.config.limits.max_pixels)

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """[1,3,H,W], or [1,tiles,3,H,W] for a tiled family: the adapter decides."""
        return self.adapter.pixels(rgb, tier)

    def preprocess(self, image, tier: str | None = None) -> tuple[np.ndarray, str]:
        """Pixel values at `tier` (else the configured or default tier; no scheduling)."""
        chosen = self.manifest.tier(tier or self.config.generation.tier)
        return self.pixels(self.load(image), chosen), chosen.name

    def prepare(self, image, prompt: str, *, tier: str | None = None, max_new_tokens: int | None = None,
                temperature: float | None = None, top_p: float | None = None,
                seed: int | None = None, num_beams: int | None = None,
                beam_gate: float | None = None, route: Route | None = None) -> PreparedRequest:
        """Stage 1: check and decode the image, pick the tier, build the prompt ids.

        The tier is `tier`, else generation.tier from the config, else the scheduler's choice.
        `route` is the power policy's placement; the later stages follow it where they can.
        """
        t0 = time.perf_counter()
        gen = self.config.generation
        if len(prompt) > self.config.limits.max_prompt_chars:
            raise InputError(f"prompt is {len(prompt)} characters, above the "
                             f"{self.config.limits.max_prompt_chars} limit (limits.max_prompt_chars)")
        options = GenerationOptions(
            max_new_tokens=max_new_tokens if max_new_tokens is not None else gen.max_new_tokens,
            temperature=temperature if temperature is not None else gen.temperature,
            top_p=top_p if top_p is not None else gen.top_p,
            seed=seed if seed is not None else gen.seed,
            num_beams=num_beams if num_beams is not None else gen.num_beams,
            beam_gate=beam_gate if beam_gate is not None else gen.beam_gate)
        rgb = self.load(image)
        pinned = tier or gen.tier
        decision = self.scheduler.decide(rgb, prompt, self.manifest.tier(pinned).name if pinned else None)
        chosen = self.manifest.tiers[decision.tier]
        pixel_values = self.pixels(rgb, chosen)
        prompt_ids = self.prompt_ids(prompt, chosen, rgb.shape[:2])
        # keyed here, on the caller's (or the pipeline's prepare) thread, not the encoder's
        key = self.feature_key(pixel_values[0], chosen.name) if self.cache is not None else None
        timings = {"preprocess": (time.perf_counter() - t0) * 1e3}
        if decision.stats is not None:
            timings["schedule"] = decision.stats.ms
        return PreparedRequest(pixel_values, chosen, prompt_ids, options, timings, decision, key, route)

    def prompt_ids(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int]) -> Prompt:
        """The adapter's prompt ids, remembered: cameras, kiosks and scripts ask the same few
        questions again and again. Keyed by the image size too (tiling families depend on it).
        The arrays are shared, so they are made read-only."""
        return self._cached_prompt(prompt, tier.name, tuple(image_size))

    def _read_only_prompt(self, prompt: str, tier: str, image_size: tuple[int, int]) -> Prompt:
        built = self.adapter.build_prompt(prompt, self.manifest.tiers[tier], image_size)
        for array in (built.input_ids, built.image_positions):
            array.flags.writeable = False
        return built

    def feature_key(self, pixel_values: np.ndarray, tier: str) -> bytes:
        return feature_key(pixel_values, tier, self.manifest.name, self.precision)

    def encode(self, pixel_values: np.ndarray, keys: list[bytes | None] | None = None,
               route: Route | None = None) -> np.ndarray:
        """Stage 2: image features for a batch of same-tier images [B,3,H,W] → [B,N,D],
        on the encoder `route` resolves to.

        With the feature cache on, only the images it doesn't hold reach the encoder.
        `keys` are the images' cache keys when already computed (PreparedRequest.cache_key).
        """
        generator = self.generator_for(route)
        if self.cache is None:
            return generator.encode(pixel_values)
        if keys is None or any(k is None for k in keys):
            tier = self._tier_by_shape.get(tuple(pixel_values.shape[2:]), "")  # the shape is in the key too
            keys = [self.feature_key(image, tier) for image in pixel_values]
        found = [self.cache.get(key) for key in keys]
        missing = [i for i, features in enumerate(found) if features is None]
        if missing:
            # indexing with a list copies the pixels (0.8 MB at 256 px): only when some were found
            fresh = generator.encode(pixel_values if len(missing) == len(keys) else pixel_values[missing])
            fresh.flags.writeable = False  # the cache keeps it and callers share it
            for row, i in enumerate(missing):
                found[i] = fresh[row]
                self.cache.put(keys[i], fresh[row], copy=False)  # fresh is ours alone
        return found[0][None] if len(found) == 1 else np.stack(found)

    def decode(self, request: PreparedRequest, features: np.ndarray, on_token: TextCallback | None = None,
               cancelled: threading.Event | None = None) -> InferenceResult:
        """Stage 3 for one request, its features [1,N,D]: a decoding batch of one."""
        outcome: list = []
        batch = self.open_batch(request.route, lambda _key, result: outcome.append(result))
        batch.join([(None, request, features, on_token, cancelled)])
        while batch:
            batch.step()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def decode_batch(self, requests: list[PreparedRequest], features: list[np.ndarray],
                     on_tokens: list[TextCallback | None] | None = None,
                     cancelled: list[threading.Event | None] | None = None) -> list[InferenceResult | Exception]:
        """Stage 3 for several requests at once: one decoder call per step for all of them
        (edgemm/decode.py). A request that fails gets its exception in its place; the
        others are unaffected."""
        on_tokens = on_tokens or [None] * len(requests)
        cancelled = cancelled or [None] * len(requests)
        out: list[InferenceResult | Exception | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}  # one batch per set of devices (the policy rarely splits them)
        for i, request in enumerate(requests):
            groups.setdefault(self.resolve(request.route), []).append(i)
        for rows in groups.values():
            batch = self.open_batch(requests[rows[0]].route, out.__setitem__)
            batch.join([(i, requests[i], features[i], on_tokens[i], cancelled[i]) for i in rows])
            while batch:
                batch.step()
        return out  # type: ignore[return-value]

    def open_batch(self, route: Route | None, finished, steps_by_rows: Counter | None = None) -> "RequestBatch":
        """An empty batch on the decoder `route` resolves to, that requests join and leave
        between steps (continuous batching, edgemm/decode.py). `finished(key, result or
        exception)` is called for each request as soon as its answer ends; decoder calls are
        counted by rows stepped together into `steps_by_rows` (a Counter) if given."""
        generator = self.generator_for(route)

        def done(key, outcome) -> None:
            caller_key, request, stream = key
            if not isinstance(outcome, Exception):
                try:
                    outcome = self._result(request, outcome, generator)
                    if stream is not None:
                        stream.finish(outcome.text)
                except Exception as e:  # assembling the answer failed: this request alone
                    outcome = e
            finished(caller_key, outcome)
        return RequestBatch(self, DecodingBatch(generator, done, steps_by_rows))

    def _prefix_reuse(self, request: PreparedRequest) -> PrefixReuse | None:
        if self.cache is None or request.cache_key is None:
            return None
        return PrefixReuse(self.cache, request.cache_key)

    def _result(self, request: PreparedRequest, generation, generator: Generator) -> InferenceResult:
        prompt = request.prompt
        schedule = request.decision.to_dict() if request.decision else {}
        if request.route is not None:
            schedule["placement"] = request.route.reason
        return InferenceResult(
            text=self.adapter.decode(generation.tokens), tokens=generation.tokens,
            finish_reason=generation.finish_reason, prompt_tokens=int(prompt.input_ids.shape[1]),
            tier=request.tier.name, image_tokens=prompt.image_tokens, precision=self.precision,
            devices={"encode": generator.encoder.device, "decode": generator.decoder.device},
            timings_ms={**request.timings_ms, **generation.timings_ms}, model=self.manifest.name,
            schedule=schedule,
            prefix_reused=bool(generation.stats.get("prefix_reused")),
            decode_batch=int(generation.stats.get("decode_batch", 1)),
            decoder_steps=int(generation.stats.get("decoder_rows", 0)))

    def infer(self, image, prompt: str, *, tier: str | None = None, max_new_tokens: int | None = None,
              temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
              num_beams: int | None = None, beam_gate: float | None = None,
              on_token: TextCallback | None = None, route: Route | None = None) -> InferenceResult:
        """Answer `prompt` about `image` (a path, encoded bytes or an RGB array).

        `on_token(token_id, new_text)` streams the answer: called after each token with the
        text that token adds ("" while a multi-byte character is incomplete), and, if the
        end of the answer held back text, once more with token id -1. The pieces
        concatenate to `result.text`."""
        t0 = time.perf_counter()
        request = self.prepare(image, prompt, tier=tier, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, seed=seed,
                               num_beams=num_beams, beam_gate=beam_gate, route=route)
        t1 = time.perf_counter()
        features = self.encode(request.pixel_values, [request.cache_key], route)
        request.timings_ms["encode"] = (time.perf_counter() - t1) * 1e3
        result = self.decode(request, features, on_token)
        result.timings_ms["total"] = (time.perf_counter() - t0) * 1e3
        return result


Joining = tuple[object, PreparedRequest, np.ndarray, "TextCallback | None", "threading.Event | None"]


class RequestBatch:
    """A DecodingBatch in the runtime's terms: prepared requests and their features in,
    InferenceResults out (through the `finished` callback of Runtime.open_batch)."""

    def __init__(self, runtime: Runtime, batch: DecodingBatch):
        self.runtime, self.batch = runtime, batch

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def steps_by_rows(self):
        """Rows stepped together → decoder calls, so far."""
        return self.batch.steps_by_rows

    def join(self, requests: list[Joining]) -> None:
        """(key, request, its features [1,N,D], on_token or None, cancel flag or None) each;
        prefilled and added. `on_token(token_id, new_text)` gets the text each token adds
        (edgemm/detokenize.py): only requests that stream pay for detokenizing."""
        rt = self.runtime
        items = []
        for key, request, features, on_token, cancelled in requests:
            stream = TextStream(rt.adapter.tokenizer, on_token) if on_token is not None else None
            items.append(((key, request, stream),
                          BatchItem(features, request.prompt.input_ids, request.prompt.image_positions,
                                    request.options, stream, rt._prefix_reuse(request), cancelled)))
        self.batch.join(items)

    def step(self) -> None:
        self.batch.step()

    def progress(self) -> list[tuple[int, int]]:
        return self.batch.progress()
