"""The staged pipeline: order, completeness, equality with Runtime.infer, failures that stay
local, encoder batching (same tier only), backpressure (Overloaded), the inbox places
reserved for producers with shares of their own, and close().

Timing is controlled by wrapping the runtime's stage methods with threading.Events the test
holds, never by sleeping. Nothing here depends on what the model answers, only on the
tokens agreeing with the unpipelined path.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgemm.errors import Cancelled, EdgemmError, InputError, Overloaded
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.engine.runtime import Runtime
from edgemm.model.scenes import make_scene

PROMPT = "how many shapes are there ?"
MAX_NEW = 4  # small answers keep every test fast
WAIT_S = 30  # upper bound for anything that should happen "now"; never a timing assumption
TIER_SIDE = {"low": 96, "high": 256}


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
    """Twelve different generated scenes (small, RGB), so features differ per request."""
    return [make_scene(100 + i, size=96).image for i in range(12)]


def options(tier: str) -> dict:
    return {"tier": tier, "max_new_tokens": MAX_NEW}


class BlockedEncode:
    """runtime.encode that records each batch's shape and holds the first call until released."""

    def __init__(self, runtime, block_first: bool = True):
        self.original = runtime.encode
        self.release = threading.Event()
        self.entered = threading.Event()
        self.shapes: list[tuple[int, ...]] = []
        if not block_first:
            self.release.set()

    def __call__(self, pixel_values: np.ndarray, keys=None, route=None) -> np.ndarray:
        self.shapes.append(tuple(pixel_values.shape))
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the encoder"
        return self.original(pixel_values, keys, route)


class RecordingDecode:
    """The decoder batches (runtime.open_batch: the decode stage opens one for every request) keeping the features each
    request was decoded with, and for every join into a batch: (rows already running, rows joining)."""

    def __init__(self, runtime):
        self.original_open = runtime.open_batch
        self.features: list[np.ndarray] = []
        self.calls = 0
        self.joins: list[tuple[int, int]] = []
        self.opened = 0

    def open_batch(self, route, finished, steps_by_rows=None):
        self.opened += 1
        batch = self.original_open(route, finished, steps_by_rows)
        join = batch.join

        def recording_join(requests):
            self.calls += len(requests)
            self.joins.append((len(batch), len(requests)))
            self.features.extend(np.array(features, copy=True) for _, _, features, *_ in requests)
            return join(requests)
        batch.join = recording_join
        return batch


@pytest.fixture
def blocked(runtime, monkeypatch):
    encode = BlockedEncode(runtime)
    monkeypatch.setattr(runtime, "encode", encode)
    yield encode
    encode.release.set()  # never leave a stage thread waiting, whatever the test did


@pytest.fixture
def recorded(runtime, monkeypatch):
    decode = RecordingDecode(runtime)
    monkeypatch.setattr(runtime, "open_batch", decode.open_batch)
    return decode


