"""Runtime: the public entry point. Load a model once, answer (image, prompt) requests.

    from edgemm import Runtime
    rt = Runtime.from_config("edgemm.yaml")        # or Runtime() for the built-in model
    result = rt.infer("photo.jpg", "how many shapes are there ?")
    print(result.text, result.timings_ms)

The CLI, the pipeline (and so the daemon and stream mode) all go through this class.
It is a thin facade over the four parts that do the work (docs/ARCHITECTURE.md):

    models       edgemm/engine/loading.py      the graphs on their devices, placement, generators
    preparation  edgemm/engine/preparation.py  stage 1: image → tier, pixel values, prompt ids
    encoding     edgemm/engine/encoding.py     stage 2: pixel values → features (feature cache)
    answering    edgemm/engine/answering.py    stage 3: features → answers (the decode loop)
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edgemm.engine.answering import Answered, Answering, InferenceResult, RequestBatch
from edgemm.engine.cache import FeatureCache
from edgemm.engine.contract import check_image_tokens
from edgemm.config import Config, load_config
from edgemm.errors import ConfigError
from edgemm.engine.detokenize import TextCallback
from edgemm.engine.encoding import Encoding
from edgemm.engine.loading import BUILTIN_MODEL, ModelComponents, default_engines_dir, default_model_dir, usable_cpus
from edgemm.model.family import adapter_for, graph_inputs
from edgemm.model.manifest import ModelManifest, ResolutionTier, load_manifest
from edgemm.util.opencv import cv2
from edgemm.engine.route import Route
from edgemm.engine.preparation import PreparedRequest, Preparation

__all__ = ["Runtime", "InferenceResult", "PreparedRequest", "BUILTIN_MODEL", "default_engines_dir",
           "default_model_dir", "usable_cpus"]

log = logging.getLogger("edgemm")


class Runtime:
    def __init__(self, config: Config | None = None, concurrent: bool = False, warm_up: bool | None = None,
                 one_shot: bool = False):
        """`concurrent`: the encoder and the decoder will run at the same time (the pipeline
        of `serve` and `stream`); backend.intra_op_threads 0 then splits the cores between them.
        `warm_up`: run the tiers of backend.warmup once now (None), every tier (True) or none
        (False: `edgemm infer`, whose answer is its own first run, and callers that warm up
        themselves with warmup(), reporting its cost). `one_shot`: it answers one request
        (`edgemm infer`): no graph runs but that request's (the load check reads the graph only)."""
        self.config = config or load_config(None)
        self.concurrent = concurrent
        if concurrent:
            # decoding, resizing and the scheduler's statistics run on the pipeline's prepare
            # thread while onnxruntime keeps the cores busy; OpenCV's own pool would only wait
            # behind it (and the setting is process-wide: serve and stream own their process)
            cv2.setNumThreads(1)
        model_dir = Path(self.config.model.path) if self.config.model.path else default_model_dir()
        self.manifest: ModelManifest = load_manifest(model_dir)
        self.warmup_tiers = self._warmup_tiers()  # a tier the model lacks: exit 2 before any graph loads
        self.adapter = adapter_for(self.manifest)
        self.models = ModelComponents(self.config, self.manifest, self.adapter.stop_ids, concurrent,
                                      graph_inputs(self.adapter))
        self.precision = self.models.precision  # model.precision with `auto` resolved (e.g. q4)
        if any(device.startswith("dla") for device in self.models.standby["vision_encoder"]):
            # a DLA plan is static: a family whose image shapes vary within a tier (Qwen2-VL's grid)
            # takes each tier's own shape instead, on every device, so that answers do not depend on it
            static = getattr(self.adapter, "use_static_shapes", None)
            if static is not None:
                static()
        # the image tokens each tier's prompt holds against what the encoder gives: a folder that
        # contradicts itself is refused here (exit 2), not at its first request. Where the graph
        # does not fix the count, finding it runs the encoder on a blank image (a whole tile's
        # encode at real size): a one-shot `infer` (one_shot) does not pay that, it encodes its
        # answer alone, and a contradiction there fails that request (generate.image_positions)
        check_image_tokens(self.adapter, self.manifest, self.models.loaded.vision_encoder,
                           None if one_shot else self.models.generator.encode)
        self.preparation = Preparation(self.config, self.manifest, self.adapter, self.models.variants)
        self.encoding = Encoding(self.models, self.preparation, self.manifest)
        self.answering = Answering(self.models, self.encoding, self.adapter, self.manifest)
        if self.config.cache.max_bytes:
            self.encoding.cache = FeatureCache(self.config.cache.max_bytes)
        tiers = self.warmup_tiers if warm_up is None else list(self.manifest.tiers) if warm_up else []
        if tiers:
            self.warmup(tiers)

    @classmethod
    def from_config(cls, source=None) -> "Runtime":
        """`source`: a Config, a YAML path, a dict, or None for all defaults."""
        return cls(source if isinstance(source, Config) else load_config(source))

    def _warmup_tiers(self) -> list[str]:
        """The tiers backend.warmup names (all, none or a list), each one the model has."""
        wanted = self.config.backend.warmup
        if wanted == "all":
            return list(self.manifest.tiers)
        if wanted == "none":
            return []
        for i, name in enumerate(wanted):
            if name not in self.manifest.tiers:
                raise ConfigError(f"'backend.warmup[{i}]' is {name!r}, a tier {self.manifest.name} does not have "
                                  f"(its tiers: {', '.join(self.manifest.tiers)})")
        return list(wanted)

    def warmup(self, tiers: list[str] | None = None, standby: bool = True,
               report: Callable[[str], None] | None = None) -> float:
        """One tiny request per tier (`tiers`, default all) and one look by the scheduler, so
        the first real request doesn't pay for allocation; with `standby`, through each
        standby component too. The feature cache is left out, so blank frames don't fill it.
        Returns the seconds it took; `report(line)` hears a line per tier and the total.

        The largest tier goes first and the arenas hand back what only it needed: onnxruntime's
        arena keeps every block it ever grew, so smaller tiers warmed first would leave blocks
        too small for the next, and the peak would be their sum instead of the largest alone."""
        chosen = [self.manifest.tier(name) for name in (self.manifest.tiers if tiers is None else tiers)]
        names = [t.name for t in sorted(chosen, key=lambda t: t.pixels, reverse=True)]
        if not names:
            return 0.0
        routes = [None]
        if standby:
            routes += [Route({kind: device}, "warm-up") for kind, loaded in self.standby.items()
                       for device in list(loaded)[1:]]
        if report:
            report(f"warming {len(names)} tier{'s' if len(names) != 1 else ''} ({', '.join(names)}), "
                   f"largest first …")
        started = time.perf_counter()
        cache, self.encoding.cache = self.encoding.cache, None
        # a question the model knows: words it cannot read would be refused (limits.unknown_words)
        prompt = next(iter(self.adapter.known_prompts), "warm up")
        try:
            for i, name in enumerate(names):
                tier, tier_started = self.manifest.tiers[name], time.perf_counter()
                blank = np.zeros((tier.height, tier.width, 3), np.uint8)
                for route in routes:
                    self.infer(blank, prompt, tier=tier.name, max_new_tokens=1, route=route)
                if i == 0 and len(names) > 1:
                    self.models.release_memory()
                if report:
                    report(f"warmed {name} ({tier.width}×{tier.height}, {tier.image_tokens} image tokens) "
                           f"in {time.perf_counter() - tier_started:.1f} s")
            self.scheduler.decide(blank, prompt)
        finally:
            self.encoding.cache = cache
        seconds = time.perf_counter() - started
        if report:
            report(f"warming {len(names)} tier{'s' if len(names) != 1 else ''} … {seconds:.1f} s")
        return seconds

    # ---- the three stages (the pipeline calls these, one thread each) ----------------------

    def prepare(self, image, prompt: str, **options) -> PreparedRequest:
        """Stage 1 (edgemm/engine/preparation.py): options are tier, max_new_tokens, temperature,
        top_p, seed, num_beams, beam_gate and route."""
        return self.preparation.prepare(image, prompt, **options)

    def follow(self, leader: PreparedRequest, image, prompt: str, **options) -> PreparedRequest:
        """Stage 1 for another question about `leader`'s image: its pixels and features shared
        where the tier is the same (edgemm/engine/preparation.py)."""
        return self.preparation.follow(leader, image, prompt, **options)

    def encode(self, pixel_values: np.ndarray, keys: list[bytes | None] | None = None,
               route: Route | None = None) -> np.ndarray:
        """Stage 2 (edgemm/engine/encoding.py): features [B,N,D] of same-tier images."""
        return self.encoding.encode(pixel_values, keys, route)

    def open_batch(self, route: Route | None, finished: Answered,
                   steps_by_rows: Counter | None = None) -> RequestBatch:
        """Stage 3 (edgemm/engine/answering.py): a decoding batch on the decoder `route` resolves to,
        that requests join and leave between steps (continuous batching, edgemm/engine/decode.py).
        `finished(key, result or exception)` is called for each request as soon as its answer
        ends; decoder calls are counted by rows stepped together into `steps_by_rows`."""
        return RequestBatch(self.answering, route, finished, steps_by_rows)

    def decode(self, request: PreparedRequest, features: np.ndarray, on_token: TextCallback | None = None,
               cancelled: threading.Event | None = None) -> InferenceResult:
        """Stage 3 for one request, its features [1,N,D]: a decoding batch of one."""
        outcome: list = [None]
        batch = self.open_batch(request.route, outcome.__setitem__)
        batch.join([(0, request, features, on_token, cancelled)])
        batch.run_to_end()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def decodes_batched(self, route: Route | None) -> bool:
        """Whether requests decode together on the decoder `route` resolves to: not where its
        rows depend on their batch mates (a dynamic int8 graph, ModelComponents.batches_exactly),
        which gets one request per batch so that an answer never depends on who asked beside it."""
        return self.models.batches_exactly(self.models.generator_for(route).decoder)

    def decode_batch(self, requests: list[PreparedRequest], features: list[np.ndarray],
                     on_tokens: list[TextCallback | None] | None = None,
                     cancelled: list[threading.Event | None] | None = None) -> list[InferenceResult | Exception]:
        """Stage 3 for several requests at once: one decoder call per step for all of them.
        A request that fails gets its exception in its place; the others are unaffected."""
        on_tokens = on_tokens or [None] * len(requests)
        cancelled = cancelled or [None] * len(requests)
        out: list[InferenceResult | Exception | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}  # one batch per set of devices (the policy rarely splits them)
        for i, request in enumerate(requests):  # a decoder that batches inexactly: a batch each
            groups.setdefault(self.resolve(request.route) + (() if self.decodes_batched(request.route) else (i,)),
                              []).append(i)
        for rows in groups.values():
            batch = self.open_batch(requests[rows[0]].route, out.__setitem__)
            batch.join([(i, requests[i], features[i], on_tokens[i], cancelled[i]) for i in rows])
            batch.run_to_end()
        return out  # type: ignore[return-value]

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
        request = self.preparation.prepare(image, prompt, tier=tier, max_new_tokens=max_new_tokens,
                                           temperature=temperature, top_p=top_p, seed=seed,
                                           num_beams=num_beams, beam_gate=beam_gate, route=route)
        return self.answer(request, on_token, started=t0)

    def answer(self, request: PreparedRequest, on_token: TextCallback | None = None,
               started: float | None = None) -> InferenceResult:
        """Stages 2 and 3 for one prepared request (Runtime.prepare). The total time counts
        from `started` (a perf_counter reading), else from the request's preparation on."""
        t1 = time.perf_counter()
        features = self.encode(request.pixel_values, [request.cache_key], request.route)
        request.timings_ms["encode"] = (time.perf_counter() - t1) * 1e3
        result = self.decode(request, features, on_token)
        since = (time.perf_counter() - started) * 1e3 if started is not None else \
            request.timings_ms.get("preprocess", 0.0) + (time.perf_counter() - t1) * 1e3
        result.timings_ms["total"] = since
        return result

    # ---- what the parts know, for callers and tools ----------------------------------------

    @property
    def cache(self) -> FeatureCache | None:
        return self.encoding.cache

    @property
    def scheduler(self):
        return self.preparation.scheduler

    @property
    def generator(self):
        """The Generator over each component's first device."""
        return self.models.generator

    @property
    def components(self):
        return self.models.loaded

    @property
    def standby(self):
        return self.models.standby

    @property
    def placements(self):
        return self.models.placements

    @property
    def engines_dir(self) -> Path:
        return self.models.engines_dir

    @property
    def devices(self) -> dict[str, str]:
        return self.models.devices

    def placement_report(self) -> dict[str, dict]:
        return self.models.placement_report()

    def resolve(self, route: Route | None) -> tuple[str, str, str]:
        return self.models.resolve(route)

    def preprocess(self, image, tier: str | None = None) -> tuple[np.ndarray, str]:
        return self.preparation.preprocess(image, tier)

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        return self.preparation.pixels(rgb, tier)

    def prompt_ids(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int]):
        return self.preparation.prompt_ids(prompt, tier, image_size)

    def encoder_batch_speedup(self, tier: str, batch: int, repeats: int = 5) -> float:
        return self.encoding.batch_speedup(tier, batch, repeats)
