"""edgemm.engine.decode, the one decode loop: what fails inside one answer fails that answer
alone (and the others get exactly the tokens they get alone), cancellation between
steps, and beams as rows of a batch that share the prefix cache."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import edgemm.engine.decode as decode
from edgemm.engine.decode import BatchItem, generate, generate_batch
from edgemm.engine.errors import DecodeFailure
from edgemm.errors import Cancelled
from edgemm.engine.generate import GenerationOptions, Generator
from edgemm.model.scenes import make_scene
from test_generate import _batch_items  # one way to make decode-loop inputs for both files

ASKS = [("describe the image", 403_000), ("how many shapes ?", 403_001),
        ("what does the text say ?", 403_002), ("what color is the circle ?", 403_003)]


def endless(runtime, embed=None, decoder=None) -> Generator:
    """The runtime's graphs (or stand-ins) with no stop token: answers run to their budgets."""
    g = runtime.generator
    return Generator(g.encoder, embed or g.embed, decoder or g.decoder, g.max_context, stop_ids=set())


def items_for(runtime, asks=ASKS, **options) -> list[BatchItem]:
    return _batch_items(runtime, asks, **options)


def alone(gen: Generator, item: BatchItem) -> list[int]:
    return generate(gen, BatchItem(item.features, item.input_ids, item.image_start, item.options)).tokens


class PoisonedDecoder:
    """The decoder, except that on decode call `at` (prefill calls not counted) the logits
    of row `row` come out NaN."""

    def __init__(self, decoder, row: int, at: int):
        self.decoder, self.row, self.at, self.calls = decoder, row, at, 0

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def run(self, feeds):
        out = self.decoder.run(feeds)
        if feeds["inputs_embeds"].shape[1] == 1:  # a decode step, not a prefill
            self.calls += 1
            if self.calls == self.at:
                out = dict(out)
                out["logits"] = out["logits"].copy()
                out["logits"][self.row] = np.nan
        return out


def test_nan_logits_in_one_row_fail_that_answer_alone(runtime):
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=8)
    want = [alone(gen, item) for item in items]
    poisoned = endless(runtime, decoder=PoisonedDecoder(runtime.generator.decoder, row=1, at=3))
    results = generate_batch(poisoned, items)
    assert isinstance(results[1], DecodeFailure) and "non-finite" in str(results[1])
    for i in (0, 2, 3):
        assert results[i].tokens == want[i], f"request {i}"


def test_nan_features_fail_their_request_at_its_first_token(runtime):
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=6)
    want = [alone(gen, item) for item in items]
    items[2].features = np.full_like(items[2].features, np.nan)
    results = generate_batch(gen, items)
    assert isinstance(results[2], DecodeFailure)
    assert [results[i].tokens for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]


def test_a_sampling_error_fails_that_answer_alone(runtime, monkeypatch):
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=6, temperature=0.8)
    for i, item in enumerate(items):
        item.options = dataclasses.replace(item.options, seed=20 + i)
    want = [alone(gen, item) for item in items]
    sample = decode.sample_token

    def failing(logits, options, rng):
        if options.seed == 21:
            raise ValueError("probabilities contain NaN")
        return sample(logits, options, rng)
    monkeypatch.setattr(decode, "sample_token", failing)
    results = generate_batch(gen, items)
    assert isinstance(results[1], ValueError)
    assert [results[i].tokens for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]


class RefusingEmbed:
    """The embedding, except that it refuses one token id when asked for new tokens."""

    def __init__(self, embed, refused: int):
        self.embed, self.refused = embed, refused

    def __getattr__(self, name):
        return getattr(self.embed, name)

    def run(self, feeds):
        ids = feeds["input_ids"]
        if ids.shape[1] == 1 and self.refused in ids:
            raise IndexError(f"indices element out of data bounds, idx={self.refused}")
        return self.embed.run(feeds)


def test_a_token_the_embedding_refuses_fails_that_answer_alone(runtime):
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=6)
    want = [alone(gen, item) for item in items]
    # a token only one answer generates: refusing it must fail that answer and no other
    only = [(i, t) for i, tokens in enumerate(want) for t in tokens[:-1]
            if sum(t in other for other in want) == 1]
    assert only, "pick scenes whose answers differ"
    victim, token = only[0]
    results = generate_batch(endless(runtime, embed=RefusingEmbed(runtime.generator.embed, token)), items)
    assert isinstance(results[victim], DecodeFailure) and str(token) in str(results[victim])
    for i, tokens in enumerate(want):
        if i != victim:
            assert results[i].tokens == tokens, f"request {i}"


