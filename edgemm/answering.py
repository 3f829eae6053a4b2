"""Stage 3, answering: prepared requests and their image features become answers.

    PreparedRequest + features [1,N,D] ─► RequestBatch.join ─► the decode loop
        (edgemm/decode.py: prefill, then one decoder call per step for every row)
        ─► Generation ─► InferenceResult (text, tier, devices, timings) ─► finished(key, …)

Requests join and leave a batch between steps; a lone request is a batch of one.
Streamed requests get the text each token adds (edgemm/detokenize.py); the image's
prompt prefix is kept in, and reused from, the feature cache.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from edgemm.decode import BatchItem, DecodingBatch
from edgemm.detokenize import TextCallback, TextStream
from edgemm.encoding import Encoding
from edgemm.generate import Generation, Generator, PrefixReuse
from edgemm.loading import ModelComponents
from edgemm.model.family import Family
from edgemm.model.manifest import ModelManifest
from edgemm.power import Route
from edgemm.preparation import PreparedRequest


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
    warnings: list[str] = field(default_factory=list)  # one line each: e.g. words the model cannot read

    def to_dict(self) -> dict:
        """The result as plain data for JSON. Containers are copied one level deep: asdict's
        full recursion was a noticeable part of the daemon's own time per request."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(tokens=list(self.tokens), devices=dict(self.devices), schedule=dict(self.schedule),
                 warnings=list(self.warnings),
                 timings_ms={k: round(v, 3) for k, v in self.timings_ms.items()})
        return d


Joining = tuple[object, PreparedRequest, np.ndarray, TextCallback | None, threading.Event | None]
Answered = Callable[[object, "InferenceResult | Exception"], None]  # (the caller's key, its outcome)


class Answering:
    def __init__(self, models: ModelComponents, encoding: Encoding, adapter: Family, manifest: ModelManifest):
        self.models, self.encoding, self.adapter, self.manifest = models, encoding, adapter, manifest

    def open_batch(self, route: Route | None, finished: Answered,
                   steps_by_rows: Counter | None = None) -> "RequestBatch":
        """An empty batch on the decoder `route` resolves to, that requests join and leave
        between steps (continuous batching, edgemm/decode.py). `finished(key, result or
        exception)` is called for each request as soon as its answer ends; decoder calls are
        counted by rows stepped together into `steps_by_rows` (a Counter) if given."""
        generator = self.models.generator_for(route)

        def done(key, outcome) -> None:
            caller_key, request, stream = key
            if not isinstance(outcome, Exception):
                try:
                    outcome = self.result(request, outcome, generator)
                    if stream is not None:
                        stream.finish(outcome.text)
                except Exception as e:  # assembling the answer failed: this request alone
                    outcome = e
            finished(caller_key, outcome)
        return RequestBatch(self, DecodingBatch(generator, done, steps_by_rows))

    def prefix_reuse(self, request: PreparedRequest) -> PrefixReuse | None:
        cache = self.encoding.cache
        if cache is None or request.cache_key is None:
            return None
        return PrefixReuse(cache, request.cache_key)

    def result(self, request: PreparedRequest, generation: Generation, generator: Generator) -> InferenceResult:
        prompt = request.prompt
        schedule = request.decision.to_dict() if request.decision else {}
        if request.route is not None:
            schedule["placement"] = request.route.reason
        return InferenceResult(
            text=self.adapter.decode(generation.tokens), tokens=generation.tokens,
            finish_reason=generation.finish_reason, prompt_tokens=int(prompt.input_ids.shape[1]),
            tier=request.tier.name, image_tokens=prompt.image_tokens, precision=self.models.precision,
            devices={"encode": generator.encoder.device, "decode": generator.decoder.device},
            timings_ms={**request.timings_ms, **generation.timings_ms}, model=self.manifest.name,
            schedule=schedule,
            prefix_reused=bool(generation.stats.get("prefix_reused")),
            decode_batch=int(generation.stats.get("decode_batch", 1)),
            decoder_steps=int(generation.stats.get("decoder_rows", 0)),
            warnings=list(request.warnings))


class RequestBatch:
    """A DecodingBatch in the runtime's terms: prepared requests and their features in,
    InferenceResults out (through the `finished` callback of Answering.open_batch)."""

    def __init__(self, answering: Answering, batch: DecodingBatch):
        self.answering, self.batch = answering, batch

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def rows(self) -> int:
        """Decoder rows in use (a beam search holds several)."""
        return self.batch.rows

    @property
    def steps_by_rows(self) -> Counter:
        """Rows stepped together → decoder calls, so far."""
        return self.batch.steps_by_rows

    def join(self, requests: list[Joining]) -> None:
        """(key, request, its features [1,N,D], on_token or None, cancel flag or None) each;
        prefilled and added. `on_token(token_id, new_text)` gets the text each token adds
        (edgemm/detokenize.py): only requests that stream pay for detokenizing."""
        answering = self.answering
        items = []
        for key, request, features, on_token, cancelled in requests:
            stream = TextStream(answering.adapter.tokenizer, on_token) if on_token is not None else None
            items.append(((key, request, stream),
                          BatchItem(features, request.prompt.input_ids, request.prompt.image_positions,
                                    request.options, stream, answering.prefix_reuse(request), cancelled)))
        self.batch.join(items)

    def step(self) -> None:
        self.batch.step()

    def run_to_end(self) -> None:
        self.batch.run_to_end()

    def progress(self) -> list[tuple[int, int]]:
        return self.batch.progress()
