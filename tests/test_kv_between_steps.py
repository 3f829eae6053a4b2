"""The decoder's KV cache between steps, for both ways of calling onnxruntime that
bench/bench_kv_binding.py measures: `session.run` (edgemm's OrtComponent, what ships) and
IOBinding with the cache kept as OrtValues (its BoundDecoder). What keeping the cache in
onnxruntime's memory could break: a cached prefix is a view of a decoder output, so an
output buffer reused by a later step would change it; rows that join or leave mid-batch
and beams gather and merge rows of that cache."""
from __future__ import annotations

import numpy as np
import pytest

from edgemm.engine.decode import BatchItem, DecodingBatch, generate
from edgemm.engine.generate import GenerationOptions, Generator, PrefixReuse
from edgemm.model.scenes import make_scene

from tests.support.bound_decoder import BoundDecoder

QUESTIONS = ["describe the image", "how many shapes ?", "what does the text say ?", "what color is the circle ?"]


class DictStore:
    """The feature cache's get/put, keeping exactly what it is handed (views included)."""

    def __init__(self):
        self.kept: dict[bytes, tuple] = {}

    def get(self, key):
        return self.kept.get(key)

    def put(self, key, value, copy=True):
        self.kept[key] = tuple(np.array(v) for v in value) if copy else value


@pytest.fixture(params=["session.run", "IOBinding"])
def gen(runtime, request) -> Generator:
    """The runtime's graphs without a stop token (answers run to their budgets), the
    decoder called one way or the other."""
    g = runtime.generator
    decoder = g.decoder if request.param == "session.run" else BoundDecoder(g.decoder)
    return Generator(g.encoder, g.embed, decoder, g.max_context, stop_ids=set())


def item(runtime, question: str, scene: int, reuse: PrefixReuse | None = None, **options) -> BatchItem:
    prepared = runtime.prepare(make_scene(scene).image, question, tier="high")
    features = runtime.generator.encode(prepared.pixel_values)
    return BatchItem(features, prepared.prompt.input_ids, prepared.prompt.image_start,
                     GenerationOptions(**options), reuse=reuse)


def alone(gen: Generator, it: BatchItem) -> list[int]:
    return generate(gen, BatchItem(it.features, it.input_ids, it.image_start, it.options)).tokens


def test_the_present_tensors_become_the_next_past_without_a_copy(runtime):
    """onnxruntime hands session.run's outputs back over its own buffers and takes a
    contiguous numpy input as it is: the loop passes each present on untouched."""
    g = runtime.generator
    seen: list[dict] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(g.decoder, name)

        def run(self, feeds):
            out = g.decoder.run(feeds)
            seen.append({"feeds": dict(feeds), "out": out})
            return out

    rec = Generator(g.encoder, g.embed, Recording(), g.max_context, stop_ids=set())
    generate(rec, item(runtime, QUESTIONS[0], 404_000, max_new_tokens=5))
    assert len(seen) == 5  # the prefill and four steps
    for before, after in zip(seen, seen[1:]):
        for past, present in zip(g.past_names, g.present_names):
            assert after["feeds"][past] is before["out"][present]
            # onnxruntime's buffer, not a numpy copy: 1.19 on (the floor is 1.20); 1.17 and 1.18 copied
            assert not after["feeds"][past].flags.owndata


def test_a_cached_prefix_reused_after_more_steps_gives_the_same_tokens(runtime, gen):
    store = DictStore()
    key = b"image 404001"
    first = item(runtime, QUESTIONS[0], 404_001, PrefixReuse(store, key), max_new_tokens=12)
    generate(gen, first)
    (prefix,) = store.kept.values()
    snapshot = [np.array(kv) for kv in prefix]
    # twelve more decoder calls have run since the prefix was kept, and it is a view of an output
    assert any(not kv.flags.owndata for kv in prefix)
    later = [item(runtime, q, 404_001, PrefixReuse(store, key), max_new_tokens=10) for q in QUESTIONS[1:]]
    batch_results: dict = {}
    batch = DecodingBatch(gen, batch_results.__setitem__)
    batch.join([(0, later[0])])
    for _ in range(4):  # the first reuser decodes on while the others join from the same prefix
        batch.step()
    batch.join([(1, later[1]), (2, later[2])])
    batch.run_to_end()
    for n, it in enumerate(later):
        assert batch_results[n].stats["prefix_reused"]
        assert batch_results[n].tokens == alone(gen, it), QUESTIONS[n + 1]
    assert all(np.array_equal(a, b) for a, b in zip(prefix, snapshot)), "the cached prefix changed"


