"""Decoding several requests together: one decoder call per step for all of them.

    join       prompts of one length prefilled together (a request with a stored prefix
               alone), then merged into the running batch: every KV cache left-padded
               to the longest, the padding masked out
    step       one token for every live row in one decoder call; rows that stop leave
               at once (their answer is handed over), and padding no live row needs is cut

Rows join and leave between steps (continuous batching): a short answer never waits
for a long one, and a request that arrives while others decode starts at the next
step instead of after the whole batch. A single-token decoder call is mostly fixed
cost (kernel launches, Python, the graph walk), so stepping B requests at once costs
far less than B calls. Row order, sampling streams and stop rules are per request, so
each row gives the tokens it would alone. Beam search and the no-cache comparison
mode are not batched (`Generator.generate`).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgemm.errors import InputError
from edgemm.generate import Generation, GenerationOptions, Generator, PrefixReuse, sample_token

Finished = Callable[[Any, "Generation | Exception"], None]  # (the caller's key, its outcome)


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
    key: Any  # the caller's handle for this request
    item: BatchItem
    length: int  # prompt tokens
    budget: int
    rng: np.random.Generator | None  # None when greedy
    prefill_ms: float
    reused: bool
    joined: float = 0.0  # perf_counter when it entered the batch: its decode time starts
    peers: int = 1  # most rows it was in a batch with (itself included)
    tokens: list[int] = field(default_factory=list)
    steps: int = 0


def batchable(options: GenerationOptions) -> bool:
    return options.num_beams == 1 and options.use_cache


class DecodingBatch:
    """Requests decoding together on one generator; they join and leave between steps.

    `finished(key, outcome)` is called for each request once, as soon as its row stops
    (a Generation) or fails (the exception), from the thread that calls join/step.
    """

    def __init__(self, gen: Generator, finished: Finished):
        self.gen, self.finished = gen, finished
        self.rows: list[_Row] = []
        self.logits = np.zeros((0, 0), np.float32)  # [B, V]: each row's next-token logits
        # the decoder's feeds between steps: the KV cache ([B, heads, T, head_dim] per layer,
        # left-padded) and the graph's optional inputs; each step takes the new cache in place
        self.feeds: dict[str, np.ndarray] = {}
        self.mask = np.zeros((0, 0), gen.mask_dtype)  # [B, T]: 0 over each row's padding
        self.steps_by_rows: Counter = Counter()  # rows stepped together → decoder calls

    def __len__(self) -> int:
        return len(self.rows)

    def progress(self) -> list[tuple[int, int]]:
        """(tokens so far, token budget) of each row."""
        return [(len(r.tokens), r.budget) for r in self.rows]

    def join(self, items: list[tuple[Any, BatchItem]]) -> None:
        """Prefill `items` and add them to the batch; a request that fails here is finished
        with its exception and the others go on."""
        rows, logits, pasts = _prefill(self.gen, items, self.finished)
        if not rows:
            return
        order = {id(key): n for n, (key, _) in enumerate(items)}  # the caller's order (keys need not hash)
        ranked = sorted(range(len(rows)), key=lambda j: order[id(rows[j].key)])
        rows, logits, pasts = [rows[j] for j in ranked], [logits[j] for j in ranked], [pasts[j] for j in ranked]
        now = time.perf_counter()
        for r in rows:
            r.joined = now
        self._merge(rows, np.stack(logits), pasts)
        for r in self.rows:
            r.peers = max(r.peers, len(self.rows))

    def step(self) -> None:
        """A token for every row; rows that stop (or whose token callback fails) leave;
        one decoder call gives the others their next logits."""
        live, next_tokens = [], []
        for j, row in enumerate(self.rows):
            token = sample_token(self.logits[j], row.item.options, row.rng)
            if token in self.gen.stop_ids:
                self._finish(row, "stop")
                continue
            row.tokens.append(token)
            try:
                if row.item.on_token is not None:
                    row.item.on_token(token)
            except Exception as e:  # e.g. a streaming client went away: only its row stops
                self.finished(row.key, e)
                continue
            if len(row.tokens) >= row.budget:
                self._finish(row, "length")
                continue
            live.append(j)
            next_tokens.append(token)
        if len(live) < len(self.rows):
            self._keep(live)
        if not self.rows:
            return
        rows = self.rows
        gen = self.gen
        self.mask = np.concatenate([self.mask, np.ones((len(rows), 1), self.mask.dtype)], axis=1)
        # each row's own next position: its prompt plus the tokens it has so far, minus one
        positions = np.array([[r.length + len(r.tokens) - 1] for r in rows], gen.position_dtype)
        try:
            self.logits = gen.step_in_place(self.feeds, gen.embed_next(next_tokens), self.mask, positions)
        except Exception as e:  # the shared call failed: so does every row in it
            for r in rows:
                self.finished(r.key, e)
            self._keep([])
            return
        self.steps_by_rows[len(rows)] += 1
        for r in rows:
            r.steps += 1

    def _finish(self, row: _Row, reason: str) -> None:
        decode_ms = (time.perf_counter() - row.joined) * 1e3
        self.finished(row.key, Generation(row.tokens, reason, {"prefill": row.prefill_ms, "decode": decode_ms},
                                          {"decoder_rows": row.steps, "prefix_reused": row.reused,
                                           "decode_batch": row.peers}))

    def _keep(self, live: list[int]) -> None:
        """Only rows `live` stay. Columns that are padding for every row left are cut, so
        that a batch joined again and again never grows past its longest live row."""
        if not live:
            self.rows, self.feeds, self.mask = [], {}, self.mask[:0, :0]
            self.logits = self.logits[:0]
            return
        keep = np.array(live)
        mask = self.mask[keep]
        start = int(mask.any(axis=0).argmax())  # the first column some row uses
        self.mask = mask[:, start:]
        for name in self.gen.past_names:
            self.feeds[name] = self.feeds[name][keep, :, start:]
        self.logits = self.logits[keep]
        self.rows = [self.rows[j] for j in live]

    def _merge(self, rows: list[_Row], logits: np.ndarray, pasts: list[dict]) -> None:
        """New rows into the batch: one cache per layer for all rows, each row's left-padded
        with zeros to the longest, and the mask that hides the padding."""
        old_width = self.mask.shape[1]
        width = max([old_width] + [r.length for r in rows])

        def stacked(name: str) -> np.ndarray:
            parts = ([(self.feeds[name], old_width)] if self.rows else []) + \
                [(past[name], r.length) for r, past in zip(rows, pasts)]
            if len(parts) == 1 and parts[0][1] == width:
                return parts[0][0]  # a lone part needs no copy
            first = parts[0][0]
            out = np.zeros((sum(len(kv) for kv, _ in parts), first.shape[1], width, first.shape[3]), first.dtype)
            at = 0
            for kv, length in parts:
                out[at:at + len(kv), :, width - length:] = kv
                at += len(kv)
            return out

        self.feeds = self.gen.step_feeds({name: stacked(name) for name in self.gen.past_names})
        mask = np.zeros((len(self.rows) + len(rows), width), self.gen.mask_dtype)
        mask[:len(self.rows), width - old_width:] = self.mask
        for j, r in enumerate(rows, start=len(self.rows)):
            mask[j, width - r.length:] = 1
        self.mask = mask
        self.logits = np.concatenate([self.logits, logits]) if self.rows else logits
        self.rows = self.rows + rows


def generate_batch(gen: Generator, items: list[BatchItem]) -> list[Generation | Exception]:
    """Generations for `items` in order, decoded together; a request that fails gets its
    exception instead."""
    results: list[Generation | Exception | None] = [None] * len(items)
    batch = DecodingBatch(gen, results.__setitem__)
    batch.join(list(enumerate(items)))
    while batch:
        batch.step()
    return results  # type: ignore[return-value]


def _prefill(gen: Generator, items: list[tuple[Any, BatchItem]],
             failed: Finished) -> tuple[list[_Row], list, list]:
    """Every item's prompt through the decoder. A stored prefix is reused item by item;
    the other prompts go through together, one decoder call per prompt length (the same
    question at the same tier has the same length), since a prefill of B short prompts
    costs less than B prefills where one call's fixed cost dominates."""
    rows, logits, pasts = [], [], []
    fresh: dict[int, list[tuple[Any, BatchItem, np.ndarray, int, bytes | None]]] = {}  # length → prompts
    for key, item in items:
        started = time.perf_counter()
        try:
            length = item.input_ids.shape[1]
            if length >= gen.max_context:
                raise InputError(f"prompt is {length} tokens (image included); the model's "
                                 f"context is {gen.max_context}")
            split, prefix = gen.prefix_key(item.features, item.input_ids, item.image_start, item.reuse)
            stored = gen.from_stored_prefix(item.input_ids, split, prefix, np.ones((1, length), np.int64), item.reuse)
            if stored is None:
                fresh.setdefault(length, []).append(
                    (key, item, gen.embed_prompt(item.input_ids, item.features, item.image_start), split, prefix))
                continue
        except Exception as e:  # this request fails; the others go on
            failed(key, e)
            continue
        rows.append(_row(gen, key, item, started, reused=True))
        logits.append(stored[0][0])
        pasts.append(stored[1])
    for length, group in fresh.items():
        started = time.perf_counter()
        try:
            out, past = gen.step(np.concatenate([embeds for _, _, embeds, _, _ in group]),
                                 np.ones((len(group), length), np.int64), gen.empty_past(len(group)))
        except Exception as e:  # the shared call failed: so does each of its requests
            for key, *_ in group:
                failed(key, e)
            continue
        for j, (key, item, _, split, prefix) in enumerate(group):
            own = {name: value[j:j + 1] for name, value in past.items()}
            gen.store_prefix(own, split, prefix, item.reuse)
            rows.append(_row(gen, key, item, started, reused=False))
            logits.append(out[j])
            pasts.append(own)
    return rows, logits, pasts


def _row(gen: Generator, key: Any, item: BatchItem, started: float, reused: bool) -> _Row:
    length = item.input_ids.shape[1]
    return _Row(key, item, length, min(item.options.max_new_tokens, gen.max_context - length),
                np.random.default_rng(item.options.seed) if item.options.temperature > 0 else None,
                (time.perf_counter() - started) * 1e3, reused)
