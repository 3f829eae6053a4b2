"""Confidence-gated beam search: beam-search answers at close to greedy cost.

Beams are the rows of one decoder batch. The prompt is prefilled once (batch 1);
each step runs every live beam through the decoder together, and the KV-cache
rows are reordered by the beam each survivor grew from.

The gate g (GenerationOptions.beam_gate) decides how much searching a request gets:

  collapse  when the best beam's most likely next token has probability ≥ g, the
            search ends there: the best beam is kept alone and finished greedily.
            Searching only pays where the model hesitates, and a small model is
            sure of most tokens. g = 0 collapses before the first token: greedy.
  prune     on the other steps, after the usual choice of the num_beams best
            continuations, those trailing the best one by more than the entropy
            (in nats) of the best beam's next-token distribution are dropped:
            a nearly sure step leaves no room for rivals, an unsure one keeps them.
  g = 1     never collapses and never prunes: plain beam search.

Scores are summed log-probabilities with no length normalisation, so scores only
go down, and the search can stop as soon as a finished answer scores at least as
well as every live beam.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgemm.generate import Generation, GenerationOptions, Generator


@dataclass
class Beams:
    """The live beams: token lists and summed log-probabilities, one per decoder row."""
    tokens: list[list[int]]
    scores: np.ndarray  # float64 [rows]
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # ended by a stop token

    def best_finished(self) -> tuple[float, list[int]] | None:
        return max(self.finished, key=lambda f: f[0]) if self.finished else None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def entropy(logp: np.ndarray) -> float:
    return float(-(np.exp(logp) * logp).sum())


def expand(beams: Beams, logp: np.ndarray, width: int, stop_ids: set[int],
           prune: bool) -> tuple[Beams, np.ndarray]:
    """One beam step: (surviving beams, row of the parent each came from)."""
    candidates = (beams.scores[:, None] + logp).ravel()
    order = np.argsort(-candidates, kind="stable")[:2 * width]  # enough to refill after stops
    vocab = logp.shape[1]
    tokens, scores, parents = [], [], []
    finished = list(beams.finished)
    for rank, flat in enumerate(order):
        parent, token = divmod(int(flat), vocab)
        if token in stop_ids:
            if rank < width:  # a stop only counts if it would have been one of the beams
                finished.append((float(candidates[flat]), beams.tokens[parent]))
            continue
        tokens.append(beams.tokens[parent] + [token])
        scores.append(float(candidates[flat]))
        parents.append(parent)
        if len(tokens) == width:
            break
    scores_arr = np.asarray(scores, np.float64)
    if prune and len(scores):
        margin = entropy(logp[int(np.argmax(beams.scores))])
        keep = scores_arr >= scores_arr.max() - margin
        tokens = [t for t, k in zip(tokens, keep) if k]
        scores_arr, parents = scores_arr[keep], [p for p, k in zip(parents, keep) if k]
    return Beams(tokens, scores_arr, finished), np.asarray(parents, np.intp)


def beam_search(gen: Generator, features: np.ndarray, input_ids: np.ndarray, image_start: int | np.ndarray,
                budget: int, options: GenerationOptions,
                on_token: Callable[[int], None] | None = None) -> Generation:
    """Decode up to `budget` tokens with options.num_beams beams, gated by options.beam_gate."""
    width, gate = options.num_beams, options.beam_gate
    t0 = time.perf_counter()
    embeds = gen.embed_prompt(input_ids, features, image_start)
    mask = np.ones((1, input_ids.shape[1]), np.int64)
    logits, past = gen.step(embeds, mask, gen.empty_past(1))
    t_prefill = time.perf_counter()

    beams = Beams([[]], np.zeros(1))
    stats = {"beam_steps": 0, "decoder_rows": 0, "collapsed_at": None}
    while True:
        done = beams.best_finished()
        if not beams.tokens or (done is not None and done[0] >= beams.scores.max()):
            return _result(done[1] if done else [], "stop", t0, t_prefill, stats, on_token)
        logp = log_softmax(logits)
        best = int(np.argmax(beams.scores))
        if gate < 1 and np.exp(logp[best].max()) >= gate:
            stats["collapsed_at"] = len(beams.tokens[best])
            return _greedy_from(gen, beams.tokens[best], logits[best:best + 1],
                                {name: v[best:best + 1] for name, v in past.items()},
                                mask[:1], budget, t0, t_prefill, stats, on_token)
        beams, parents = expand(beams, logp, width, gen.stop_ids, prune=gate < 1)
        stats["beam_steps"] += 1
        if beams.tokens and len(beams.tokens[0]) >= budget:  # every live beam has the same length
            return _at_length(beams, t0, t_prefill, stats, on_token)
        if not beams.tokens:
            continue  # all continuations stopped: the best finished answer wins above
        new = gen.embed_next([t[-1] for t in beams.tokens])
        past = {name: v[parents] for name, v in past.items()}
        mask = np.ones((len(new), mask.shape[1] + 1), np.int64)
        logits, past = gen.step(new, mask, past)
        stats["decoder_rows"] += len(new)


def _greedy_from(gen: Generator, tokens: list[int], logits: np.ndarray, past: dict,
                 mask: np.ndarray, budget: int, t0: float, t_prefill: float, stats: dict,
                 on_token: Callable[[int], None] | None) -> Generation:
    """Finish one beam greedily, exactly as Generator.generate does at temperature 0."""
    tokens = list(tokens)
    if on_token is not None:
        for token in tokens:  # the committed prefix, then each new token as it comes
            on_token(token)
    prompt_len = mask.shape[1] - len(tokens)
    full_mask = np.ones((1, prompt_len + budget), np.int64)  # no padding: positions are length - 1
    while len(tokens) < budget:
        token = int(np.argmax(logits[0]))
        if token in gen.stop_ids:
            return _timed(Generation(tokens, "stop"), t0, t_prefill, stats)
        tokens.append(token)
        if on_token is not None:
            on_token(token)
        if len(tokens) >= budget:
            break
        new = gen.embed_next([token])
        length = prompt_len + len(tokens)
        logits, past = gen.step(new, full_mask[:, :length], past,
                                np.array([[length - 1]], np.int64))
        stats["decoder_rows"] += 1
    return _timed(Generation(tokens, "length"), t0, t_prefill, stats)


def _at_length(beams: Beams, t0: float, t_prefill: float, stats: dict,
               on_token: Callable[[int], None] | None) -> Generation:
    """The budget is spent: the best of the finished answers and the live beams."""
    best = int(np.argmax(beams.scores))
    done = beams.best_finished()
    if done is not None and done[0] >= beams.scores[best]:
        return _result(done[1], "stop", t0, t_prefill, stats, on_token)
    return _result(beams.tokens[best], "length", t0, t_prefill, stats, on_token)


def _result(tokens: list[int], finish: str, t0: float, t_prefill: float, stats: dict,
            on_token: Callable[[int], None] | None) -> Generation:
    if on_token is not None:  # nothing was committed before the search ended
        for token in tokens:
            on_token(token)
    return _timed(Generation(list(tokens), finish), t0, t_prefill, stats)


def _timed(generation: Generation, t0: float, t_prefill: float, stats: dict) -> Generation:
    generation.timings_ms = {"prefill": (t_prefill - t0) * 1e3,
                             "decode": (time.perf_counter() - t_prefill) * 1e3}
    generation.stats = dict(stats)
    return generation
