"""Stage 2, encoding: pixel values become image features, through the feature cache.

    [B,3,H,W] (tiled: [B,T,3,H,W]) ─► feature cache (hit: no encoder) ─► the vision
        encoder on the device the request's route resolves to ─► [B,N,D]

The cache (edgemm/engine/cache.py) is a byte-bounded LRU of encoder outputs keyed by the
pixels, tier, model and each component's precision as loaded (ModelComponents.variants);
it also keeps the decoder's KV cache of an image's prompt prefix (edgemm/engine/answering.py
hands it to the decode loop).
"""
from __future__ import annotations

import time

import numpy as np

from edgemm.engine.cache import FeatureCache
from edgemm.engine.generate import Generator
from edgemm.engine.loading import ModelComponents
from edgemm.model.manifest import ModelManifest
from edgemm.engine.route import Route
from edgemm.engine.preparation import Preparation


class Encoding:
    def __init__(self, models: ModelComponents, preparation: Preparation, manifest: ModelManifest):
        self.models, self.preparation = models, preparation
        self.cache: FeatureCache | None = None  # set by the runtime after its warm-up
        self._tier_by_shape = {(t.height, t.width): t.name for t in manifest.tiers.values()}
        self.manifest = manifest

    def encode(self, pixel_values: np.ndarray, keys: list[bytes | None] | None = None,
               route: Route | None = None) -> np.ndarray:
        """Image features for a batch of same-tier images [B,3,H,W] → [B,N,D], on the
        encoder `route` resolves to.

        With the feature cache on, only the images it doesn't hold reach the encoder.
        `keys` are the images' cache keys when already computed (PreparedRequest.cache_key).
        """
        models = self.models  # no route (Runtime.infer): the first devices, without resolving it
        generator = models.generator if route is None else models.generator_for(route)
        if self.cache is None:
            return self._run(generator, pixel_values)
        if keys is None or any(k is None for k in keys):
            tier = self._tier_by_shape.get(tuple(pixel_values.shape[2:]), "")  # the shape is in the key too
            keys = [self.preparation.feature_key(image, tier) for image in pixel_values]
        found = [self.cache.get(key) for key in keys]
        missing = [i for i, features in enumerate(found) if features is None]
        if missing:
            # indexing with a list copies the pixels (0.8 MB at 256 px): only when some were found
            fresh = self._run(generator, pixel_values if len(missing) == len(keys) else pixel_values[missing])
            fresh.flags.writeable = False  # the cache keeps it and callers share it
            for row, i in enumerate(missing):
                found[i] = fresh[row]
                self.cache.put(keys[i], fresh[row], copy=False)  # fresh is ours alone
        return found[0][None] if len(found) == 1 else np.stack(found)

    def _run(self, generator: Generator, pixel_values: np.ndarray) -> np.ndarray:
        """One encoder call on the images, or one per image where the encoder's rows depend on
        their batch (a dynamic int8 graph: ModelComponents.batches_exactly)."""
        if len(pixel_values) == 1 or self.models.batches_exactly(generator.encoder):
            return generator.encode(pixel_values)
        return np.concatenate([generator.encode(pixel_values[i:i + 1]) for i in range(len(pixel_values))])

    def batch_speedup(self, tier: str, batch: int, repeats: int = 5) -> float:
        """Per-image speed of one encoder call on `batch` images over single-image calls
        (> 1: batching pays), on the first encoder device: the median over `repeats` pairs
        of one batched call and one single call, timed back to back on blank images. A CPU
        gains little or nothing (bigger activations, the same arithmetic); a GPU or DLA,
        whose per-call cost is mostly fixed, gains several times."""
        chosen = self.manifest.tiers[tier]
        one = self.preparation.pixels(np.zeros((chosen.height, chosen.width, 3), np.uint8), chosen)
        many = np.concatenate([one] * batch)
        generator = self.models.generator

        def seconds(pixels: np.ndarray) -> float:
            started = time.perf_counter()
            self._run(generator, pixels)  # as encode runs it: image by image for a dynamic int8 encoder
            return time.perf_counter() - started
        seconds(many)  # the batch shape's first run allocates
        ratios = sorted(batch * seconds(one) / seconds(many) for _ in range(repeats))
        generator.encoder.release_memory()  # the batch's memory (onnxruntime: at the next run)
        generator.encode(one)
        return ratios[len(ratios) // 2]
