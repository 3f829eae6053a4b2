"""Decoding several requests together: one decoder call per step for all of them.

    prefill    prompts of one length together; a request with a stored prefix alone
    merge      left-pad every KV cache to the longest, mask the padding out
    step       one token for every live row in one decoder call; rows that stop leave

A single-token decoder call is mostly fixed cost (kernel launches, Python, the graph
walk), so stepping B requests at once costs far less than B calls. Row order, sampling
streams and stop rules are per request, so each row gives the tokens it would alone.
Beam search and the no-cache comparison mode are not batched (`Generator.generate`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgemm.errors import InputError
from edgemm.generate import Generation, GenerationOptions, Generator, PrefixReuse, sample_token


@dataclass
class BatchItem:
    features: np.ndarray  # [1,N,D]
    input_ids: np.ndarray  # [1,S]
    image_start: int | np.ndarray  # first placeholder, or all of them (Prompt.image_positions)
    options: GenerationOptions
    on_token: Callable[[int], None] | None = None
    reuse: PrefixReuse | None = None


@dataclass
class _Row:
    index: int  # position in the caller's list
    item: BatchItem
    length: int  # prompt tokens
    budget: int
    rng: np.random.Generator | None  # None when greedy
    prefill_ms: float
    reused: bool
    tokens: list[int] = field(default_factory=list)
    steps: int = 0


def batchable(options: GenerationOptions) -> bool:
    return options.num_beams == 1 and options.use_cache


def generate_batch(gen: Generator, items: list[BatchItem]) -> list[Generation | Exception]:
    """Generations for `items` in order; a request that fails gets its exception instead."""
    results: list[Generation | Exception | None] = [None] * len(items)
    rows, logits, pasts = _prefill(gen, items, results)
    if rows:
        order = sorted(range(len(rows)), key=lambda j: rows[j].index)  # the caller's order
        _decode_together(gen, [rows[j] for j in order], np.stack([logits[j] for j in order]),
                         [pasts[j] for j in order], results, len(items))
    return results  # type: ignore[return-value]


def _prefill(gen: Generator, items: list[BatchItem], results: list) -> tuple[list[_Row], list, list]:
    """Every item's prompt through the decoder. A stored prefix is reused item by item;
    the other prompts go through together, one decoder call per prompt length (the same
    question at the same tier has the same length), since a prefill of B short prompts
    costs less than B prefills where one call's fixed cost dominates."""
    rows, logits, pasts = [], [], []
    fresh: dict[int, list[tuple[int, np.ndarray, int, bytes | None]]] = {}  # length → (item, embeds, split, key)
    for i, item in enumerate(items):
        started = time.perf_counter()
        try:
            length = item.input_ids.shape[1]
            if length >= gen.max_context:
                raise InputError(f"prompt is {length} tokens (image included); the model's "
                                 f"context is {gen.max_context}")
            split, key = gen.prefix_key(item.features, item.input_ids, item.image_start, item.reuse)
            stored = gen.from_stored_prefix(item.input_ids, split, key, np.ones((1, length), np.int64), item.reuse)
            if stored is None:
                fresh.setdefault(length, []).append(
                    (i, gen.embed_prompt(item.input_ids, item.features, item.image_start), split, key))
                continue
        except Exception as e:  # this request fails; the others go on
            results[i] = e
            continue
        rows.append(_row(gen, i, item, started, reused=True))
        logits.append(stored[0][0])
        pasts.append(stored[1])
    for length, group in fresh.items():
        started = time.perf_counter()
        try:
            out, past = gen.step(np.concatenate([embeds for _, embeds, _, _ in group]),
                                 np.ones((len(group), length), np.int64), gen.empty_past(len(group)))
        except Exception as e:  # the shared call failed: so does each of its requests
            for i, *_ in group:
                results[i] = e
            continue
        for j, (i, _, split, key) in enumerate(group):
            own = {name: value[j:j + 1] for name, value in past.items()}
            gen.store_prefix(own, split, key, items[i].reuse)
            rows.append(_row(gen, i, items[i], started, reused=False))
            logits.append(out[j])
            pasts.append(own)
    return rows, logits, pasts


def _row(gen: Generator, i: int, item: BatchItem, started: float, reused: bool) -> _Row:
    length = item.input_ids.shape[1]
    return _Row(i, item, length, min(item.options.max_new_tokens, gen.max_context - length),
                np.random.default_rng(item.options.seed) if item.options.temperature > 0 else None,
                (time.perf_counter() - started) * 1e3, reused)


def _merge(gen: Generator, rows: list[_Row], pasts: list[dict]) -> tuple[dict, np.ndarray]:
    """One KV cache for all rows, left-padded to the longest prompt, and its attention mask."""
    longest = max(r.length for r in rows)
    past = {name: np.concatenate([np.pad(p[name], ((0, 0), (0, 0), (longest - r.length, 0), (0, 0)))
                                  for r, p in zip(rows, pasts)])
            for name in gen.past_names}
    mask = np.zeros((len(rows), longest), np.int64)
    for j, r in enumerate(rows):
        mask[j, longest - r.length:] = 1
    return past, mask


def _decode_together(gen: Generator, rows: list[_Row], logits: np.ndarray, pasts: list[dict],
                     results: list, batch: int) -> None:
    started = time.perf_counter()
    past, mask = _merge(gen, rows, pasts)

    def finish(row: _Row, reason: str) -> None:
        decode_ms = (time.perf_counter() - started) * 1e3
        results[row.index] = Generation(row.tokens, reason, {"prefill": row.prefill_ms, "decode": decode_ms},
                                        {"decoder_rows": row.steps, "prefix_reused": row.reused,
                                         "decode_batch": batch})

    while rows:
        live, next_tokens = [], []
        for j, row in enumerate(rows):
            token = sample_token(logits[j], row.item.options, row.rng)
            if token in gen.stop_ids:
                finish(row, "stop")
                continue
            row.tokens.append(token)
            try:
                if row.item.on_token is not None:
                    row.item.on_token(token)
            except Exception as e:  # e.g. a streaming client went away: only its row stops
                results[row.index] = e
                continue
            if len(row.tokens) >= row.budget:
                finish(row, "length")
                continue
            live.append(j)
            next_tokens.append(token)
        if not live:
            return
        if len(live) < len(rows):  # finished rows leave the batch
            keep = np.array(live)
            past = {name: value[keep] for name, value in past.items()}
            mask, rows = mask[keep], [rows[j] for j in live]
        new = gen.embed_next(next_tokens)
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], axis=1)
        # each row's own next position: its prompt plus the tokens it has so far, minus one
        positions = np.array([[r.length + len(r.tokens) - 1] for r in rows], np.int64)
        logits, past = gen.step(new, mask, past, positions)
        for r in rows:
            r.steps += 1
