"""Stage 3, answering: prepared requests and their image features become answers.

    PreparedRequest + features [1,N,D] ─► RequestBatch.join ─► the decode loop
        (a RequestBatch is a DecodingBatch, edgemm/engine/decode.py: prefill, then one decoder
        call per step for every row) ─► InferenceResult (text, tier, devices, timings),
        made from the ending answer itself ─► finished(key, …)

Requests join and leave a batch between steps; a lone request is a batch of one.
Streamed requests get the text each token adds (edgemm/engine/detokenize.py); the image's
prompt prefix is kept in, and reused from, the feature cache.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from edgemm.engine.decode import Answer, BatchItem, DecodingBatch
from edgemm.engine.detokenize import TextCallback, TextStream
from edgemm.engine.encoding import Encoding
from edgemm.engine.generate import PrefixReuse
from edgemm.engine.loading import ModelComponents
from edgemm.model.family import Family
from edgemm.model.manifest import ModelManifest
from edgemm.engine.route import Route
from edgemm.engine.preparation import PreparedRequest


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
    precision_choice: dict[str, str] = field(default_factory=dict)  # precision auto: component → why that variant

    def to_dict(self) -> dict:
        """The result as plain data for JSON. Containers are copied one level deep: asdict's
        full recursion was a noticeable part of the daemon's own time per request."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(tokens=list(self.tokens), devices=dict(self.devices), schedule=dict(self.schedule),
                 warnings=list(self.warnings), precision_choice=dict(self.precision_choice),
                 timings_ms={k: round(v, 3) for k, v in self.timings_ms.items()})
        return d


Joining = tuple[object, PreparedRequest, np.ndarray, TextCallback | None, threading.Event | None]
Answered = Callable[[object, "InferenceResult | Exception"], None]  # (the caller's key, its outcome)


class Answering:
    """What stage 3 needs of the runtime: the decoders, the feature cache (for prompt
    prefixes), the family's tokenizer and the model's name. RequestBatch does the work."""

    def __init__(self, models: ModelComponents, encoding: Encoding, adapter: Family, manifest: ModelManifest):
        self.models, self.encoding, self.adapter, self.manifest = models, encoding, adapter, manifest
        # a family whose image prefix attends to the text after it says so (Family's
        # `reuses_image_prefix`, True when absent): its prefixes are neither kept nor reused
        self.reuses_prefix = bool(getattr(adapter, "reuses_image_prefix", True))
        # a component that did not load on the first device of its list, and why (CUDA that would
        # not start, a missing engine …): every answer says where it ran instead
        self.placement_notes = [f"{name} on {p.device} ({'; '.join(f'{device}: {why}' for device, why in p.skipped)})"
                                for name, p in models.placements.items() if p.skipped]


class RequestBatch(DecodingBatch):
    """The decode loop in the runtime's terms: prepared requests and their features join,
    and each leaves as an InferenceResult (or its exception), handed to `finished(key, …)`
    the moment its answer ends; decoder calls are counted by rows stepped together into
    `steps_by_rows` (a Counter) if given. It is the DecodingBatch itself, not a wrapper
    around one: a batch is opened for every request, and each object and call between the
    caller and the loop runs on the caches the encoder and the prefill left cold."""

    def __init__(self, answering: Answering, route: Route | None, finished: Answered,
                 steps_by_rows: Counter | None = None):
        models = answering.models  # no route (Runtime.infer): the first devices, without resolving it
        DecodingBatch.__init__(self, models.generator if route is None else models.generator_for(route),
                               finished, steps_by_rows)
        self.answering = answering
        # a dynamic int8 decoder quantizes each call's tokens together: a prompt prefilled from a
        # stored prefix would get other scales than prefilled whole, so its prefixes are not reused
        self.reuses_prefix = answering.reuses_prefix and models.batches_exactly(self.gen.decoder)

    def join(self, requests: list[Joining]) -> None:
        """(key, request, its features [1,N,D], on_token or None, cancel flag or None) each;
        prefilled and added. `on_token(token_id, new_text)` gets the text each token adds
        (edgemm/engine/detokenize.py): only requests that stream pay for detokenizing."""
        tokenizer, cache = self.answering.adapter.tokenizer, self.answering.encoding.cache
        items = []
        for key, request, features, on_token, cancelled in requests:
            stream = TextStream(tokenizer, on_token) if on_token is not None else None
            # the image's prompt prefix is kept in, and reused from, the feature cache
            reuse = PrefixReuse(cache, request.cache_key) if cache is not None and request.cache_key is not None \
                and self.reuses_prefix else None
            prompt = request.prompt
            image = prompt.image_positions if prompt.image_span is None else prompt.image_span
            items.append(((key, request, stream), BatchItem(features, prompt.input_ids, image,
                                                            request.options, stream, reuse, cancelled,
                                                            prompt.position_ids, prompt.rope_delta)))
        DecodingBatch.join(self, items)

    def _ended(self, a: Answer, reason: str) -> InferenceResult:
        """An answer ended: the request's InferenceResult, made from the answer itself (no
        Generation in between). This runs once per request, on the caches the decoder call
        left cold, where each object built costs; a failure here fails this request alone."""
        decode_ms = (time.perf_counter() - a.joined) * 1e3  # first: the decode time ends where the loop's work does
        _, request, _ = a.key
        answering, gen, prompt = self.answering, self.gen, request.prompt
        schedule = request.decision.to_dict() if request.decision else {}
        reasons = [request.route.reason] if request.route is not None else []
        if answering.placement_notes:
            reasons += answering.placement_notes
        if reasons:
            schedule["placement"] = "; ".join(reasons)
        timings = dict(request.timings_ms)
        timings["prefill"], timings["decode"] = a.prefill_ms, decode_ms
        return InferenceResult(
            text=answering.adapter.decode(a.tokens), tokens=a.tokens, finish_reason=reason,
            prompt_tokens=prompt.input_ids.shape[1], tier=request.tier.name, image_tokens=prompt.image_tokens,
            precision=answering.models.precision, devices={"encode": gen.encoder.device, "decode": gen.decoder.device},
            timings_ms=timings, model=answering.manifest.name, schedule=schedule, prefix_reused=a.reused,
            decode_batch=a.peers, decoder_steps=a.rows_stepped, warnings=list(request.warnings),
            precision_choice=dict(answering.models.precision_choices))  # its own: a caller may change it

    def _hand_over(self, key: tuple, outcome: InferenceResult | Exception) -> None:
        """An answer ended (its InferenceResult) or failed: a stream gets the text it has
        not had yet (a failure there fails this request alone), and the outcome goes to the
        caller."""
        caller_key, _, stream = key
        if stream is not None and not isinstance(outcome, Exception):
            try:
                stream.finish(outcome.text)
            except Exception as e:
                outcome = e
        DecodingBatch._hand_over(self, caller_key, outcome)