def test_rows_joining_and_leaving_mid_batch_get_their_tokens_alone(runtime, gen):
    items = [item(runtime, q, 404_010 + n, max_new_tokens=budget)
             for n, (q, budget) in enumerate(zip(QUESTIONS, (3, 11, 6, 9)))]
    items.append(item(runtime, QUESTIONS[0], 404_020, max_new_tokens=8, temperature=0.9, seed=3))
    results: dict = {}
    batch = DecodingBatch(gen, results.__setitem__)
    batch.join([(0, items[0]), (1, items[1])])
    for _ in range(2):
        batch.step()
    batch.join([(2, items[2])])
    for _ in range(3):  # answer 0 leaves meanwhile, at its budget of 3
        batch.step()
    assert 0 in results and len(batch) == 2
    batch.join([(3, items[3]), (4, items[4])])
    batch.run_to_end()
    for n, it in enumerate(items):
        assert results[n].tokens == alone(gen, it), f"request {n}"


@pytest.mark.parametrize("gate", [0.85, 1.0])
def test_beams_joining_a_running_batch_with_a_cached_prefix_get_their_tokens_alone(runtime, gen, gate):
    store = DictStore()
    key = b"image 404030"
    owner = item(runtime, QUESTIONS[0], 404_030, PrefixReuse(store, key), max_new_tokens=10)
    beams = item(runtime, QUESTIONS[1], 404_030, PrefixReuse(store, key), max_new_tokens=7,
                 num_beams=3, beam_gate=gate)
    other = item(runtime, QUESTIONS[2], 404_031, max_new_tokens=9)
    want = [alone(gen, it) for it in (owner, beams, other)]
    results: dict = {}
    batch = DecodingBatch(gen, results.__setitem__)
    batch.join([(0, owner), (2, other)])  # the owner keeps the prefix, then steps on
    for _ in range(3):
        batch.step()
    batch.join([(1, beams)])
    batch.run_to_end()
    assert results[1].stats["prefix_reused"]
    assert [results[n].tokens for n in range(3)] == want


def test_an_answer_whose_result_cannot_be_assembled_fails_alone(runtime, monkeypatch):
    """RequestBatch builds each InferenceResult as its answer ends, inside the step: a
    failure there (here the text decode) fails that request, and the others finish with
    the tokens they get alone."""
    requests = [runtime.prepare(make_scene(404_040 + n).image, q, tier="high", max_new_tokens=budget)
                for n, (q, budget) in enumerate(zip(QUESTIONS, (4, 7, 5)))]
    features = [runtime.encode(r.pixel_values) for r in requests]
    want = [runtime.decode(r, f).tokens for r, f in zip(requests, features)]
    adapter = runtime.answering.adapter
    decode_text = adapter.decode
    poisoned = want[1]
    assert poisoned not in (want[0], want[2])

    def refusing(ids):
        if ids == poisoned:
            raise RuntimeError("injected: no text for these ids")
        return decode_text(ids)
    monkeypatch.setattr(adapter, "decode", refusing)
    results = runtime.decode_batch(requests, features)
    assert isinstance(results[1], RuntimeError) and "injected" in str(results[1])
    assert [results[0].tokens, results[2].tokens] == [want[0], want[2]]
    assert results[0].text == decode_text(want[0]) and results[0].decode_batch == 3
