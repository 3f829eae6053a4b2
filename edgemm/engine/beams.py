"""Confidence-gated beam search: beam-search answers at close to greedy cost.

This module holds the search's rules; the decode loop (edgemm/engine/decode.py) runs them:
a request's beams are a group of rows of its decoder batch. The prompt is prefilled
once, like any other (a stored image prefix is reused); each step runs every live
beam through the decoder with the batch's other rows, and the group's KV-cache rows
are reordered by the beam each survivor grew from.

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

from dataclasses import dataclass, field

import numpy as np


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
