"""Staged pipeline: prepare → encode → decode, bounded queues between.

    requests ─► [prepare ×2] ─q─► [encode] ─q─► [decode] ─► future.set_result
                 decode image,      vision          prefill + KV-cache decode
                 tier, prompt       encoder         (the requests waiting, together)

Preparation runs on a small pool of threads (`prepare_workers`, 2 by default): decoding
an image is the one step whose cost the client chooses (a 40 MP PNG, a progressive
JPEG at its scan limit), and with one thread every request behind such an image would
wait for it. With two, an unrelated request is prepared meanwhile (OpenCV releases
the GIL while it decodes). Requests still reach the encoder in the order they came,
with one exception: a request whose preparation has run for more than
PREPARE_OVERTAKE_S (edgemm/engine/prepare_order.py) is overtaken by those prepared behind it, so a slow image holds
up others for at most that long. The encoder and the decoder stay one thread each.

While the decoder works on request n, the encoder already runs request n+1, so on
a Jetson the DLA (encoder) and the GPU (decoder) are busy at once; here two CPU
cores are. Every queue is bounded: when the pipeline is full, `submit` waits
(lossless sources) or refuses with `Overloaded` (the daemon answers 503).

One pipeline serves every producer of a process: the daemon's API and its camera
streams submit into the same one, so each backend component is only ever called from
one stage thread (a TensorRT execution context may be driven by one thread at a time).
`reserved` sizes the inbox for producers that bound themselves (each stream's share,
edgemm.streams.run): queue_size places for the API's Admission plus the streams' shares, so
neither can fill the other's part.

The encoder stage batches: it takes up to `max_batch` requests of the same tier
that are already waiting into one call, and waits up to `batch_timeout_ms` for more
only while other requests are still being prepared (a lone request never waits), not
counting a slow one already overtaken.
The decoder stage takes every request already waiting (up to `max_batch`) and steps
them together, one decoder call per token for all (edgemm/engine/decode.py); it never
waits for a batch to fill. Each answer is handed back the moment it ends; requests that
arrive while a batch decodes join it between steps when JoinPolicy says they should
(continuous batching, edgemm/engine/batching.py), else they start the next batch. Results come back through
`concurrent.futures.Future`s.

A request may carry followers: other questions about the same image (a stream's alerts).
They go where it goes without places of their own: prepared by its worker right after it
(Runtime.follow: at its tier they take its pixel values and cache key, so nothing about
the image is done again; at another tier they are prepared in full and go to the encoder
apart, right behind it), given its features by its encoder call, and handed to the decoder
with it, so that they join the same batch and their prefills reuse the image prefix its
prefill stored. Until the decoder takes them they share its fate: refused, they are
cancelled; failed or cancelled, they fail with it. From there each is its own request.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from edgemm.engine.answering import InferenceResult
from edgemm.engine.batching import JoinPolicy
from edgemm.errors import Cancelled, Overloaded, one_line
from edgemm.engine.prepare_order import PrepareOrder
from edgemm.engine.preparation import PreparedRequest
from edgemm.engine.runtime import Runtime

log = logging.getLogger(__name__)

_STOP = object()  # end-of-work marker passed down the stages
STAGES = ("prepare", "encode", "decode")
PREPARE_WORKERS = 2  # threads that prepare requests: one slow image holds up one of them


@dataclass
class Request:
    image: Any  # path, encoded bytes or RGB array
    prompt: str
    options: dict = field(default_factory=dict)  # tier, max_new_tokens, temperature, top_p, seed
    on_token: Callable[[int, str], None] | None = None  # (token id, the text it adds): for streamed answers
    cancelled: threading.Event = field(default_factory=threading.Event)  # set: the answer stops at its next step
    tag: Any = None  # caller's data, handed back untouched (e.g. the source Frame)
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    prepared: PreparedRequest | None = None
    features: np.ndarray | None = None
    marks: dict[str, float] = field(default_factory=dict)  # stage → perf_counter when it ended
    # other questions about the same image, riding with this request (submitted with it, they
    # take no place of the pipeline's: whoever attaches them bounds them): prepared with it,
    # sharing its pixels and features where their tier is its own, then decoded beside it
    followers: list["Request"] = field(default_factory=list)


@dataclass(frozen=True)
class Health:
    """Whether the pipeline still answers: every stage thread runs and none is stuck."""
    ok: bool
    reason: str | None = None  # one line, when not ok

    def to_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason}


@dataclass
class Work:
    """What a stage's crash barrier saw: the unexpected error of one iteration, if any."""
    failed: Exception | None = None


