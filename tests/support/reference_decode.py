"""Greedy decoding without the KV cache: every step runs the whole sequence again.

The slow, obvious reference that the decode loop (edgemm/engine/decode.py) is checked
against in tests and timed against in `bench.py runtime`. Not for serving.
"""
from __future__ import annotations

import numpy as np

from edgemm.engine.generate import Generator


def greedy_without_cache(gen: Generator, features: np.ndarray, input_ids: np.ndarray,
                         image_start: int | np.ndarray, max_new_tokens: int) -> tuple[list[int], str]:
    """(tokens, finish reason) of greedy decoding, recomputing the prefix at every step."""
    embeds = gen.embed_prompt(input_ids, features, image_start)
    budget = min(max_new_tokens, gen.max_context - input_ids.shape[1])
    tokens: list[int] = []
    while True:
        logits, _ = gen.step(embeds, np.ones((1, embeds.shape[1]), np.int64), gen.empty_past(1))
        token = int(logits[0].argmax())
        if token in gen.stop_ids:
            return tokens, "stop"
        tokens.append(token)
        if len(tokens) >= budget:
            return tokens, "length"
        embeds = np.concatenate([embeds, gen.embed_next([token])], axis=1)
