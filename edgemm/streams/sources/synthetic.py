"""synthetic://: generated scenes with their ground truth (edgemm.model.scenes), for demos and tests."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edgemm.model.image import DEFAULT_MAX_PIXELS
from edgemm.streams.errors import SourceUnusable
from edgemm.streams.sources.base import Frame, Source
from edgemm.streams.sources.uri import redact_uri

SYNTHETIC_SIZE = 256  # synthetic:// scenes' side in pixels unless ?size= says otherwise
# limits.max_synthetic_pixels' default. A synthetic frame is generated, not decoded, so the decode
# budget never sees it, and a 5000² scene (25 MP, within limits.max_pixels) took a daemon to
# ~900 MB per stream: 4 MP (2000²) keeps one stream's frames in flight to tens of MB
DEFAULT_MAX_SYNTHETIC_PIXELS = 4_000_000


def check_synthetic_size(uri: str, size: int, max_pixels: int, max_synthetic_pixels: int) -> None:
    # refused before a frame is made: a frame is size² × 3 bytes, several in flight per stream
    for limit, name in ((max_pixels, "limits.max_pixels"), (max_synthetic_pixels, "limits.max_synthetic_pixels")):
        if size * size > limit:
            raise SourceUnusable(f"{redact_uri(uri)}: size {size} makes {size * size} pixels per frame, "
                                 f"above {name} ({limit})")


class SyntheticSource(Source):
    """Generated scenes (edgemm.model.scenes) with their ground truth, for demos and tests.

    Frame i is make_scene(seed + i), so a run is reproducible. With fps > 0 frames are
    released on a fixed schedule, like a camera: a fast reader waits, a slow one gets
    the next frame at once but never a burst to catch up. fps 0 is as fast as possible.
    `hold` > 1: each scene lasts that many frames (frame i shows make_scene(seed + i // hold)),
    with fresh sensor noise on each, like a camera watching a scene that changes now and
    then (what alerts are for: a condition that holds for a while).
    """
    HOLD_NOISE = 3  # ± grey levels of the noise a held scene gets per frame

    def __init__(self, uri: str = "synthetic://", *, fps: float = 0.0, seed: int = 0,
                 count: int | None = None, size: int = SYNTHETIC_SIZE, text_probability: float = 0.5,
                 hold: int = 1, max_pixels: int = DEFAULT_MAX_PIXELS, max_synthetic_pixels: int = DEFAULT_MAX_SYNTHETIC_PIXELS,
                 sleep: Callable[[float], Any] | None = None, clock: Callable[[], float] = time.monotonic):
        check_synthetic_size(uri, size, max_pixels, max_synthetic_pixels)
        super().__init__(uri, live=fps > 0, sleep=sleep)
        self.fps, self.seed, self.count = fps, seed, count
        self.size, self.text_probability, self.hold = size, text_probability, hold
        self._scene, self._scene_seed = None, None  # the scene being held, and the seed it was made from
        self._clock = clock
        self._due = 0.0

    def _open(self) -> None:
        self._due = self._clock()

    def _next_frame(self) -> Frame | None:
        if self.count is not None and self._next_index >= self.count:
            return None
        # Imported here: the inference path never loads the scene generator.
        from edgemm.model.scenes import make_scene
        seed = self.seed + self._next_index // self.hold
        if self._scene is None or self._scene_seed != seed:
            self._scene = make_scene(seed, size=self.size, text_probability=self.text_probability)
            self._scene_seed = seed
        scene, image = self._scene, self._scene.image
        if self.hold > 1:  # a held scene: the same content, not the same pixels
            noise = np.random.default_rng(self._next_index).integers(-self.HOLD_NOISE, self.HOLD_NOISE + 1,
                                                                      image.shape, dtype=np.int16)
            image = np.clip(image + noise, 0, 255).astype(np.uint8)
        self._wait_until_due()
        return self._frame(image, truth=scene)

    def _wait_until_due(self) -> None:
        if self.fps <= 0:
            return
        now = self._clock()
        if self._due > now:
            self._sleep(self._due - now)
        # Late frames restart the schedule from now rather than bursting to catch up.
        self._due = max(self._due, now) + 1.0 / self.fps