def mark_logged(error: BaseException) -> None:
    """Note that `error`'s traceback is in the log, so whoever reports it next logs it no more."""
    with contextlib.suppress(AttributeError, TypeError):  # a few built-in types take no attributes
        error.edgemm_logged = True  # type: ignore[attr-defined]


def was_logged(error: BaseException) -> bool:
    return bool(getattr(error, "edgemm_logged", False))


@dataclass
class StageStats:
    """Busy time per stage and the latest queue depths, for metrics and benchmarks."""
    busy_s: dict[str, float] = field(default_factory=lambda: {"prepare": 0.0, "encode": 0.0, "decode": 0.0})
    items: dict[str, int] = field(default_factory=lambda: {"prepare": 0, "encode": 0, "decode": 0})
    batches: list[int] = field(default_factory=list)  # encoder batch sizes (last 1000)
    batch_counts: dict[int, int] = field(default_factory=dict)  # batch size → encoder calls, ever
    decode_steps: Counter = field(default_factory=Counter)  # rows stepped together → decoder calls, ever
    completed: int = 0
    failed: int = 0
    rejected: int = 0

    def snapshot(self) -> dict:
        return {"busy_s": dict(self.busy_s), "items": dict(self.items), "completed": self.completed,
                "failed": self.failed, "rejected": self.rejected,
                "mean_batch": float(np.mean(self.batches)) if self.batches else 0.0}


