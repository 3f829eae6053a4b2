"""Timing each graph of a model folder in each precision present, on the CPU (what
tools/choose_precisions.py runs; edgemm.engine.precision_choice keeps the result).

One request is prepared at the tier the model warms first (its largest): a blank image and
a question the model knows. Then, for each graph and precision, the median of `runs` calls:

    vision_encoder  one encoder input of that tier (a tiled family's tile: each costs the same)
    embed_tokens    the prompt's embedding
    decoder         one decode step after a past as long as the prompt (a first answer token's)

The other two graphs stay the baseline precision while one is timed, on the same onnxruntime
session options and threads as `edgemm` (the Runtime's own backend).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import numpy as np

from edgemm.config import load_config
from edgemm.engine.generate import Generator
from edgemm.engine.precision_choice import Measurement, cpu_identity, format_ms
from edgemm.engine.runtime import Runtime
from edgemm.model.manifest_types import COMPONENTS
from edgemm.model.quantization import graph_kind

Clock = Callable[[], float]


def median_ms(call: Callable[[], object], runs: int, clock: Clock) -> float:
    """The median of `runs` timed calls after one untimed (allocation) call, in ms."""
    call()
    times = []
    for _ in range(runs):
        started = clock()
        call()
        times.append((clock() - started) * 1e3)
    return statistics.median(times)


def graph_calls(generator: Generator, request) -> dict[str, Callable[[], object]]:
    """component → one call of that graph on `request` (a PreparedRequest), as the decode loop
    makes it: the encoder on one encoder input (a tiled family's first tile: the cost per tile),
    the embedding on the prompt, the decoder one step after a past as long as the prompt (its
    values do not change the time, so no encode and prefill are run for it)."""
    pixels = request.pixel_values
    if pixels.ndim == 5:  # [1, tiles, 3, H, W]: one tile
        pixels = pixels[:, :1]
    ids = request.prompt.input_ids
    length = ids.shape[1]
    heads, head_dim = generator.kv_shape
    past = dict.fromkeys(generator.past_names, np.zeros((1, heads, length, head_dim), generator.kv_dtype))
    token, mask = generator.embed_next([0]), np.ones((1, length + 1), np.int64)
    return {"vision_encoder": lambda: generator.encode(pixels),
            "embed_tokens": lambda: generator.embed.run({"input_ids": ids}),
            "decoder": lambda: generator.step(token, mask, past)}


def measure(model_dir: Path, threads: int, runs: int = 5, clock: Clock = time.perf_counter,
            report: Callable[[str], None] | None = None) -> Measurement:
    """Each graph's median ms in each precision present in `model_dir`, on `threads` CPU threads."""
    runtime = Runtime(load_config({"model": {"path": str(model_dir), "precision": "auto"},
                                   "backend": {"intra_op_threads": threads, "warmup": False},
                                   "placement": {kind: ["cpu"] for kind in COMPONENTS},
                                   "cache": {"max_bytes": 0}}), warm_up=False, one_shot=True)
    manifest, models = runtime.manifest, runtime.models
    tier = max(manifest.tiers.values(), key=lambda t: t.pixels)
    prompt = next(iter(runtime.adapter.known_prompts), "describe the image")
    request = runtime.prepare(np.zeros((tier.height, tier.width, 3), np.uint8), prompt, tier=tier.name)
    base = {c.name: c for c in models.loaded.all()}
    timings: dict[str, dict[str, dict]] = {}
    for kind, precisions in manifest.graph_precisions().items():
        timings[kind] = {}
        for precision in precisions:
            component = models.load_cpu_variant(kind, precision)
            parts = {**base, kind: component}
            generator = Generator(parts["vision_encoder"], parts["embed_tokens"], parts["decoder"],
                                  manifest.max_context, models.stop_ids, models.fed)
            ms = median_ms(graph_calls(generator, request)[kind], runs, clock)
            timings[kind][precision] = {"ms": round(ms, 3), "kind": graph_kind(manifest.graph_path(kind, precision))}
            if report:
                report(f"{kind} {precision}: {format_ms(ms)}")
            del component, generator
    return Measurement(cpu_identity(), threads, timings, date.today().isoformat())