def wait_until(condition, what: str) -> None:
    """Poll a condition the pipeline must reach (a bound, not a timing assumption)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def track_completion(futures) -> list[int]:
    """The order in which the futures complete, as their submission indices."""
    order: list[int] = []
    lock = threading.Lock()
    for i, future in enumerate(futures):
        def done(_f, i=i):
            with lock:
                order.append(i)
        future.add_done_callback(done)
    return order


def expected(runtime, image, tier: str):
    return runtime.infer(image, PROMPT, **options(tier))


# ---- order, completeness, equality --------------------------------------------------------------

TIERS_12 = ["low", "high", "high", "low", "low", "low", "high", "low", "high", "high", "low", "high"]


def test_results_come_back_in_submission_order_and_complete(runtime, images):
    with Pipeline(runtime, queue_size=4, max_batch=4, batch_timeout_ms=5) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, options(tier), tag=i))
                   for i, tier in enumerate(TIERS_12)]
        order = track_completion(futures)
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert [r.tier for r in results] == TIERS_12
    assert [r.image_tokens for r in results] == [9 if t == "low" else 64 for t in TIERS_12]
    assert order == list(range(12))
    assert pipeline.stats.completed == 12 and pipeline.stats.failed == 0
    assert pipeline.stats.items == {"prepare": 12, "encode": 12, "decode": 12}
    assert all({"preprocess", "encode", "prefill", "decode", "total"} <= set(r.timings_ms) for r in results)


def test_answers_equal_runtime_infer(runtime, images):
    tiers = ["high", "low", "low", "high", "low", "high"]
    with Pipeline(runtime, queue_size=2) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, options(t))) for i, t in enumerate(tiers)]
        got = [f.result(timeout=WAIT_S) for f in futures]
    for i, (tier, result) in enumerate(zip(tiers, got)):
        want = expected(runtime, images[i], tier)
        assert (result.tokens, result.text, result.finish_reason, result.tier, result.prompt_tokens,
                result.image_tokens) == (want.tokens, want.text, want.finish_reason, want.tier,
                                         want.prompt_tokens, want.image_tokens), f"request {i}"


def test_infer_convenience(runtime, images):
    with Pipeline(runtime) as pipeline:
        result = pipeline.infer(images[0], PROMPT, **options("low"))
    assert result.tokens == expected(runtime, images[0], "low").tokens and result.tier == "low"


def test_a_bad_request_fails_only_its_own_future(runtime, images):
    with Pipeline(runtime, queue_size=2) as pipeline:
        good = pipeline.submit(Request(images[0], PROMPT, options("low")))
        bad = pipeline.submit(Request(b"not an image", PROMPT, options("low")))
        bad_tier = pipeline.submit(Request(images[1], PROMPT, {"tier": "no-such-tier"}))
        after = pipeline.submit(Request(images[2], PROMPT, options("low")))
        with pytest.raises(InputError):
            bad.result(timeout=WAIT_S)
        with pytest.raises(InputError):
            bad_tier.result(timeout=WAIT_S)
        assert good.result(timeout=WAIT_S).tokens == expected(runtime, images[0], "low").tokens
        assert after.result(timeout=WAIT_S).tokens == expected(runtime, images[2], "low").tokens
    assert pipeline.stats.failed == 2 and pipeline.stats.completed == 2


def test_an_encoder_failure_fails_its_batch_and_the_pipeline_goes_on(runtime, images, monkeypatch):
    original = runtime.encode
    calls = []

    def flaky(pixel_values, keys=None, route=None):
        calls.append(pixel_values.shape[0])
        if len(calls) == 1:
            raise RuntimeError("encoder fell over")
        return original(pixel_values, keys, route)

    monkeypatch.setattr(runtime, "encode", flaky)
    with Pipeline(runtime, queue_size=2) as pipeline:
        first = pipeline.submit(Request(images[0], PROMPT, options("low")))
        second = pipeline.submit(Request(images[1], PROMPT, options("low")))
        with pytest.raises(RuntimeError, match="encoder fell over"):
            first.result(timeout=WAIT_S)
        assert second.result(timeout=WAIT_S).tokens == expected(runtime, images[1], "low").tokens
    assert pipeline.stats.failed == 1 and pipeline.stats.completed == 1


# ---- encoder batching -----------------------------------------------------------------------------

def test_same_tier_requests_are_batched_and_answer_as_unbatched(runtime, images, blocked, recorded):
    n = 8
    with Pipeline(runtime, queue_size=n, max_batch=4, batch_timeout_ms=50) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, options("low")), block=False)
                   for i in range(n)]
        order = track_completion(futures)
        assert blocked.entered.wait(WAIT_S)
        wait_until(lambda: pipeline.stats.items["prepare"] == n, "all requests prepared")
        blocked.release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert max(pipeline.stats.batches) > 1, pipeline.stats.batches
    assert all(b <= 4 for b in pipeline.stats.batches)
    assert sum(pipeline.stats.batches) == n
    assert [s[0] for s in blocked.shapes] == pipeline.stats.batches
    assert order == list(range(n))
    for i, result in enumerate(results):
        alone = runtime.prepare(images[i], PROMPT, **options("low"))
        unbatched = blocked.original(alone.pixel_values)
        np.testing.assert_allclose(recorded.features[i], unbatched, rtol=1e-4, atol=1e-4,
                                   err_msg=f"request {i} decoded with another image's features")
        assert result.tokens == expected(runtime, images[i], "low").tokens, f"request {i}"
    assert pipeline.stats.snapshot()["mean_batch"] > 1


def test_a_tier_without_encoder_batching_encodes_one_image_per_call(runtime, images, blocked):
    """encoder_batch={"low": 1}: the same pile-up as above, but every encoder call has one
    image (batching did not pay there), while the answers are unchanged."""
    n = 6
    with Pipeline(runtime, queue_size=n, max_batch=4, batch_timeout_ms=50,
                  encoder_batch={"low": 1}) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, options("low")), block=False) for i in range(n)]
        assert blocked.entered.wait(WAIT_S)
        wait_until(lambda: pipeline.stats.items["prepare"] == n, "all requests prepared")
        blocked.release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert pipeline.stats.batches == [1] * n
    for i, result in enumerate(results):
        assert result.tokens == expected(runtime, images[i], "low").tokens


def test_encoder_batch_limits_follow_the_mode_and_the_timing(runtime, monkeypatch):
    from edgemm.engine.batching import encoder_batch_limits
    tiers = list(runtime.manifest.tiers)
    assert encoder_batch_limits(runtime, 4, "off") == dict.fromkeys(tiers, 1)
    assert encoder_batch_limits(runtime, 4, "on") == dict.fromkeys(tiers, 4)
    speedups = dict(zip(tiers, [0.8, 1.15, 1.6]))  # as timed on some device; 1.15 is within the noise margin
    monkeypatch.setattr(runtime, "encoder_batch_speedup", lambda tier, batch: speedups[tier])
    assert encoder_batch_limits(runtime, 4, "auto") == dict(zip(tiers, [1, 1, 4]))
    assert encoder_batch_limits(runtime, 1, "auto") == dict.fromkeys(tiers, 1)

    def too_big(tier, batch):  # as a TensorRT engine built for smaller batches answers
        if tier == tiers[-1]:
            raise RuntimeError("batch 4 exceeds the engine's optimisation profile")
        return 2.0
    monkeypatch.setattr(runtime, "encoder_batch_speedup", too_big)
    assert encoder_batch_limits(runtime, 4, "auto") == {**dict.fromkeys(tiers, 4), tiers[-1]: 1}


def test_encoder_batch_speedup_is_timed_on_the_real_encoder(runtime):
    calls_before = runtime.generator.encoder.stats.calls
    speedup = runtime.encoder_batch_speedup("low", 2, repeats=1)
    # a ratio of two timings: any positive figure (a loaded machine gave 14), never a bound here
    assert math.isfinite(speedup) and speedup > 0
    # the batch shape's first run, one pair, then one run that hands the arena's memory back
    assert runtime.generator.encoder.stats.calls - calls_before == 4
    assert runtime.generator.encoder.shrink_next is False


def test_a_lone_request_does_not_wait_for_a_batch(runtime, images):
    # a batch window of 20 s: only a request with others still being prepared may wait in it
    with Pipeline(runtime, queue_size=4, max_batch=4, batch_timeout_ms=20_000) as pipeline:
        for i in range(3):
            started = time.monotonic()
            pipeline.submit(Request(images[i], PROMPT, options("low"))).result(timeout=WAIT_S)
            assert time.monotonic() - started < 10, "a lone request sat in the batch window"
    assert pipeline.stats.batches == [1, 1, 1]


def hold_decoder(runtime, monkeypatch, recorded) -> tuple[threading.Event, threading.Event]:
    """The decode stage stops at its first decoding batch until released."""
    release, entered = threading.Event(), threading.Event()

    def held(call):
        def wrapper(*args, **kwargs):
            if not entered.is_set():
                entered.set()
                assert release.wait(WAIT_S), "the test never released the decoder"
            return call(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(runtime, "open_batch", held(recorded.open_batch))
    return release, entered


def test_waiting_requests_are_decoded_together_and_answer_as_alone(runtime, images, recorded, monkeypatch):
    """While the decoder is busy, finished encodes pile up; the next batch takes as many as
    fit (max_batch), the rest join it as its rows end, and each answer is the one it would
    get alone. Different answer lengths make rows leave at different steps."""
    release, entered = hold_decoder(runtime, monkeypatch, recorded)
    n = 7
    prompts = [PROMPT, "describe the image"] * 4
    budgets = [1, 6, 2, 4, 3, 5, 2]
    with Pipeline(runtime, queue_size=n, max_batch=4, batch_timeout_ms=0, decoder_joins="on") as pipeline:
        futures = [pipeline.submit(Request(images[i], prompts[i], {"tier": "low", "max_new_tokens": budgets[i]}),
                                   block=False) for i in range(n)]
        assert entered.wait(WAIT_S)
        wait_until(lambda: pipeline.depths()["decode"] == n - 1, "the other requests waiting to be decoded")
        release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert recorded.opened == 1, "the late requests started a batch of their own"
    assert recorded.joins[0] == (0, 4)  # the first request and the three that fit
    assert sum(k for _, k in recorded.joins) == n
    assert any(running > 0 for running, _ in recorded.joins[1:]), recorded.joins  # joined rows still decoding
    assert max(pipeline.stats.decode_steps) <= 4
    for i, result in enumerate(results):
        alone = runtime.infer(images[i], prompts[i], tier="low", max_new_tokens=budgets[i])
        assert result.tokens == alone.tokens, f"request {i}"
        assert 1 <= result.decode_batch <= 4


def test_without_joins_late_requests_wait_for_the_next_batch(runtime, images, recorded, monkeypatch):
    """decoder_joins="off" (server.continuous_batching: "off"): the same pile-up, but no request
    joins a batch that is decoding; answers are still the ones each gets alone."""
    release, entered = hold_decoder(runtime, monkeypatch, recorded)
    n = 7
    budgets = [1, 6, 2, 4, 3, 5, 2]
    with Pipeline(runtime, queue_size=n, max_batch=4, decoder_joins="off") as pipeline:
        futures = [pipeline.submit(Request(images[i], "describe the image", {"tier": "low", "max_new_tokens": budgets[i]}),
                                   block=False) for i in range(n)]
        assert entered.wait(WAIT_S)
        wait_until(lambda: pipeline.depths()["decode"] == n - 1, "the other requests waiting to be decoded")
        release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert recorded.joins[0] == (0, 4) and sum(k for _, k in recorded.joins) == n
    assert all(running == 0 for running, _ in recorded.joins), recorded.joins
    for i, result in enumerate(results):
        assert result.tokens == runtime.infer(images[i], "describe the image", tier="low",
                                              max_new_tokens=budgets[i]).tokens, f"request {i}"


def test_join_policy_weighs_the_rest_of_the_batch_against_the_prefills_it_would_wait_for():
    from edgemm.engine.batching import JoinPolicy
    policy = JoinPolicy("auto")
    rows = [(2, 32), (5, 32)]  # (tokens so far, budget) of two running rows
    assert policy.now(rows)  # nothing measured yet: join
    policy.prefilled(0.008, 2)  # 4 ms per request
    policy.stepped(0.001)
    policy.answered(7)
    # short answers (7 tokens): the rest of the batch is 5 steps = 5 ms < 2 rows × 4 ms of prefill
    assert not policy.now(rows)
    assert policy.now([])  # an empty batch is the next batch: anyone may start it
    for _ in range(60):
        policy.answered(40)  # answers grow longer: the rest is 30 steps (the budget) = 30 ms > 8 ms
    assert 39 < policy.answer_tokens < 40 and policy.now(rows)
    assert not policy.now([(2, 4), (3, 4)])  # budgets cap the rest: 2 steps
    for _ in range(60):
        policy.stepped(0.0001)  # a fast decoder step (a GPU): waiting costs little
    assert not policy.now(rows)
    assert JoinPolicy("on").now(rows) and not JoinPolicy("off").now(rows) and JoinPolicy("off").now([])
    with pytest.raises(ValueError, match="auto, on, off"):
        JoinPolicy("sometimes")


def test_a_short_answer_is_handed_back_before_its_batch_ends(runtime, images, recorded, monkeypatch):
    """Two requests decoded together: the one-token answer's future is done while the
    other is still generating."""
    release, entered = hold_decoder(runtime, monkeypatch, recorded)
    seen_done = []
    with Pipeline(runtime, queue_size=4, max_batch=4) as pipeline:
        short = pipeline.submit(Request(images[0], PROMPT, {"tier": "low", "max_new_tokens": 1}))
        long = pipeline.submit(Request(images[1], "describe the image", {"tier": "low", "max_new_tokens": 8},
                                       on_token=lambda _t, _text: seen_done.append(short.done())))
        assert entered.wait(WAIT_S)
        wait_until(lambda: pipeline.depths()["decode"] == 1, "the second request waiting to be decoded")
        release.set()
        long.result(timeout=WAIT_S)
    assert recorded.joins == [(0, 2)]
    assert len(seen_done) >= 3 and seen_done[-1], seen_done
    assert short.result().decode_batch == 2 and len(short.result().tokens) == 1


def test_beam_search_joins_a_batch_like_any_request(runtime, images, recorded, monkeypatch):
    """A beam search is a group of rows of the decoding batch: waiting behind the first
    request with a sampled and a greedy one, it is decoded together with them, and every
    answer is the one it gets alone."""
    release, entered = hold_decoder(runtime, monkeypatch, recorded)
    asks = [{"tier": "low", "max_new_tokens": 4}, {"tier": "low", "max_new_tokens": 4, "num_beams": 2},
            {"tier": "low", "max_new_tokens": 4, "temperature": 0.8, "seed": 11}]
    with Pipeline(runtime, queue_size=4, max_batch=4) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, asks[i]), block=False) for i in range(3)]
        assert entered.wait(WAIT_S)
        wait_until(lambda: pipeline.depths()["decode"] == 2, "two requests waiting to be decoded")
        release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert recorded.joins == [(0, 3)] and recorded.opened == 1
    for i, result in enumerate(results):
        assert result.tokens == runtime.infer(images[i], PROMPT, **asks[i]).tokens, f"request {i}"


def test_mixed_tiers_are_never_batched_together_and_keep_their_order(runtime, images, blocked, recorded):
    tiers = ["low", "low", "high", "high", "low", "high", "low", "low", "high"]
    with Pipeline(runtime, queue_size=len(tiers), max_batch=4, batch_timeout_ms=50) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, options(t)), block=False)
                   for i, t in enumerate(tiers)]
        order = track_completion(futures)
        assert blocked.entered.wait(WAIT_S)
        wait_until(lambda: pipeline.stats.items["prepare"] == len(tiers), "all requests prepared")
        blocked.release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    # every encoder call holds one image size, and in call order they replay the submissions
    assert all(len(s) == 4 for s in blocked.shapes)
    replayed = [s[2] for s in blocked.shapes for _ in range(s[0])]
    assert replayed == [TIER_SIDE[t] for t in tiers], blocked.shapes
    assert all(s[2] == s[3] for s in blocked.shapes)
    assert max(s[0] for s in blocked.shapes) > 1  # same-tier neighbours did batch
    assert order == list(range(len(tiers)))
    assert [r.tier for r in results] == tiers
    assert pipeline.stats.failed == 0
    for i, t in enumerate(tiers):
        assert results[i].tokens == expected(runtime, images[i], t).tokens, f"request {i}"


# ---- backpressure, close ----------------------------------------------------------------------------

def test_a_full_pipeline_refuses_with_overloaded(runtime, images, blocked):
    pipeline = Pipeline(runtime, queue_size=1)
    accepted = []
    try:
        with pytest.raises(Overloaded) as refused:
            for i in range(20):  # the stages hold a handful at most while the encoder is stuck
                accepted.append(pipeline.submit(Request(images[i % 12], PROMPT, options("low")),
                                                block=False))
        assert 1 <= len(accepted) <= 5
        assert refused.value.http_status == 503 and isinstance(refused.value, EdgemmError)
        assert pipeline.stats.rejected == 1
        assert not any(f.done() for f in accepted)  # all stuck behind the encoder, none lost
        with pytest.raises(Overloaded):  # a blocking submit with a timeout refuses too
            for i in range(20):
                accepted.append(pipeline.submit(Request(images[i % 12], PROMPT, options("low")),
                                                timeout=0.01))
        assert len(accepted) <= 5 and pipeline.stats.rejected == 2
    finally:
        blocked.release.set()
        pipeline.close()
    assert all(f.done() and f.exception() is None for f in accepted)
    assert pipeline.stats.completed == len(accepted)


def test_reserved_places_are_inbox_room_beyond_queue_size(runtime, images, blocked):
    """With every stage holding what it can (the encoder stuck), the inbox still takes
    queue_size + reserved requests without waiting, and refuses the next."""
    queue_size, reserved = 1, 3
    pipeline = Pipeline(runtime, queue_size=queue_size, reserved=reserved)
    accepted = []
    held = 2 + pipeline.prepare_workers
    try:
        for i in range(held):  # one in the encoder, one waiting for it, one prepared and waiting per prepare worker
            accepted.append(pipeline.submit(Request(images[i], PROMPT, options("low")), timeout=WAIT_S))
        # the inbox empty: the prepare workers, its only takers, hold the rest, one each
        wait_until(lambda: blocked.entered.is_set() and pipeline.to_encode.full() and pipeline.inbox.empty(),
                   "the stages to be full")
        for i in range(queue_size + reserved):
            accepted.append(pipeline.submit(Request(images[i], PROMPT, options("low")), block=False))
        with pytest.raises(Overloaded):
            pipeline.submit(Request(images[0], PROMPT, options("low")), block=False)
    finally:
        blocked.release.set()
        pipeline.close()
    assert all(f.done() and f.exception() is None for f in accepted) and len(accepted) == held + queue_size + reserved


def test_close_finishes_everything_submitted_then_refuses(runtime, images, blocked):
    pipeline = Pipeline(runtime, queue_size=8)
    futures = [pipeline.submit(Request(images[i], PROMPT, options("low"))) for i in range(6)]
    assert blocked.entered.wait(WAIT_S)
    closer = threading.Thread(target=pipeline.close)
    closer.start()
    wait_until(lambda: pipeline._closed, "close() to start")
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while requests were still in the encoder"
    with pytest.raises(Overloaded):  # closing: no new work
        pipeline.submit(Request(images[0], PROMPT, options("low")))
    blocked.release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert all(f.done() for f in futures)  # no waiting needed after close()
    assert [f.result().tokens for f in futures] == [expected(runtime, images[i], "low").tokens
                                                    for i in range(6)]
    assert pipeline.stats.completed == 6
    with pytest.raises(Overloaded):
        pipeline.submit(Request(images[0], PROMPT, options("low")))
    assert not any(t.is_alive() for t in pipeline._threads)
    pipeline.close()  # a second close is harmless


def test_a_beam_search_that_does_not_fit_the_rows_starts_the_next_batch(runtime, images, recorded, monkeypatch):
    """max_rows bounds the decoder rows of a batch (a TensorRT profile's batch size): a
    4-beam search waiting behind a running request with 3 rows free does not join; it
    starts the next batch, and both answers are the ones they get alone."""
    release, entered = hold_decoder(runtime, monkeypatch, recorded)
    asks = [{"tier": "low", "max_new_tokens": 4}, {"tier": "low", "max_new_tokens": 4, "num_beams": 4}]
    with Pipeline(runtime, queue_size=4, max_batch=4, decoder_joins="on", max_rows=4) as pipeline:
        futures = [pipeline.submit(Request(images[i], PROMPT, asks[i]), block=False) for i in range(2)]
        assert entered.wait(WAIT_S)
        wait_until(lambda: pipeline.depths()["decode"] == 1, "the beam search waiting to be decoded")
        release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert recorded.joins == [(0, 1), (0, 1)] and recorded.opened == 2
    for i, result in enumerate(results):
        assert result.tokens == runtime.infer(images[i], PROMPT, **asks[i]).tokens, f"request {i}"


def test_a_batch_that_keeps_taking_newcomers_holds_only_the_unanswered(runtime, images, monkeypatch):
    """With continuous joins, one decode iteration can run for as long as requests keep
    coming: the crash barrier's list must drop each request once it is answered."""
    import edgemm.engine.pipeline as pipeline_module
    held_sizes: list[int] = []
    working = pipeline_module.Pipeline._working

    def recording(self, stage, held):
        if stage == "decode":
            held_sizes.append(held)  # the list itself: its size is read after each step below
        return working(self, stage, held)
    monkeypatch.setattr(pipeline_module.Pipeline, "_working", recording)
    most = []
    with Pipeline(runtime, queue_size=4, max_batch=2, decoder_joins="on") as pipeline:
        step = pipeline._progress

        def progress(stage):
            if stage == "decode" and held_sizes:
                most.append(len(held_sizes[-1]))
            step(stage)
        pipeline._progress = progress
        futures = []
        for n in range(24):  # keep the pipeline fed, so joins continue the same batch
            futures.append(pipeline.submit(Request(images[n % 4], PROMPT, {"tier": "low", "max_new_tokens": 3})))
        for f in futures:
            f.result(timeout=WAIT_S)
    assert most and max(most) <= 2 + 4, most  # a batch's rows plus what waits behind it, never all 24


def test_a_request_cancelled_while_queued_is_not_prepared(runtime, images, blocked, monkeypatch):
    from edgemm.errors import Cancelled
    prepared = []
    prepare = runtime.prepare
    monkeypatch.setattr(runtime, "prepare", lambda *a, **k: prepared.append(1) or prepare(*a, **k))
    with Pipeline(runtime, queue_size=4) as pipeline:
        first = pipeline.submit(Request(images[0], PROMPT, options("low")))  # holds the encoder
        assert blocked.entered.wait(WAIT_S)
        waiting = [pipeline.submit(Request(images[i], PROMPT, options("low"))) for i in (1, 2)]
        gone = Request(images[3], PROMPT, options("low"))
        gone.cancelled.set()  # its client went away before the pipeline got to it
        cancelled = pipeline.submit(gone)
        blocked.release.set()
        with pytest.raises(Cancelled):
            cancelled.result(timeout=WAIT_S)
        for f in [first, *waiting]:
            f.result(timeout=WAIT_S)
    assert len(prepared) == 3


# ---- the prepare pool: order, and a slow image overtaken ------------------------------------

class GatedPrepare:
    """runtime.prepare that holds the image `slow` until the gate opens (an image that takes
    long to decode) and records which images it has prepared."""

    def __init__(self, runtime, slow: np.ndarray):
        self.original, self.slow = runtime.prepare, slow
        self.gate, self.entered = threading.Event(), threading.Event()
        self.prepared: list[int] = []  # id() of each image prepared

    def __call__(self, image, prompt, **options):
        if image is self.slow:
            self.entered.set()
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        prepared = self.original(image, prompt, **options)
        self.prepared.append(id(image))
        return prepared


@pytest.fixture
def gated(runtime, images, monkeypatch):
    prepare = GatedPrepare(runtime, images[0])
    monkeypatch.setattr(runtime, "prepare", prepare)
    yield prepare
    prepare.gate.set()  # never leave a prepare worker waiting, whatever the test did


class HandClock:
    """The pipeline's prepare clock, moved only by the test."""

    def __init__(self):
        self.now = 1000.0  # a monotonic clock is far from 0

    def __call__(self) -> float:
        return self.now


HELD_S = 1.0  # real time a held request is watched for, several times what it would take to go on


def test_a_slow_image_holds_the_next_until_overtaken_and_the_rest_keep_their_order(runtime, images, gated):
    from edgemm.engine.prepare_order import PREPARE_OVERTAKE_S
    clock = HandClock()
    # three workers: the slow image holds one, requests 1 and 2 are prepared by the others and
    # wait for their turn; request 3 waits in the inbox for a worker
    with Pipeline(runtime, queue_size=8, prepare_workers=3, clock=clock) as pipeline:
        futures = [pipeline.submit(Request(images[0], PROMPT, options("low")))]
        assert gated.entered.wait(WAIT_S)
        futures += [pipeline.submit(Request(images[i], PROMPT, options("low"))) for i in (1, 2, 3)]
        order = track_completion(futures)
        wait_until(lambda: {id(images[1]), id(images[2])} <= set(gated.prepared), "requests 1 and 2 prepared")

        clock.now += PREPARE_OVERTAKE_S * 0.8  # not yet overtaken: request 1 waits for request 0
        time.sleep(HELD_S)
        assert order == [] and pipeline.to_encode.empty() and pipeline.stats.items["encode"] == 0

        clock.now += PREPARE_OVERTAKE_S * 0.4  # request 0 past PREPARE_OVERTAKE_S: overtaken
        for f in futures[1:]:
            f.result(timeout=WAIT_S)
        assert order == [1, 2, 3] and not futures[0].done()  # the slow one still preparing
        gated.gate.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert order == [1, 2, 3, 0]
    for i, result in enumerate(results):
        assert result.tokens == expected(runtime, images[i], "low").tokens, f"request {i}"


def test_an_overtaken_slow_image_does_not_hold_every_encoder_batch_open(runtime, images, gated):
    from edgemm.engine.prepare_order import PREPARE_OVERTAKE_S
    clock = HandClock()
    # a batch window far longer than the test waits: an encoder batch that waited for the slow
    # image would time the test out
    with Pipeline(runtime, queue_size=8, max_batch=4, batch_timeout_ms=600_000, clock=clock) as pipeline:
        slow = pipeline.submit(Request(images[0], PROMPT, options("low")))
        assert gated.entered.wait(WAIT_S)
        clock.now += PREPARE_OVERTAKE_S * 1.2  # overtaken: nothing waits for it any more
        for i in (1, 2):  # one after the other: each is an encoder batch of its own, at once
            pipeline.submit(Request(images[i], PROMPT, options("low"))).result(timeout=WAIT_S)
        assert not slow.done() and pipeline.stats.batches == [1, 1]
        gated.gate.set()
        slow.result(timeout=WAIT_S)
    assert pipeline.stats.batches == [1, 1, 1]


def test_a_tiled_tier_is_batched_only_while_a_call_holds_at_most_max_batch_tiles(monkeypatch):
    """idefics3: `global` is one tile, `2x2` five, `3x3` ten; auto times only what may batch."""
    from edgemm.config import load_config
    from edgemm.engine.batching import encoder_batch_limits
    fixture = Path(__file__).parent / "fixtures" / "idefics3-tiny"
    tiled = Runtime(load_config({"model": {"path": str(fixture), "precision": "fp32"}}), warm_up=False)
    timed = []
    monkeypatch.setattr(tiled, "encoder_batch_speedup", lambda tier, batch: timed.append((tier, batch)) or 2.0)
    assert encoder_batch_limits(tiled, 4, "auto") == {"global": 4, "2x2": 1, "3x3": 1}
    assert timed == [("global", 4)]  # never a 20- or 40-tile call
    assert encoder_batch_limits(tiled, 10, "on") == {"global": 10, "2x2": 2, "3x3": 1}
    assert encoder_batch_limits(tiled, 10, "auto") == {"global": 10, "2x2": 2, "3x3": 1}
    assert timed[1:] == [("global", 10), ("2x2", 2)]


# ---- followers: other questions about the same image, asked with it ------------------------------

QUESTIONS = ["what color is the circle ?", "what color is the square ?", "how many shapes are there ?"]


class Counted:
    """Wraps a runtime method, counting its calls."""

    def __init__(self, runtime, name: str, monkeypatch):
        self.calls = 0
        original = getattr(runtime, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(runtime, name, counted)


def with_followers(image, tier: str, prompts: list[str], follower_options: list[dict] | None = None) -> Request:
    leader = Request(image, PROMPT, options(tier))
    leader.followers = [Request(image, p, o) for p, o in zip(prompts, follower_options or [options(tier)] * len(prompts))]
    return leader


def test_followers_share_their_leaders_preparation_and_features_and_answer_as_asked_alone(runtime, images,
                                                                                         recorded, monkeypatch):
    prepared, encoded = Counted(runtime, "prepare", monkeypatch), Counted(runtime, "encode", monkeypatch)
    with Pipeline(runtime, queue_size=2, max_batch=4) as pipeline:
        leader = with_followers(images[3], "high", QUESTIONS)
        got = [f.result(timeout=WAIT_S) for f in [pipeline.submit(leader)] + [q.future for q in leader.followers]]
    assert prepared.calls == 1 and encoded.calls == 1  # the image decoded, scheduled and encoded once
    assert recorded.joins == [(0, 4)]  # the four decoded together
    for prompt, result in zip([PROMPT] + QUESTIONS, got):
        alone = runtime.infer(images[3], prompt, **options("high"))
        assert (result.tokens, result.text, result.tier) == (alone.tokens, alone.text, "high"), prompt
    # each follower's prompt prefix (the image block) is the one its leader's prefill stored
    assert [r.prefix_reused for r in got[1:]] == [True, True, True]
    assert pipeline.stats.completed == 4 and pipeline.stats.items["prepare"] == 1


def test_a_follower_at_another_tier_is_prepared_and_encoded_apart_right_behind_its_leader(runtime, images,
                                                                                         monkeypatch):
    encoded = Counted(runtime, "encode", monkeypatch)
    with Pipeline(runtime, queue_size=2) as pipeline:
        leader = with_followers(images[4], "low", QUESTIONS[:2], [options("high"), options("low")])
        got = [f.result(timeout=WAIT_S) for f in [pipeline.submit(leader)] + [q.future for q in leader.followers]]
    assert encoded.calls == 2
    assert [r.tier for r in got] == ["low", "high", "low"]
    assert got[1].tokens == runtime.infer(images[4], QUESTIONS[0], **options("high")).tokens


def test_followers_fail_with_their_leaders_image_or_alone_with_their_own_options(runtime, images):
    with Pipeline(runtime, queue_size=2) as pipeline:
        broken = with_followers(b"not an image", "low", QUESTIONS[:1])
        bad_option = with_followers(images[5], "low", QUESTIONS[:2], [{"tier": "no-such-tier"}, options("low")])
        questions = [*broken.followers, *bad_option.followers]  # detached from their leaders once handed on
        for leader in (broken, bad_option):
            pipeline.submit(leader)
        for future in (broken.future, questions[0].future, questions[1].future):
            with pytest.raises(InputError):
                future.result(timeout=WAIT_S)
        assert "no-such-tier" in str(questions[1].future.exception())
        assert bad_option.future.result(timeout=WAIT_S).tier == "low"
        assert questions[2].future.result(timeout=WAIT_S).tier == "low"
    assert pipeline.stats.completed == 2 and pipeline.stats.failed == 3


def test_refused_or_cancelled_leaders_followers_are_cancelled_or_failed_never_left_waiting(runtime, images,
                                                                                          blocked):
    pipeline = Pipeline(runtime, queue_size=1, max_batch=1)
    try:
        first = pipeline.submit(Request(images[0], PROMPT, options("low")))  # held in the encoder
        assert blocked.entered.wait(WAIT_S)
        leaders, refused = [], None
        for i in range(6):  # the stages' queues fill up behind the encoder; then one is refused
            leader = with_followers(images[1 + i], "low", QUESTIONS[:2])
            try:
                pipeline.submit(leader, block=False)
            except Overloaded:
                refused = leader
                break
            leaders.append(leader)
        assert refused is not None, "the pipeline never refused"
        assert all(q.future.cancelled() for q in refused.followers)
        waiting = leaders[-1]  # still in the inbox: cancelled there, its questions fail with it
        asked = list(waiting.followers)
        assert waiting.future.cancel()
    finally:
        blocked.release.set()
        pipeline.close()
    assert first.result(timeout=WAIT_S)
    for q in asked:
        with pytest.raises(Cancelled):
            q.future.result(timeout=WAIT_S)
    for leader in leaders[:-1]:
        assert leader.future.result(timeout=WAIT_S).tier == "low"
    late = with_followers(images[0], "low", QUESTIONS[:1])
    with pytest.raises(Overloaded):
        pipeline.submit(late)  # closed
    assert late.followers[0].future.cancelled()
