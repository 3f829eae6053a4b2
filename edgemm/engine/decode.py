"""The decode loop: every generated token comes from DecodingBatch.step.

    join    prompts of one length prefilled together (a request with a stored prefix
            alone), then merged into the running batch: every KV cache left-padded to
            the longest, the padding masked out
    step    for each answer, its next token(s) from its rows' logits, then one decoder
            call for every row of every live answer; answers that end leave at once
            (their Generation is handed over) and padding no live row needs is cut

A single request is a batch of one (`generate`). The strategies are branches of one
step, not copies of the loop:

    greedy      argmax of the row's logits
    sampled     temperature + top-p from the request's own seeded generator
    beams       a group of rows (edgemm/engine/beams.py for the search rules): each step
                reorders the group's rows by the beam each survivor grew from, and once
                the gate collapses the search the best row goes on greedily

Rows join and leave between steps (continuous batching): a short answer never waits
for a long one. A single-token decoder call is mostly fixed cost, so stepping B rows
at once costs far less than B calls. Row order, sampling streams and stop rules are
per answer, so each answer gets the tokens it would alone.

Failure is per answer wherever it can be: non-finite logits, a sampling error, a token
the embedding cannot take, a token callback that raises, or a cancelled request fail
that answer alone, and its rows leave. Only a decoder call that fails fails every
answer in it. Each answer's outcome goes to `finished(key, Generation | Exception)`
exactly once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

import numpy as np

from edgemm.engine.beams import Beams, expand, log_softmax
from edgemm.engine.errors import DecodeFailure
from edgemm.errors import Cancelled, InputError
from edgemm.engine.generate import Generation, GenerationOptions, Generator, PrefixReuse, sample_token
from edgemm.engine.positions import family_positions, padded_rows, prompt_positions, shared_table, unpadded_mask

log = logging.getLogger("edgemm")

Finished = Callable[[Any, "Generation | Exception"], None]  # (the caller's key, its outcome)

# an empty batch's arrays, shared: a batch is opened for every request, and each numpy call
# right after a decoder call runs on cold caches
_EMPTY_2D = np.zeros((0, 0), np.float32)
_EMPTY_2D.flags.writeable = False
SPARE_COLUMNS = 32  # mask and position columns made ahead, so that most steps only take a view


@dataclass
class BatchItem:
    features: np.ndarray  # [1,N,D]
    input_ids: np.ndarray  # [1,S]
    image_start: int | np.ndarray | slice  # first placeholder, all of them, or their run (Prompt.image_span)
    options: GenerationOptions
    on_token: Callable[[int], None] | None = None  # each committed token id, as it comes
    reuse: PrefixReuse | None = None
    cancelled: threading.Event | None = None  # set by the caller: the answer stops at the next step
    # the family's positions (M-RoPE, Prompt.position_ids): the prompt's [axes, 1, S], and what
    # each decode step adds to the tokens the row holds; None: 0 … S-1, as the contract says
    positions: np.ndarray | None = None
    rope_delta: int = 0


@dataclass(slots=True)
class Answer:
    """One request in the batch; it holds `width` consecutive decoder rows. What each step
    reads is an attribute of its own (slots: the step runs on the caches a decoder call left
    cold, and each object it touches costs)."""
    key: Any  # the caller's handle for this request
    item: BatchItem
    length: int  # prompt tokens
    budget: int
    rng: np.random.Generator | None  # sampling only
    prefill_ms: float
    reused: bool
    cancelled: threading.Event | None  # the item's
    on_token: Callable[[int], None] | None  # the item's
    joined: float = 0.0  # perf_counter when it entered the batch: its decode time starts
    peers: int = 1  # most answers it was in a batch with (itself included)
    tokens: list[int] = field(default_factory=list)  # committed (beams: the best, once collapsed)
    width: int = 1  # decoder rows it holds
    rows_stepped: int = 0  # decoder rows it was given after the prefill, summed over steps
    beams: Beams | None = None  # a beam search not yet collapsed
    beam_steps: int = 0
    collapsed_at: int | None = None

    def generation(self, reason: str) -> Generation:
        """Its outcome as it ends; its token list goes with it (the answer leaves the batch)."""
        stats = {"decoder_rows": self.rows_stepped, "prefix_reused": self.reused, "decode_batch": self.peers}
        if self.item.options.num_beams > 1:
            stats.update(beam_steps=self.beam_steps, collapsed_at=self.collapsed_at)
        return Generation(self.tokens, reason, {"prefill": self.prefill_ms,
                                                "decode": (time.perf_counter() - self.joined) * 1e3}, stats)


class DecodingBatch:
    """Requests decoding together on one generator; they join and leave between steps.

    `finished(key, outcome)` is called for each request once, as soon as its answer ends
    (a Generation) or fails (the exception), from the thread that calls join/step, always
    through `_hand_over`: a subclass that puts answers in its own terms overrides `_ended`,
    which makes an ending answer's outcome, and `_hand_over` (edgemm/engine/answering.py's
    RequestBatch).
    """

    # the rows' state, an empty batch's as class attributes (a batch is opened for every
    # request): each row's cache is left-padded to `width` columns, row j's first
    # `_padding[j]` being padding (None: a lone row, which has none). From the padding come
    # the mask and the position table, both with spare columns, so that a step only takes
    # views (see _lay_out)
    rows = 0  # decoder rows in use: one per answer, a beam search's live beams
    width = 0
    logits = _EMPTY_2D  # [R, V]: each row's next-token logits
    _padding: np.ndarray | None = None
    _mask = _EMPTY_2D  # [R, capacity]: 0 over each row's padding, 1 after
    _positions = _EMPTY_2D  # [capacity, R, 1] ([capacity, axes, R, 1]): the position id of a token in each column
    _deltas: np.ndarray | None = None  # [R]: each row's rope delta (BatchItem.rope_delta); None: all 0
    _calls = 0  # decoder calls on the current rows, not yet in _steps_by_rows

    def __init__(self, gen: Generator, finished: Finished, steps_by_rows: Counter | None = None):
        """`steps_by_rows`: where to count decoder calls by rows stepped together (the
        caller's running tally). It is brought up to date whenever the rows change and
        before an answer is handed over, not at every step: a Counter's increment costs
        more than the rest of a step's bookkeeping for a row."""
        self.gen, self.finished = gen, finished
        self.stop_ids = gen.stop_ids
        self.answers: list[Answer] = []
        # the decoder's feeds between steps: the KV cache ([R, heads, T, head_dim] per layer,
        # left-padded) and the graph's optional inputs; each step takes the new cache in place
        self.feeds: dict[str, np.ndarray] = {}
        # the caller's Counter, or a plain dict of its own (a Counter costs more to make)
        self._steps_by_rows: dict[int, int] = {} if steps_by_rows is None else steps_by_rows

    def __len__(self) -> int:
        return len(self.answers)

    @property
    def steps_by_rows(self) -> Counter:
        """Rows stepped together → decoder calls, so far."""
        self._count_calls()
        tally = self._steps_by_rows
        return tally if isinstance(tally, Counter) else Counter(tally)

    def _count_calls(self) -> None:
        if self._calls:
            self._steps_by_rows[self.rows] = self._steps_by_rows.get(self.rows, 0) + self._calls
            self._calls = 0

    @property
    def mask(self) -> np.ndarray:
        """[R, T]: the attention mask of the rows' caches."""
        return self._mask[:, :self.width]

    def progress(self) -> list[tuple[int, int]]:
        """(tokens so far, token budget) of each answer."""
        return [(len(a.beams.tokens[0]) if a.beams is not None and a.beams.tokens else len(a.tokens), a.budget)
                for a in self.answers]

    # ---- joining -------------------------------------------------------------------------

    def join(self, items: list[tuple[Any, BatchItem]]) -> None:
        """Prefill `items` and add them to the batch; a request that fails here is finished
        with its exception and the others go on."""
        answers, logits, pasts = _prefill(self.gen, items, self._hand_over)
        if not answers:
            return
        if len(answers) > 1:  # back in the caller's order (prefill groups them by prompt length)
            order = {id(key): n for n, (key, _) in enumerate(items)}  # keys need not hash
            ranked = sorted(range(len(answers)), key=lambda j: order[id(answers[j].key)])
            answers, logits, pasts = ([answers[j] for j in ranked], [logits[j] for j in ranked],
                                      [pasts[j] for j in ranked])
        now = time.perf_counter()
        for a in answers:
            a.joined = now
            if a.item.options.num_beams > 1:
                a.beams = Beams([[]], np.zeros(1))
        self._merge(answers, logits[0] if len(logits) == 1 else np.concatenate(logits), pasts)
        if len(self.answers) > 1:  # (a lone answer's peers are itself)
            for a in self.answers:
                a.peers = max(a.peers, len(self.answers))

    # ---- the step ------------------------------------------------------------------------

    def step(self, until_end: bool = False) -> None:
        """Every answer's next token(s) from its rows' logits; answers that end or fail
        leave; one decoder call gives the rows that go on their next logits. With
        `until_end`, the step repeats until no answer is left (run_to_end): one call
        for the whole answer, not one per token, since each call made right after a
        decoder call runs on cold caches."""
        gen, stop_ids = self.gen, self.stop_ids
        while True:
            # the greedy token of every row in one pass; a row's logits are finite if its top
            # one is (argmax lands on a NaN or +inf; all -inf stays -inf). Few numpy calls and
            # few objects per step, for the same reason.
            logits = self.logits
            best = logits.argmax(1).tolist()
            top = logits.item
            outcomes: list = []  # each answer's: the token its one row is fed, or what _regroup handles
            regroup = False
            start = 0  # the answer's first row
            for a in self.answers:
                width = a.width
                try:
                    if a.cancelled is not None and a.cancelled.is_set():
                        raise Cancelled("cancelled: the client went away or the request timed out")
                    if not (isfinite(top(start, best[start])) if width == 1 else
                            all(isfinite(top(j, best[j])) for j in range(start, start + width))):
                        raise DecodeFailure("the decoder gave non-finite logits (NaN or inf) for this request")
                    # a beam search steps by its own rules (edgemm/engine/beams.py): its survivors, its end,
                    # or the offset of the row it collapses to, which then goes on greedily
                    offset = 0 if a.beams is None else self._next_beams(a, start)
                    if offset.__class__ is not int:
                        outcome = offset
                    else:  # the answer's next token: greedy, or sampled from its own generator
                        row = start + offset
                        token = best[row] if a.rng is None else sample_token(logits[row], a.item.options, a.rng)
                        if token in stop_ids:
                            outcome = self._ended(a, "stop")
                        else:
                            a.tokens.append(token)
                            if a.on_token is not None:
                                a.on_token(token)
                            if len(a.tokens) >= a.budget:
                                outcome = self._ended(a, "length")
                            else:  # it goes on: its one row fed this token, or (row offset, token)
                                outcome = token if width == 1 else [(offset, token)]
                except Exception as e:  # this answer fails alone; the others go on
                    outcome = e
                if outcome.__class__ is int:  # the common case: its one row goes on
                    a.rows_stepped += 1
                else:
                    regroup = True
                outcomes.append(outcome)
                start += width
            # in the common case every row goes on, fed its answer's token
            tokens = self._regroup(outcomes) if regroup else outcomes
            if not self.answers:
                return
            try:
                embeds = gen.embed_next(tokens)
            except Exception as e:
                embeds = self._embed_apart(tokens, e)
                if embeds is None:
                    return
            # one decoder call for every row; if it fails, so does every answer in it
            column = self.width  # the new tokens' column
            if column == self._mask.shape[1]:  # no spare column left
                self._lay_out(self._padding, column, spare=max(SPARE_COLUMNS, column))
            self.width = column + 1
            mask = self._mask[:, :column + 1]
            if self.rows > 1:  # a view of several rows is strided: the graph wants it packed
                mask = np.ascontiguousarray(mask)
            try:
                self.logits = gen.step_in_place(self.feeds, embeds, mask, self._positions[column])
            except Exception as e:
                self._fail_all(e)
                return
            self._calls += 1
            if not until_end:
                return

    def _regroup(self, outcomes: list) -> list[int]:
        """The step changed some answers' rows: those that ended or failed are handed over
        and leave, a beam search's rows are reordered. The token each row left is fed."""
        gather: list[int] = []  # the rows that go on, as indices into the current rows
        tokens: list[int] = []  # and the token each is fed
        kept: list[Answer] = []
        start = 0
        for a, outcome in zip(self.answers, outcomes):
            if outcome.__class__ is int:  # its one row goes on, fed this token
                gather.append(start)
                tokens.append(outcome)
                kept.append(a)
            elif isinstance(outcome, list):  # a beam search's rows: (offset, token) each
                gather.extend(start + offset for offset, _ in outcome)
                tokens.extend(token for _, token in outcome)
                kept.append(a)
            else:  # ended (a Generation) or failed (its exception)
                self._hand_over(a.key, outcome)
            start += a.width
            if isinstance(outcome, list):
                a.width = len(outcome)
                a.rows_stepped += a.width
        self._reindex(gather)
        self.answers = kept
        return tokens

    def run_to_end(self) -> None:
        """Step until every answer has ended (nobody joins meanwhile)."""
        if self.answers:
            self.step(until_end=True)

    def _next_beams(self, a: Answer, start: int) -> list[tuple[int, int]] | Generation | int:
        """A beam search's step (edgemm/engine/beams.py): its survivors, its end, or the offset of
        the row it collapses to (which then goes on greedily in `step`)."""
        beams, options = a.beams, a.item.options
        logits = self.logits[start:start + a.width]
        while True:  # at most twice: a step where every continuation stopped ends at the top
            done = beams.best_finished()
            if not beams.tokens or (done is not None and done[0] >= beams.scores.max()):
                return self._beams_end(a, done[1] if done else [], "stop")
            logp = log_softmax(logits)
            top = int(np.argmax(beams.scores))
            if options.beam_gate < 1 and np.exp(logp[top].max()) >= options.beam_gate:
                a.collapsed_at = len(beams.tokens[top])
                a.beams = None
                self._commit(a, beams.tokens[top])
                return top
            beams, parents = expand(beams, logp, options.num_beams, self.gen.stop_ids, prune=options.beam_gate < 1)
            a.beams = beams
            a.beam_steps += 1
            if beams.tokens and len(beams.tokens[0]) >= a.budget:  # every live beam has the same length
                top = int(np.argmax(beams.scores))
                done = beams.best_finished()
                if done is not None and done[0] >= beams.scores[top]:
                    return self._beams_end(a, done[1], "stop")
                return self._beams_end(a, beams.tokens[top], "length")
            if beams.tokens:
                return [(int(p), t[-1]) for p, t in zip(parents, beams.tokens)]

    def _beams_end(self, a: Answer, tokens: list[int], reason: str) -> Generation:
        self._commit(a, tokens)
        return self._ended(a, reason)

    def _ended(self, a: Answer, reason: str) -> Any:
        """What an answer that ends hands over: its Generation. A subclass that puts answers
        in its own terms builds them here, from the answer itself (RequestBatch). Raising
        fails this answer alone."""
        return a.generation(reason)

    def _commit(self, a: Answer, tokens: list[int]) -> None:
        """The search settled on `tokens`: they become the answer's, and go to its callback."""
        a.tokens = list(tokens)
        if a.on_token is not None:
            for token in a.tokens:
                a.on_token(token)

    def _embed_apart(self, tokens: list[int], error: Exception) -> np.ndarray | None:
        """The embedding failed on the rows' next tokens: the answers holding a token it
        refuses alone fail, and the others' tokens are embedded again. If no token is to
        blame (the call itself fails), every answer fails. None when no row is left."""
        bad = {t for t in set(tokens) if not _embeds(self.gen, t)}
        if not bad:
            self._fail_all(error)
            return None
        kept = self._drop({j for j, t in enumerate(tokens) if t in bad},
                          DecodeFailure(f"the embedding refused token {min(bad)}: {error}"))
        if not self.answers:
            return None
        try:  # every row of a failed answer left (a beam group whole), not only the refused one
            return self.gen.embed_next([tokens[j] for j in kept])
        except Exception as e:
            self._fail_all(e)
            return None

    def _hand_over(self, key: Any, outcome: Generation | Exception) -> None:
        """The caller's callback; its own failure must not stop the loop for the others."""
        if self._calls:  # (checked here: a call that does nothing still costs on cold caches)
            self._count_calls()
        try:
            self.finished(key, outcome)
        except Exception:
            log.exception("handing over a finished answer failed")

    def _fail_all(self, error: Exception) -> None:
        for a in self.answers:
            self._hand_over(a.key, error)
        self._reindex([])
        self.answers = []

    def _drop(self, rows: set[int], error: Exception) -> list[int]:
        """Fail the answers holding any of `rows` (indices into the current rows); the rows
        that stay, as indices into the rows before."""
        kept, gather, at = [], [], 0
        for a in self.answers:
            own = range(at, at + a.width)
            at += a.width
            if rows.intersection(own):
                self._hand_over(a.key, error)
            else:
                kept.append(a)
                gather.extend(own)
        self._reindex(gather)
        self.answers = kept
        return gather

    # ---- the rows' arrays ----------------------------------------------------------------

    def _reindex(self, gather: list[int]) -> None:
        """Only rows `gather` stay, in that order (a beam's row may be taken twice). Columns
        that are padding for every row left are cut, so that a batch joined again and
        again never grows past its longest live row."""
        if not gather:  # the batch is empty: nothing to copy (no numpy call on the hot path's cold caches)
            if self._calls:
                self._count_calls()
            self.feeds, self.rows, self.width, self._padding, self._deltas = {}, 0, 0, None, None
            self.logits = self._mask = self._positions = _EMPTY_2D
            return
        if self._deltas is not None:
            self._deltas = self._deltas[gather]
        if self._padding is None:  # a lone row, e.g. a beam search's first step
            start, padding = 0, np.zeros(len(gather), self.gen.position_dtype)
        else:
            padding = self._padding[gather]
            start = int(padding.min())  # the columns before are padding for every row left
        for name in self.gen.past_names:
            self.feeds[name] = self.feeds[name][gather, :, start:]
        self.logits = self.logits[gather]
        self._lay_out(padding - start if len(gather) > 1 else None, self.width - start)

    def _merge(self, answers: list[Answer], logits: np.ndarray, pasts: list[dict]) -> None:
        """New answers' rows into the batch: one cache per layer for all rows, each row's
        left-padded with zeros to the longest, and the mask that hides the padding."""
        old_width, old_rows = self.width, self.rows
        deltas = [a.item.rope_delta for a in answers]
        if any(deltas) or self._deltas is not None:
            old_deltas = self._deltas.tolist() if self._deltas is not None else [0] * old_rows
            self._deltas = np.array(old_deltas + deltas, self.gen.position_dtype)
        if not old_rows and len(answers) == 1:  # a lone request: its cache as the prefill left it
            self.feeds, self.logits, self.answers = self.gen.step_feeds(pasts[0]), logits, answers
            self._lay_out(None, answers[0].length)
            return
        width = max([old_width] + [a.length for a in answers])

        def stacked(name: str) -> np.ndarray:
            parts = ([(self.feeds[name], old_width)] if old_rows else []) + \
                [(past[name], a.length) for a, past in zip(answers, pasts)]
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
        old = [] if not old_rows else [0] if self._padding is None else self._padding.tolist()
        self._lay_out(np.array([p + width - old_width for p in old] + [width - a.length for a in answers],
                               self.gen.position_dtype), width)
        self.logits = np.concatenate([self.logits, logits]) if old_rows else logits
        self.answers = self.answers + answers

    def _lay_out(self, padding: np.ndarray | None, width: int, spare: int = SPARE_COLUMNS) -> None:
        """The mask and the position table of rows with `padding` [R] (None: one row without
        any), for `width` columns in use and `spare` more (edgemm/engine/positions.py)."""
        if self._calls:  # for the rows before
            self._count_calls()
        self.width, capacity = width, width + spare
        self._padding = padding
        if padding is None:  # the shared tables whole: their capacity is at least ours
            self.rows = 1
            self._mask = shared_table("ones", self.gen.mask_dtype, capacity)
            self._positions = shared_table("counting", self.gen.position_dtype, self._mask.shape[1])
        else:
            self.rows = len(padding)
            self._mask, self._positions = padded_rows(padding, capacity, self.gen.mask_dtype, self.gen.position_dtype)
        if self._deltas is not None or self.gen.position_axes:
            self._positions = family_positions(self._positions, self._deltas, self.gen.position_axes)


def _embeds(gen: Generator, token: int) -> bool:
    try:
        gen.embed_next([token])
        return True
    except Exception:
        return False


def generate(gen: Generator, item: BatchItem) -> Generation:
    """One request decoded alone: a batch of one. Raises what failed it."""
    outcome = generate_batch(gen, [item])[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def generate_batch(gen: Generator, items: list[BatchItem]) -> list[Generation | Exception]:
    """Generations for `items` in order, decoded together; a request that fails gets its
    exception instead."""
    results: list[Generation | Exception | None] = [None] * len(items)
    batch = DecodingBatch(gen, results.__setitem__)
    batch.join(list(enumerate(items)))
    batch.run_to_end()
    return results  # type: ignore[return-value]


def _prefill(gen: Generator, items: list[tuple[Any, BatchItem]],
             failed: Finished) -> tuple[list[Answer], list, list]:
    """Every item's prompt through the decoder. A stored prefix is reused item by item;
    the other prompts go through together, one decoder call per prompt length (the same
    question at the same tier has the same length), since a prefill of B short prompts
    costs less than B prefills where one call's fixed cost dominates. An item whose prefix
    an earlier item of these prefills (another question about the same image, asked with
    it) waits for it to be stored, then reuses it. Each answer comes with its logits [1, V]
    and its cache."""
    answers, logits, pasts = [], [], []
    fresh: dict[int, list[tuple[Any, BatchItem, np.ndarray, int, bytes | None, float]]] = {}  # length → prompts
    coming: set[bytes] = set()  # prefixes these fresh prefills store
    after: list[tuple[Any, BatchItem]] = []  # items waiting for one of them
    for key, item in items:
        started = time.perf_counter()
        try:
            if item.cancelled is not None and item.cancelled.is_set():
                raise Cancelled("cancelled before decoding: the client went away or the request timed out")
            length = item.input_ids.shape[1]
            if length >= gen.max_context:
                raise InputError(f"prompt is {length} tokens (image included); the model's "
                                 f"context is {gen.max_context}")
            split, prefix = gen.prefix_key(item.features, item.input_ids, item.image_start, item.reuse)
            stored = gen.from_stored_prefix(item.input_ids, split, prefix, item.reuse, item.positions)
            if stored is None:
                if prefix in coming:
                    after.append((key, item))
                    continue
                if prefix is not None:
                    coming.add(prefix)
                fresh.setdefault(length, []).append(
                    (key, item, gen.embed_prompt(item.input_ids, item.features, item.image_start), split, prefix,
                     started))
                continue
        except Exception as e:  # this request fails; the others go on
            failed(key, e)
            continue
        answers.append(_answer(gen, key, item, started, reused=True))
        logits.append(stored[0])
        pasts.append(stored[1])
    for group in fresh.values():
        _prefill_fresh(gen, group, failed, answers, logits, pasts)
    if after:  # their prefixes are stored now (unless a row broke or the store refused it)
        more = _prefill(gen, after, failed)
        for done, kept in zip((answers, logits, pasts), more):
            done.extend(kept)
    return answers, logits, pasts


def _prefill_fresh(gen: Generator, group: list, failed: Finished, answers: list, logits: list, pasts: list) -> None:
    """Prompts of one length through one decoder call, each prefix stored for the next question."""
    try:
        embeds = group[0][2] if len(group) == 1 else np.concatenate([embeds for _, _, embeds, *_ in group])
        length = embeds.shape[1]
        # no padding: every row's positions are 0 … length - 1 (no cumsum of the mask), or the family's
        positions = shared_table("counting", gen.position_dtype, length)[:length, 0, 0][None]
        if gen.position_axes:
            positions = prompt_positions(gen.position_axes, [item.positions for _, item, *_ in group], positions)
        elif len(group) > 1:
            positions = np.repeat(positions, len(group), axis=0)
        out, past = gen.step(embeds, unpadded_mask(len(group), length, gen.mask_dtype), gen.empty_past(len(group)),
                             positions)
        # rows whose logits are not finite, by the step's rule: argmax lands on a NaN or
        # +inf (ndarray.argmax is all C; max() goes through numpy's Python wrappers, which
        # cost tens of µs on the caches the decoder call left cold)
        broken = [j for j, top in enumerate(out.argmax(1).tolist()) if not isfinite(out.item(j, top))]
    except Exception as e:  # the shared call failed: so does each of its requests
        for key, *_ in group:
            failed(key, e)
        return
    for j, (key, item, _, split, prefix, started) in enumerate(group):
        own = past if len(group) == 1 else {name: value[j:j + 1] for name, value in past.items()}
        if j not in broken:  # a broken prefix must not be served to the next request
            try:
                gen.store_prefix(own, split, prefix, item.reuse)
            except Exception:  # the cache is an optimisation: the answer goes on without it
                log.exception("keeping a prompt prefix in the cache failed")
        answers.append(_answer(gen, key, item, started, reused=False))
        logits.append(out if len(group) == 1 else out[j:j + 1])
        pasts.append(own)


def _answer(gen: Generator, key: Any, item: BatchItem, started: float, reused: bool) -> Answer:
    length = item.input_ids.shape[1]
    return Answer(key, item, length, min(item.options.max_new_tokens, gen.max_context - length),
                   np.random.default_rng(item.options.seed) if item.options.temperature > 0 else None,
                   (time.perf_counter() - started) * 1e3, reused, item.cancelled, item.on_token)
