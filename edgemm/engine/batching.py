"""What the pipeline batches together: images per encoder call (`encoder_batch_limits`,
server.encoder_batching) and whether requests join a decoding batch between its steps
(`JoinPolicy`, server.continuous_batching, which the decode stage asks after every step).
"""
from __future__ import annotations

import logging

from edgemm.config import BATCHING_MODES
from edgemm.engine.runtime import Runtime

log = logging.getLogger(__name__)

ENCODER_BATCH_GAIN = 1.2  # encoder_batching auto: batch a tier only if a batch is this much faster per image


class JoinPolicy:
    """Whether requests that reach the decoder while a batch decodes join it now (continuous
    batching) or wait for the batch to end. A join costs every running row one prefill's
    delay; waiting costs the newcomer the rest of the batch. "auto" joins when the rest of
    the batch is expected to take longer than the prefills it would be held up by:

        remaining steps × step time  >  running rows × one prefill

    from the decoder's own recent timings and answer lengths (moving averages), so long
    answers on a GPU join and short answers on a CPU, where a prefill costs several
    steps, don't. "on" always joins, "off" never does."""

    def __init__(self, mode: str = "auto", smoothing: float = 0.1):
        if mode not in BATCHING_MODES:
            raise ValueError(f"decoder joins must be one of {', '.join(BATCHING_MODES)}, got {mode!r}")
        self.mode = mode
        self.smoothing = smoothing
        self.prefill_s = self.step_s = self.answer_tokens = None  # moving averages, once measured

    def now(self, progress: list[tuple[int, int]]) -> bool:
        """Join now? `progress`: (tokens so far, token budget) of each running row."""
        if not progress:
            return True  # an empty batch takes anyone: it is the next batch
        if self.mode != "auto":
            return self.mode == "on"
        if None in (self.prefill_s, self.step_s, self.answer_tokens):
            return True  # nothing measured yet
        # each row is expected to run to the usual answer length, at least one more token,
        # at most its budget; the batch lasts as long as its longest row
        remaining = max(min(budget, max(tokens + 1, self.answer_tokens)) - tokens for tokens, budget in progress)
        return remaining * self.step_s > len(progress) * self.prefill_s

    def prefilled(self, seconds: float, requests: int) -> None:
        self.prefill_s = self._average(self.prefill_s, seconds / requests)

    def stepped(self, seconds: float) -> None:
        self.step_s = self._average(self.step_s, seconds)

    def answered(self, tokens: int) -> None:
        self.answer_tokens = self._average(self.answer_tokens, float(tokens))

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)


def encoder_batch_limits(runtime: Runtime, max_batch: int, mode: str) -> dict[str, int]:
    """Most images per encoder call, per tier: max_batch ("on"), 1 ("off"), or for "auto"
    max_batch where one call on max_batch images is timed at least 20 % faster per image
    than single calls (a margin over the timing's noise), else 1. The decoder batches
    regardless: its steps always gain.

    A tiled family's image is already several encoder inputs (its tiles): a call holds at
    most max_batch inputs, so a tier of 5 tiles is never batched at max_batch 4. Without
    that, timing 4 images of SmolVLM's 17 tiles would be one 68-tile call, gigabytes beyond
    what serving one image at that tier takes."""
    manifest = runtime.manifest
    caps = {name: max(1, max_batch // manifest.encoder_images(tier)) for name, tier in manifest.tiers.items()}
    if mode == "off" or max_batch == 1:
        return dict.fromkeys(manifest.tiers, 1)
    if mode == "on":
        return caps
    limits = {}
    for tier, cap in caps.items():
        if cap == 1:
            limits[tier] = 1
            continue
        try:
            speedup = runtime.encoder_batch_speedup(tier, cap)
        except Exception as e:  # e.g. an engine built for smaller batches: serve, one image per call
            log.warning("encoder at %s: a batch of %d failed (%s); encoding one image per call",
                        tier, cap, str(e).splitlines()[0] if str(e) else type(e).__name__)
            limits[tier] = 1
            continue
        limits[tier] = cap if speedup >= ENCODER_BATCH_GAIN else 1
        log.info("encoder at %s: %d images per call run %.2fx the speed of single calls → batch %d",
                 tier, cap, speedup, limits[tier])
    return limits
