"""Stage 1, preparation: an image and a question become pixel values and prompt ids.

    image (path, bytes, RGB array) ─► size limits ─► decode ─► scheduler: tier
        ─► family adapter: pixel values (tiles) and prompt ids ─► feature-cache key

No model graph runs here: this is the pipeline's prepare thread (or the caller's).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from edgemm.engine.cache import feature_key
from edgemm.config import Config
from edgemm.errors import ConfigError, InputError
from edgemm.engine.generate import GenerationOptions
from edgemm.model.family import Family, Prompt
from edgemm.model.image import DecodeBudget, load_image
from edgemm.model.manifest import ModelManifest, ResolutionTier
from edgemm.engine.route import Route
from edgemm.engine.tiers import POLICY_FILE, Decision, Scheduler, TierPolicy

PROMPT_CACHE_SIZE = 256  # distinct (prompt, tier, image size) whose ids are kept
OPTIONS_CACHE_SIZE = 64  # distinct generation options kept, checked (GenerationOptions)


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
    warnings: list[str] = field(default_factory=list)  # one line each, handed on to the answer
    image_size: tuple[int, int] = (0, 0)  # the decoded image's (height, width)


def scheduler_policy(config: Config, manifest: ModelManifest) -> tuple[str, str]:
    """(the policy to run, why): scheduler.policy as configured, or for `auto` the
    calibration the model folder ships (its scheduler.yaml), else `top`."""
    policy = config.scheduler.policy
    if policy != "auto":
        return policy, f"scheduler.policy: {policy}"
    if (manifest.path / POLICY_FILE).is_file():
        return "calibrated", f"scheduler.policy auto: model {manifest.name} ships its calibration ({POLICY_FILE})"
    return "top", f"scheduler.policy auto: model {manifest.name} ships no calibration ({POLICY_FILE})"


def make_scheduler(config: Config, manifest: ModelManifest) -> Scheduler:
    """The tier scheduler the config asks for (scheduler.policy: auto | top | thresholds | calibrated)."""
    cfg = config.scheduler
    tiers = list(manifest.tiers)
    name, why = scheduler_policy(config, manifest)
    if name == "top":
        return Scheduler(tiers, manifest.default_tier, name=name, why=why)
    if name == "calibrated":
        policy = TierPolicy.load(manifest.path / POLICY_FILE)
    else:
        policy = TierPolicy(cfg.statistic, list(cfg.thresholds), tuple(cfg.detail_words), cfg.detail_tier)
    try:
        return Scheduler(tiers, manifest.default_tier, policy, name, why)
    except ValueError as e:
        where = "scheduler" if name == "thresholds" else str(manifest.path / POLICY_FILE)
        raise ConfigError(f"{where}: {e} (model {manifest.name})") from None


class Preparation:
    def __init__(self, config: Config, manifest: ModelManifest, adapter: Family, variants: str):
        """`variants`: the precisions loaded (ModelComponents.variants), in every feature-cache key."""
        self.config, self.manifest, self.adapter = config, manifest, adapter
        self.variants = variants
        self.scheduler = make_scheduler(config, manifest)
        # one budget for every thread preparing through this object (the daemon's prepare workers)
        self.decode_budget = DecodeBudget(config.limits.decode_budget_bytes)
        self.keyed = bool(config.cache.max_bytes)  # feature-cache keys are made here, off the encoder's thread
        # (prompt, tier, image size) → ids; lru_cache is thread-safe
        self._cached_prompt = functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)(self._read_only_prompt)
        # the same few option values again and again (the config's, a client's): each set is
        # checked once, and the requests that ask for it share its GenerationOptions (nothing
        # changes a request's options). typed: 1 and True, 1 and 1.0 are checked apart
        self._checked_options = functools.lru_cache(maxsize=OPTIONS_CACHE_SIZE, typed=True)(GenerationOptions)

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
        limits = self.config.limits
        return load_image(image, max_pixels=limits.max_pixels, max_bytes=limits.max_image_bytes,
                          max_decoded_bytes=limits.max_decoded_bytes, budget=self.decode_budget)

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
        """Check and decode the image, pick the tier, build the prompt ids.

        The tier is `tier`, else generation.tier from the config, else the scheduler's choice.
        `route` is the power policy's placement; the later stages follow it where they can.
        """
        t0 = time.perf_counter()
        gen = self.config.generation
        options = self.options(prompt, max_new_tokens, temperature, top_p, seed, num_beams, beam_gate)
        rgb = self.load(image)
        pinned = tier or gen.tier
        decision = self.scheduler.decide(rgb, prompt, self.manifest.tier(pinned).name if pinned else None)
        chosen = self.manifest.tiers[decision.tier]
        pixel_values = self.pixels(rgb, chosen)
        prompt_ids = self.prompt_ids(prompt, chosen, rgb.shape[:2])
        # refused here (limits.unknown_words: refuse) before any graph runs; else a warning
        warnings = [self.unknown_words_message(prompt_ids.unknown_words)] if prompt_ids.unknown_words else []
        key = self.image_key(rgb, pixel_values[0], chosen.name) if self.keyed else None
        timings = {"preprocess": (time.perf_counter() - t0) * 1e3}
        if decision.stats is not None:
            timings["schedule"] = decision.stats.ms
        return PreparedRequest(pixel_values, chosen, prompt_ids, options, timings, decision, key, route, warnings,
                               tuple(rgb.shape[:2]))

    def follow(self, leader: PreparedRequest, image, prompt: str, **options) -> PreparedRequest:
        """prepare() for another question about the image `leader` was prepared from (the
        daemon's alerts ask theirs about the stream's frame). Where its tier comes out as the
        leader's, its pixel values, cache key and image statistics are the leader's, not made
        again (the encoder then gives it the leader's features too); at another tier it is
        prepared as prepare() does. Options as prepare()'s."""
        t0 = time.perf_counter()
        gen = self.config.generation
        pinned = options.get("tier") or gen.tier
        stats = leader.decision.stats if leader.decision is not None else None
        rgb = None
        if not pinned and self.scheduler.policy is not None and stats is None \
                and self.scheduler.policy.needs_statistics(prompt):
            rgb = self.load(image)  # statistics the leader's prompt did not need
        decision = self.scheduler.decide(rgb, prompt, self.manifest.tier(pinned).name if pinned else None, stats)
        if decision.tier != leader.tier.name:
            return self.prepare(image, prompt, **options)
        generation = self.options(prompt, **{k: v for k, v in options.items() if k not in ("tier", "route")})
        prompt_ids = self.prompt_ids(prompt, leader.tier, leader.image_size)
        warnings = [self.unknown_words_message(prompt_ids.unknown_words)] if prompt_ids.unknown_words else []
        timings = {"preprocess": (time.perf_counter() - t0) * 1e3}
        return PreparedRequest(leader.pixel_values, leader.tier, prompt_ids, generation, timings, decision,
                               leader.cache_key, options.get("route"), warnings, leader.image_size)

    def options(self, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None,
                top_p: float | None = None, seed: int | None = None, num_beams: int | None = None,
                beam_gate: float | None = None) -> GenerationOptions:
        """The prompt's length checked, and the request's options over the config's, checked."""
        gen = self.config.generation
        if len(prompt) > self.config.limits.max_prompt_chars:
            raise InputError(f"prompt is {len(prompt)} characters, above the "
                             f"{self.config.limits.max_prompt_chars} limit (limits.max_prompt_chars)")
        values = (max_new_tokens if max_new_tokens is not None else gen.max_new_tokens,
                  temperature if temperature is not None else gen.temperature,
                  top_p if top_p is not None else gen.top_p,
                  seed if seed is not None else gen.seed,
                  num_beams if num_beams is not None else gen.num_beams,
                  beam_gate if beam_gate is not None else gen.beam_gate)  # GenerationOptions' order
        try:
            return self._checked_options(*values)
        except TypeError:  # a value that does not hash (a list …): GenerationOptions says what is wrong
            return GenerationOptions(*values)

    def unknown_words_message(self, words: tuple[str, ...]) -> str:
        """One line naming the words the model cannot read and the questions it knows; an
        InputError instead with limits.unknown_words: refuse."""
        shown = ", ".join(repr(w) for w in words[:8]) + (" …" if len(words) > 8 else "")
        message = f"the prompt has words model {self.manifest.name} does not know: {shown}"
        known = self.adapter.known_prompts
        if known:
            message += "; it knows: " + " | ".join(known)
        if self.config.limits.unknown_words == "refuse":
            raise InputError(message + " (limits.unknown_words: refuse)")
        return message + " (the answer is a guess)"

    def check_prompt(self, prompt: str, tier: str | None = None) -> None:
        """What every request asking `prompt` would be refused for, said without an image (a
        stream's and its alerts' prompts, checked before the stream starts): the family's own
        prompt building at `tier` (else the default tier) for an image of the tier's size, the
        rule every request goes through (a reserved token such as the image token is refused
        there), and limits.unknown_words: refuse. InputError with the request's message."""
        chosen = self.manifest.tier(tier or self.config.generation.tier)
        built = self.prompt_ids(prompt, chosen, (chosen.height, chosen.width))
        if built.unknown_words:
            self.unknown_words_message(built.unknown_words)  # raises with limits.unknown_words: refuse

    def prompt_ids(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int]) -> Prompt:
        """The adapter's prompt ids, remembered: cameras, kiosks and scripts ask the same few
        questions again and again. Keyed by the image size too (tiling families depend on it).
        The arrays are shared, so they are made read-only."""
        return self._cached_prompt(prompt, tier.name, tuple(image_size))

    def _read_only_prompt(self, prompt: str, tier: str, image_size: tuple[int, int]) -> Prompt:
        built = self.adapter.build_prompt(prompt, self.manifest.tiers[tier], image_size)
        for array in (built.input_ids, built.image_positions, built.position_ids):
            if array is not None:
                array.flags.writeable = False
        return built

    def feature_key(self, pixel_values: np.ndarray, tier: str) -> bytes:
        return feature_key(pixel_values, tier, self.manifest.name, self.variants)

    def image_key(self, rgb: np.ndarray, pixel_values: np.ndarray, tier: str) -> bytes:
        """The feature-cache key of an image prepared at `tier`: the digest of the decoded RGB8
        image or of its pixel values, whichever has fewer bytes. The family's pixel values are
        a function of the image and the tier, so either names the same features; an image no
        larger than the tier is a quarter of its float32 pixel values to hash (at 256 px,
        ~10 µs instead of ~40 µs on the caches the decoder left cold). The two kinds never
        meet: the digest covers the array's dtype and shape."""
        return self.feature_key(rgb if rgb.nbytes <= pixel_values.nbytes else pixel_values, tier)