class Pipeline:
    def __init__(self, runtime: Runtime, queue_size: int = 4, max_batch: int = 1,
                 batch_timeout_ms: float = 0.0, encoder_batch: dict[str, int] | None = None,
                 decoder_joins: str = "auto", reserved: int = 0, max_rows: int | None = None,
                 prepare_workers: int = PREPARE_WORKERS, clock: Callable[[], float] = time.monotonic):
        """`max_rows`: most decoder rows stepped together (a request takes one, a beam search
        num_beams; a TensorRT decoder's profile bounds them); None: no bound.
        `prepare_workers`: threads preparing requests (each holds at most one, plus the one
        it waits to hand to the encoder).
        `clock`: the clock of the PrepareOrder, by which a slow preparation is overtaken
        (a test passes one it moves by hand).
        `reserved`: inbox places beyond queue_size, for producers that each keep to a
        bounded share of their own (the daemon's streams): with the API admitted up to
        queue_size, the inbox then has room for everything in flight, so nobody's submit
        finds it full because of another producer."""
        self.runtime = runtime
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.joins = JoinPolicy(decoder_joins)  # do newcomers join a running decoder batch?
        self.encoder_batch = encoder_batch or {}  # tier → most images per encoder call (else max_batch)
        self.batch_timeout_s = batch_timeout_ms / 1e3
        self.inbox: queue.Queue = queue.Queue(queue_size + reserved)
        self.to_encode: queue.Queue = queue.Queue(queue_size)
        self.to_decode: queue.Queue = queue.Queue(queue_size)
        self.stats = StageStats()
        self._held: deque = deque()  # taken from to_encode but not batchable with the current tier
        self._held_decode: deque = deque()  # taken from to_decode, can't join the running batch: goes next
        self._following: deque = deque()  # followers of the request taken last from to_decode: they go next
        if prepare_workers < 1:
            raise ValueError(f"prepare_workers must be at least 1, got {prepare_workers}")
        self.prepare_workers = prepare_workers
        self._prepare_lock = threading.Lock()  # for the workers' end
        self._prepare_ended = 0  # prepare workers that saw the stop marker
        self._order = PrepareOrder(clock)  # each request taken from the inbox gets the next ticket
        self._take = threading.Lock()  # taking from the inbox and numbering it are one step
        self._accounting = threading.Lock()  # the prepare workers add to the same stats
        # worker → time.monotonic() of its last progress on the work it holds (None: idle or
        # waiting for room downstream); written by the worker's own thread, read by health().
        # The prepare workers are "prepare", "prepare#2", …; the other stages have one each.
        workers = [("prepare" if i == 0 else f"prepare#{i + 1}", self._prepare_loop)
                   for i in range(prepare_workers)]
        workers += [("encode", self._encode_loop), ("decode", self._decode_loop)]
        self._busy: dict[str, float | None] = dict.fromkeys(name for name, _ in workers)
        self._closed = False
        self._admission = threading.Lock()  # no request may slip in behind the stop marker
        self._stages = {name: threading.Thread(target=fn, args=(name,) if fn == self._prepare_loop else (),
                                               name=f"edgemm-{name.replace('#', '-')}", daemon=True)
                        for name, fn in workers}
        self._threads = list(self._stages.values())
        for t in self._threads:
            t.start()

    # ---- the public side --------------------------------------------------------------

    def submit(self, request: Request, block: bool = True, timeout: float | None = None) -> Future:
        """Queue a request. With block=False a full pipeline raises Overloaded at once."""
        with self._admission:
            try:
                if self._closed:
                    raise Overloaded("the pipeline is shutting down")
                try:
                    self.inbox.put(request, block=block, timeout=timeout)
                except queue.Full:
                    self.stats.rejected += 1
                    raise Overloaded(f"pipeline full ({self.inbox.maxsize} requests waiting); "
                                     "retry shortly") from None
            except BaseException:
                for follower in request.followers:  # never asked: their askers must hear so
                    follower.future.cancel()
                raise
        return request.future

    def infer(self, image, prompt: str, **options) -> InferenceResult:
        """Submit one request and wait for its answer."""
        return self.submit(Request(image, prompt, options)).result()

    def depths(self) -> dict[str, int]:
        return {"prepare": self.inbox.qsize(), "encode": self.to_encode.qsize() + len(self._held),
                "decode": self.to_decode.qsize() + len(self._held_decode) + len(self._following)}

    def alive(self) -> bool:
        """All stage threads running (a watchdog pings only while this holds)."""
        return all(t.is_alive() for t in self._threads) or self._closed

    def health(self, stall_s: float) -> Health:
        """Not ok when a stage thread is gone (its requests would never be answered) or a
        stage has made no progress for more than `stall_s` seconds on the work it holds (a
        model call that hangs). A stage waiting for work, or for room in the next stage's
        queue, is not stalled. Once close() was called the threads end on purpose."""
        if self._closed:
            return Health(True)
        for worker, thread in self._stages.items():
            if not thread.is_alive():
                return Health(False, f"{stage_of(worker)} stage thread died")
        now = time.monotonic()
        for worker in list(self._busy):
            since = self._busy[worker]  # read once: the worker's thread may clear it meanwhile
            if since is not None and now - since > stall_s:
                return Health(False, f"{stage_of(worker)} stage has held one item for {now - since:.0f} s "
                                     f"(server.stall_s {stall_s:g})")
        return Health(True)

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting; everything already submitted is finished before this returns
        (or `timeout` seconds in all have passed)."""
        with self._admission:
            if not self._closed:
                self._closed = True
                self.inbox.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the stages ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _working(self, worker: str, held: list) -> Iterator[Work]:
        """One iteration of a stage's loop, behind a crash barrier. The stage counts as busy
        from now (health's stall check). An unexpected error is logged once, with its
        traceback, and fails the requests in `held` not answered yet (the list may grow
        while the iteration runs); the stage then goes on with its next work. BaseException
        (SystemExit, KeyboardInterrupt) is not caught: that ends the thread, and health()
        says so. `worker`: the stage, or for the prepare pool the worker ("prepare#2")."""
        work = Work()
        self._busy[worker] = time.monotonic()
        try:
            yield work
        except Exception as e:
            work.failed = e
            victims = [r for r in held if isinstance(r, Request) and not r.future.done()]
            log.error("%s stage failed, failing %d request(s): %s: %s", stage_of(worker), len(victims),
                      type(e).__name__, one_line(str(e)), exc_info=e)
            mark_logged(e)
            for r in victims:
                self._fail(r, e)
        finally:
            self._busy[worker] = None

    def _progress(self, stage: str) -> None:
        """The stage made progress (a decoder step, a token): its stall clock starts again."""
        if self._busy[stage] is not None:
            self._busy[stage] = time.monotonic()

    def _prepare_loop(self, worker: str) -> None:
        while (taken := self._take_next()) is not None:
            req, ticket = taken
            ready = False
            try:
                with self._working(worker, [req]) as work:
                    ready = self._prepare(req)
                if ready and work.failed is None:
                    self._hand_on(req, ticket)  # outside the barrier: waiting for room is not a stall
            finally:
                self._order.done(ticket)
        # close() puts one stop marker: each worker passes it on to the next, and the last
        # one to stop (after every request prepared has gone to the encoder) to the encoder
        with self._prepare_lock:
            self._prepare_ended += 1
            last = self._prepare_ended == self.prepare_workers
        if last:
            self.to_encode.put(_STOP)
        else:
            self.inbox.put(_STOP)  # room: it was just taken, and nothing is admitted after it

    def _take_next(self) -> tuple[Request, int] | None:
        """The next request from the inbox with its ticket (None: the stop marker)."""
        with self._take:
            req = self.inbox.get()
            if req is _STOP:
                return None
            return req, self._order.ticket()

    def _hand_on(self, req: Request, ticket: int) -> None:
        """To the encoder's queue in its turn (PrepareOrder: a slow image is overtaken)."""
        with self._order.turn(ticket):
            # followers at a tier of their own are encoded apart, right behind it (split off before
            # the encoder holds it: from then on its followers are the encoder's to read)
            apart = [f for f in req.followers if f.prepared.pixel_values is not req.prepared.pixel_values]
            if apart:
                req.followers = [f for f in req.followers if f not in apart]
            self.to_encode.put(req)
            for follower in apart:
                self.to_encode.put(follower)

    def _coming(self) -> bool:
        """Will another request reach the encoder soon? One is if it waits in the inbox, or is
        being prepared and not yet overtaken (PrepareOrder.coming): no encoder batch waits
        for a slow image."""
        return self.inbox.qsize() > 0 or self._order.coming()

    def _prepare(self, req: Request) -> bool:
        """Decode the image, pick the tier, build the prompt; False if the request is done
        (cancelled, or failed alone)."""
        if not req.future.set_running_or_notify_cancel():  # cancelled while waiting (its client went away)
            self._fail_followers(req, Cancelled("the request it was asked with was cancelled"))
            return False
        if req.cancelled.is_set():  # its client went away or it timed out while queued
            self._fail(req, Cancelled("cancelled before it was prepared: the client went away or "
                                      "the request timed out"))
            return False
        started = time.perf_counter()
        try:
            req.prepared = self.runtime.prepare(req.image, req.prompt, **req.options)
        except Exception as e:  # a bad request fails alone (with its followers); the pipeline goes on
            self._fail(req, e)
            return False
        finally:
            self._account("prepare", started)
        req.marks["prepare"] = time.perf_counter()
        if req.followers:
            started = time.perf_counter()
            self._prepare_followers(req)
            self._account("prepare", started, 0)  # busy time; items count what came in through the inbox
        req.image = None  # the decoded pixels are all we need from here on
        return True

    def _prepare_followers(self, req: Request) -> None:
        """Each of `req`'s followers prepared from it; one that fails fails alone. Those at
        another tier than `req` are prepared in full and go to the encoder apart, right
        behind it (_hand_on)."""
        for follower in req.followers:
            if not follower.future.set_running_or_notify_cancel():
                continue  # its asker cancelled it
            try:
                follower.prepared = self.runtime.follow(req.prepared, follower.image, follower.prompt,
                                                        **follower.options)
                follower.image = None
            except Exception as e:
                self._fail(follower, e)
                continue
            follower.marks["prepare"] = time.perf_counter()
        req.followers = [f for f in req.followers if f.prepared is not None and not f.future.done()]

    def _encode_loop(self) -> None:
        while True:
            first = self._held.popleft() if self._held else self.to_encode.get()
            if first is _STOP:
                break
            batch: list[Request] = [first]  # grows in _gather: the barrier fails what it holds
            stop = False
            with self._working("encode", batch) as work:
                stop = self._gather(first, batch)
                encoded = self._encode(batch)
            if work.failed is None:
                for r in encoded:
                    self.to_decode.put(r)  # outside the barrier: waiting for room is not a stall
            if stop:
                break
        self.to_decode.put(_STOP)

    def _encode(self, batch: list[Request]) -> list[Request]:
        """One encoder call for `batch`; the requests that got their features. If a call on
        several images fails, each image is encoded alone, so that one bad image (or an
        engine that can't take the batch) fails only its own request; a lone image that
        fails fails its request."""
        started = time.perf_counter()
        done: list[Request] = []
        failed: Exception | None = None
        try:
            pixels = np.concatenate([r.prepared.pixel_values for r in batch])
            features = self.runtime.encode(pixels, [r.prepared.cache_key for r in batch], batch[0].prepared.route)
            for i, r in enumerate(batch):
                r.features = features[i:i + 1]
            done = batch
        except Exception as e:
            failed = e
            if len(batch) == 1:
                self._fail(batch[0], e)
        finally:
            size = len(done) or 1  # a failed call counts as one item, as it always has
            self._account("encode", started, size)
            self.stats.batches = self.stats.batches[-999:] + [size]
            self.stats.batch_counts[size] = self.stats.batch_counts.get(size, 0) + 1
        if failed is not None and len(batch) > 1:
            log.warning("an encoder call on %d images failed (%s: %s); encoding them one by one", len(batch),
                        type(failed).__name__, one_line(str(failed)))
            self._progress("encode")  # the failed call returned: the stall clock restarts for the retries
            return [r for one in batch for r in self._encode([one])]
        now = time.perf_counter()
        for r in done:
            r.prepared.timings_ms["encode"] = (now - started) * 1e3
            r.marks["encode"] = now
            for follower in r.followers:  # its image's features are theirs
                follower.features = r.features
                follower.prepared.timings_ms["encode"] = 0.0
                follower.marks["encode"] = now
        return done

    def _gather(self, first: Request, batch: list[Request]) -> bool:
        """Adds to `batch` ([first]) waiting requests of the same tier, up to max_batch (order
        kept); True if the end marker came. It waits for more (up to batch_timeout_ms) only
        while some are coming (_coming: not a slow image already overtaken). A request is in `batch` from the moment it is taken,
        so that the crash barrier holds it even if checking it fails."""
        deadline = time.perf_counter() + self.batch_timeout_s
        limit = self.encoder_batch.get(first.prepared.tier.name, self.max_batch)
        while len(batch) < limit and not self._held:
            wait = deadline - time.perf_counter() if self._coming() else 0.0
            try:
                nxt = self.to_encode.get(timeout=wait) if wait > 0 else self.to_encode.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP:
                return True
            batch.append(nxt)
            # one encoder batch needs one pixel shape: same tier (and, for tiled families, same
            # tiles), and one encoder: the same devices from the power policy
            if (nxt.prepared.tier.name != first.prepared.tier.name
                    or nxt.prepared.pixel_values.shape != first.prepared.pixel_values.shape
                    or self.runtime.resolve(nxt.prepared.route) != self.runtime.resolve(first.prepared.route)):
                batch.pop()
                self._held.append(nxt)  # keeps its place: it goes next
                break
        return False

    def _decode_loop(self) -> None:
        while True:
            first = self._held_decode.popleft() if self._held_decode else self._next_to_decode(block=True)
            if first is _STOP:
                break
            held: list[Request] = [first]  # the requests not answered yet: the barrier fails those
            with self._working("decode", held):
                self._decode(first, held)

    def _decode(self, first: Request, held: list[Request]) -> None:
        """`first` and the requests waiting behind it decode as one batch (edgemm/engine/decode.py),
        each answered as soon as its own answer ends. Between steps, requests that arrived
        meanwhile join while there is room (max_batch; 1 decodes one request at a time) and
        JoinPolicy agrees; an empty batch takes anyone. A waiting request that can't join
        (other devices) closes the batch to newcomers, so that it goes next. Every request
        taken is added to `held` and leaves it once answered (a batch that keeps taking
        newcomers can run for ever); each join and step counts as progress for the stall
        check, and as the stage's busy time."""
        devices = self.runtime.resolve(first.prepared.route)
        # a decoder whose rows depend on their batch mates (dynamic int8) decodes one request at a time
        most = self.max_batch if self.runtime.decodes_batched(first.prepared.route) else 1
        batch = self.runtime.open_batch(first.prepared.route, self._answer, self.stats.decode_steps)
        joining = [first] + self._joiners(devices, most - 1, self._rows_free(rows(first)), held)
        while joining or batch:
            if joining:
                started = time.perf_counter()
                batch.join([(r, r.prepared, r.features, r.on_token, r.cancelled) for r in joining])
                self.joins.prefilled(time.perf_counter() - started, len(joining))
                self._account("decode", started, len(joining))
                self._progress("decode")
                for r in joining:
                    r.features = None
            if batch:
                started = time.perf_counter()
                batch.step()
                self.joins.stepped(time.perf_counter() - started)
                self._account("decode", started, 0)
                self._progress("decode")
            held[:] = [r for r in held if not r.future.done()]
            room = most - len(batch)
            joining = self._joiners(devices, room, self._rows_free(batch.rows), held) \
                if room and self.joins.now(batch.progress()) else []

    def _next_to_decode(self, block: bool) -> Request:
        """The next request for the decoder: a follower of the one taken before, else the next
        from to_decode (queue.Empty if none and not `block`), whose followers then go next:
        they reach the decoder together, so they are stepped together."""
        if self._following:
            return self._following.popleft()
        nxt = self.to_decode.get(block=block)
        if nxt is not _STOP and nxt.followers:
            self._following.extend(nxt.followers)
            nxt.followers = []  # on their own from here
        return nxt

    def _rows_free(self, rows_used: int) -> int | None:
        return None if self.max_rows is None else self.max_rows - rows_used

    def _joiners(self, devices: tuple, room: int, rows_free: int | None, held: list[Request]) -> list[Request]:
        """Requests already waiting to be decoded that can join a batch on `devices`, up to
        `room` requests and `rows_free` decoder rows (None: any); never waits. One that
        can't join (other devices, too many rows, or the end marker) is held to go next.
        Each one taken is added to `held` first, so that the crash barrier holds it even if
        checking it fails."""
        out: list[Request] = []
        while len(out) < room and not self._held_decode:
            try:
                nxt = self._next_to_decode(block=False)
            except queue.Empty:
                break
            if nxt is _STOP:
                self._held_decode.append(nxt)
                break
            held.append(nxt)
            need = rows(nxt)
            if self.runtime.resolve(nxt.prepared.route) != devices or (rows_free is not None and need > rows_free):
                held.pop()
                self._held_decode.append(nxt)
                break
            out.append(nxt)
            if rows_free is not None:
                rows_free -= need
        return out

    def _answer(self, req: Request, outcome: InferenceResult | BaseException) -> None:
        """A request's outcome to its future (from the decode thread, as each answer ends)."""
        if isinstance(outcome, BaseException):
            self._fail(req, outcome)
            return
        try:
            self.joins.answered(len(outcome.tokens))
            outcome.timings_ms["total"] = (time.perf_counter() - req.submitted) * 1e3
            self.stats.completed += 1
        finally:  # whatever the bookkeeping does, the answer reaches its future
            if not req.future.done():
                req.future.set_result(outcome)

    def _fail(self, req: Request, error: BaseException) -> None:
        """`req` fails with `error`, and so do the followers still riding with it."""
        with self._accounting:  # from any stage's thread
            self.stats.failed += 1
        if not req.future.done():
            req.future.set_exception(error)
        self._fail_followers(req, error)

    def _fail_followers(self, req: Request, error: BaseException) -> None:
        followers, req.followers = req.followers, []
        for follower in followers:
            if not follower.future.done():
                self._fail(follower, error)

    def _account(self, stage: str, started: float, items: int = 1) -> None:
        with self._accounting:  # the prepare workers count into the same figures
            self.stats.busy_s[stage] += time.perf_counter() - started
            self.stats.items[stage] += items


def stage_of(worker: str) -> str:
    """The stage a worker belongs to: "prepare#2" → "prepare"."""
    return worker.split("#", 1)[0]


def rows(request: Request) -> int:
    """Decoder rows `request` takes in a batch: its beams, else one."""
    return max(1, request.prepared.options.num_beams)