def test_a_refused_token_in_one_beam_fails_that_search_alone(runtime):
    """A beam search holds several rows: when one of its rows gets a token the embedding
    refuses, all its rows leave, and the rows of the other answers are fed their own tokens."""
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=6)
    items[1].options = GenerationOptions(max_new_tokens=6, num_beams=3, beam_gate=1.0)
    want = [generate(gen, item) for item in items]
    # a token some beam of the search is fed (its final answer need not keep it) and no other answer has
    seen: list[int] = []
    spy = endless(runtime, embed=_Spy(runtime.generator.embed, seen))
    generate(spy, BatchItem(items[1].features, items[1].input_ids, items[1].image_start, items[1].options))
    others = {t for i in (0, 2, 3) for t in want[i].tokens}
    refused = next(t for t in seen if t not in others)
    results = generate_batch(endless(runtime, embed=RefusingEmbed(runtime.generator.embed, refused)), items)
    assert isinstance(results[1], DecodeFailure) and str(refused) in str(results[1])
    for i in (0, 2, 3):
        assert results[i].tokens == want[i].tokens, f"request {i}"


class _Spy:
    """The embedding, recording every token id it is asked for one at a time."""

    def __init__(self, embed, seen: list[int]):
        self.embed, self.seen = embed, seen

    def __getattr__(self, name):
        return getattr(self.embed, name)

    def run(self, feeds):
        ids = feeds["input_ids"]
        if ids.shape[1] == 1:
            self.seen.extend(int(t) for t in ids[:, 0])
        return self.embed.run(feeds)


def test_a_cancelled_answer_stops_at_the_next_step_and_the_others_go_on(runtime):
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=8)
    want = [alone(gen, item) for item in items]
    flag = threading.Event()
    seen: list[int] = []

    def two_then_cancel(token: int) -> None:
        seen.append(token)
        if len(seen) == 2:
            flag.set()  # as the server does when the client goes away
    items[0].on_token, items[0].cancelled = two_then_cancel, flag
    already = threading.Event()
    already.set()
    items[3].cancelled = already  # cancelled while it waited: no prefill, no tokens
    decoder_calls = runtime.generator.decoder.stats.calls
    results = generate_batch(gen, items)
    assert isinstance(results[0], Cancelled) and seen == want[0][:2]
    assert isinstance(results[3], Cancelled)
    assert [results[i].tokens for i in (1, 2)] == [want[i] for i in (1, 2)]
    # one prefill per prompt length for the two that ran, then their 7 steps
    lengths = {items[i].input_ids.shape[1] for i in (0, 1, 2)}
    assert runtime.generator.decoder.stats.calls - decoder_calls == len(lengths) + 7


def test_a_decoder_call_that_fails_fails_every_answer_in_it(runtime):
    class Broken:
        def __init__(self, decoder):
            self.decoder, self.calls = decoder, 0

        def __getattr__(self, name):
            return getattr(self.decoder, name)

        def run(self, feeds):
            if feeds["inputs_embeds"].shape[1] == 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return self.decoder.run(feeds)
    results = generate_batch(endless(runtime, decoder=Broken(runtime.generator.decoder)),
                             items_for(runtime, max_new_tokens=4))
    assert all(isinstance(r, RuntimeError) for r in results)


def test_a_raising_finished_callback_does_not_stop_the_loop(runtime):
    gen = endless(runtime)
    items = items_for(runtime, max_new_tokens=3)
    got = {}

    def finished(key, outcome):
        if key == 0:
            raise KeyError("the caller's bookkeeping broke")
        got[key] = outcome
    batch = decode.DecodingBatch(gen, finished)
    batch.join(list(enumerate(items)))
    batch.run_to_end()
    assert sorted(got) == [1, 2, 3] and all(len(g.tokens) == 3 for g in got.values())


@pytest.mark.parametrize("gate", [0.0, 0.85, 1.0])
def test_beams_in_a_batch_with_other_requests_get_their_own_tokens(runtime, gate):
    gen = runtime.generator
    items = items_for(runtime, max_new_tokens=6)
    items[1].options = GenerationOptions(max_new_tokens=6, num_beams=3, beam_gate=gate)
    items[2].options = GenerationOptions(max_new_tokens=6, temperature=0.9, seed=4)
    items[3].options = GenerationOptions(max_new_tokens=5, num_beams=2, beam_gate=gate)
    want = [generate(gen, item) for item in items]
    results = generate_batch(gen, items)
    for w, got in zip(want, results):
        assert (got.tokens, got.finish_reason) == (w.tokens, w.finish_reason)
    assert results[1].stats["decode_batch"] == 4


def test_beams_use_the_cached_image_prefix_and_give_the_same_tokens(make_runtime):
    cached, uncached = make_runtime(), make_runtime(cache={"max_bytes": 0})
    image = make_scene(403_010).image
    for rt in (cached, uncached):
        rt.infer(image, "describe the image", tier="high")  # the image (and, cached, its prefix) seen once
    for prompt in ("what does the text say ?", "how many shapes are there ?"):
        with_prefix = cached.infer(image, prompt, tier="high", num_beams=3, beam_gate=1.0)
        without = uncached.infer(image, prompt, tier="high", num_beams=3, beam_gate=1.0)
        assert with_prefix.prefix_reused and not without.prefix_reused
        assert with_prefix.tokens == without.tokens
