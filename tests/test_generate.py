"""edgemm.engine.generate: greedy and seeded sampling, stop/length, context limit, callbacks, cache."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from edgemm.errors import InputError
from edgemm.engine.decode import BatchItem, generate
from edgemm.engine.generate import GenerationOptions, Generator, sample_token

PROMPT = "describe the image"


@pytest.fixture(scope="module")
def sample(model_dir):
    return model_dir / "samples" / "scene_12.png"


@pytest.fixture(scope="module")
def request_inputs(runtime, sample):
    """(features, input_ids, image_start) for PROMPT about the sample at the top tier."""
    pixels, tier = runtime.preprocess(sample)
    prompt = runtime.adapter.build_prompt(PROMPT, runtime.manifest.tiers[tier])
    return runtime.generator.encode(pixels), prompt.input_ids, prompt.image_start


def generator_with_stops(runtime, stop_ids: set[int]) -> Generator:
    g = runtime.generator
    return Generator(g.encoder, g.embed, g.decoder, g.max_context, stop_ids)


def run(generator, request_inputs, **options):
    return generate(generator, BatchItem(*request_inputs, GenerationOptions(**options)))


# ---- sample_token on handcrafted logits ------------------------------------------------

def test_temperature_zero_is_argmax():
    logits = np.array([0.1, 3.0, -1.0, 2.9, 3.0 - 1e-6], np.float32)
    rng = np.random.default_rng(0)
    assert all(sample_token(logits, GenerationOptions(temperature=0), rng) == 1 for _ in range(5))


def test_tiny_top_p_keeps_only_the_top_token():
    logits = np.array([1.0, 0.9, 0.8, 0.7, 0.6])  # the top token has only ~24% of the mass
    rng = np.random.default_rng(0)
    options = GenerationOptions(temperature=1.0, top_p=1e-6)
    assert {sample_token(logits, options, rng) for _ in range(50)} == {0}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.40, 0.35, 0.25]))  # 0.40 < 0.5 ≤ 0.75: keep the top two
    rng = np.random.default_rng(0)
    options = GenerationOptions(temperature=1.0, top_p=0.5)
    assert {sample_token(logits, options, rng) for _ in range(200)} == {0, 1}


def test_sampling_follows_the_distribution_and_the_seed():
    logits = np.log(np.array([0.7, 0.2, 0.1]))
    options = GenerationOptions(temperature=1.0)
    draws = [sample_token(logits, options, np.random.default_rng(0)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    rng = np.random.default_rng(1)
    counts = np.bincount([sample_token(logits, options, rng) for _ in range(400)], minlength=3)
    assert counts[0] > counts[1] > counts[2] > 0


# ---- options -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    {"max_new_tokens": 0}, {"max_new_tokens": -5}, {"temperature": -0.1},
    {"temperature": math.nan}, {"top_p": 0.0}, {"top_p": -0.5}, {"top_p": 1.01},
    {"top_p": math.nan}], ids=lambda bad: "{}={}".format(*next(iter(bad.items()))))
def test_options_reject_bad_values(bad):
    with pytest.raises(InputError, match=next(iter(bad))):
        GenerationOptions(**bad)


def test_options_accept_edge_values():
    GenerationOptions(max_new_tokens=1, temperature=0, top_p=1.0)
    GenerationOptions(temperature=2.0, top_p=1e-9, seed=0)


# ---- generation with the real model ----------------------------------------------------------

def test_greedy_is_deterministic(runtime, request_inputs):
    a = run(runtime.generator, request_inputs)
    b = run(runtime.generator, request_inputs)
    assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(runtime, sample):
    greedy = runtime.infer(sample, PROMPT).tokens
    sampled = []
    for seed in range(5):  # the trained model is confident: it takes a hot temperature to stray
        first = runtime.infer(sample, PROMPT, temperature=3.0, seed=seed).tokens
        assert runtime.infer(sample, PROMPT, temperature=3.0, seed=seed).tokens == first
        sampled.append(first)
    assert any(tokens != greedy for tokens in sampled)


def test_max_new_tokens_caps_with_length(runtime, request_inputs):
    endless = generator_with_stops(runtime, set())  # nothing stops it but the cap
    result = run(endless, request_inputs, max_new_tokens=5)
    assert len(result.tokens) == 5 and result.finish_reason == "length"
    capped = run(runtime.generator, request_inputs, max_new_tokens=2)
    assert len(capped.tokens) <= 2
    assert capped.finish_reason == ("length" if len(capped.tokens) == 2 else "stop")


def test_stop_token_first(runtime, request_inputs):
    first = run(generator_with_stops(runtime, set()), request_inputs, max_new_tokens=1).tokens[0]
    result = run(generator_with_stops(runtime, {first}), request_inputs)
    assert result.tokens == [] and result.finish_reason == "stop"


def test_stop_token_later_ends_before_it(runtime, request_inputs):
    full = run(generator_with_stops(runtime, set()), request_inputs, max_new_tokens=6).tokens
    stop = full[-1]
    result = run(generator_with_stops(runtime, {stop}), request_inputs, max_new_tokens=6)
    assert result.tokens == full[:full.index(stop)] and result.finish_reason == "stop"


def test_prompt_longer_than_context(runtime, request_inputs):
    features, ids, start = request_inputs
    context = runtime.generator.max_context
    word = ids[:, -2:-1]  # a prompt word, repeated to pad
    too_long = np.concatenate([ids, np.repeat(word, context + 1 - ids.shape[1], axis=1)], axis=1)
    with pytest.raises(InputError, match=f"context is {context}"):
        generate(runtime.generator, BatchItem(features, too_long, start, GenerationOptions()))
    with pytest.raises(InputError):
        generate(runtime.generator, BatchItem(features, too_long[:, :context], start, GenerationOptions()))


def test_prompt_just_inside_context_gets_one_token(runtime, request_inputs):
    features, ids, start = request_inputs
    context = runtime.generator.max_context
    fits = np.concatenate([ids, np.repeat(ids[:, -2:-1], context - 1 - ids.shape[1], axis=1)], axis=1)
    endless = generator_with_stops(runtime, set())
    result = generate(endless, BatchItem(features, fits, start, GenerationOptions(max_new_tokens=10)))
    assert len(result.tokens) == 1 and result.finish_reason == "length"


def test_runtime_refuses_a_prompt_over_the_context(runtime, sample):
    with pytest.raises(InputError, match="context"):
        runtime.infer(sample, "a " * runtime.manifest.max_context)


def test_callback_gets_every_token_and_the_text_it_adds(runtime, sample):
    seen = []
    result = runtime.infer(sample, PROMPT, temperature=1.5, seed=3,
                           on_token=lambda token, text: seen.append((token, text)))
    assert len(result.tokens) >= 2, "pick a seed that yields a few tokens"
    assert [token for token, _ in seen if token >= 0] == result.tokens
    assert "".join(text for _, text in seen) == result.text
    decode = runtime.adapter.decode  # each piece is what that token adds to the answer so far
    assert [text for token, text in seen if token >= 0][-1] == \
        decode(result.tokens)[len(decode(result.tokens[:-1])):]


def test_streamed_pieces_make_the_answer_for_byte_level_tokens(model_dir):
    """A byte-level tokenizer (the idefics3 fixture's) splits characters across tokens: the
    pieces hold a partial character back, and `finish` hands over what an answer that
    ends mid-character decodes to, so the pieces always concatenate to the full decode."""
    from tokenizers import Tokenizer
    from edgemm.engine.detokenize import END_OF_TEXT, TextStream
    tokenizer = Tokenizer.from_file(str(model_dir.parent.parent / "tests" / "fixtures" / "idefics3-tiny"
                                       / "tokenizer.json"))
    rng = np.random.default_rng(7)
    held_back = 0
    for _ in range(50):
        ids = [int(t) for t in rng.integers(0, tokenizer.get_vocab_size(), rng.integers(1, 30))]
        pieces = []
        stream = TextStream(tokenizer, lambda token, text: pieces.append((token, text)))
        for token in ids:
            stream(token)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stream.finish(full)
        assert "".join(text for _, text in pieces) == full
        assert [t for t, _ in pieces if t != END_OF_TEXT] == ids
        held_back += pieces[-1][0] == END_OF_TEXT
    assert held_back, "no answer ended mid-character: the finish path went untested"


def test_cache_and_no_cache_give_the_same_tokens(runtime, request_inputs):
    from tests.support.reference_decode import greedy_without_cache
    endless = generator_with_stops(runtime, set())
    cached = run(endless, request_inputs, max_new_tokens=8)
    assert (cached.tokens, cached.finish_reason) == greedy_without_cache(endless, *request_inputs, 8)
    assert len(cached.tokens) == 8
    greedy = run(runtime.generator, request_inputs)
    assert (greedy.tokens, greedy.finish_reason) == greedy_without_cache(runtime.generator, *request_inputs, 32)


# ---- several requests decoded together -----------------------------------------------------------

def _batch_items(runtime, prompts_and_seeds, **options):
    from edgemm.engine.decode import BatchItem
    from edgemm.engine.generate import GenerationOptions
    from edgemm.model.scenes import make_scene
    items = []
    for prompt, seed in prompts_and_seeds:
        prepared = runtime.prepare(make_scene(seed).image, prompt)
        features = runtime.generator.encode(prepared.pixel_values)
        items.append(BatchItem(features, prepared.prompt.input_ids, prepared.prompt.image_start,
                               GenerationOptions(**options)))
    return items


def test_batched_decoding_gives_each_request_its_own_tokens(runtime):
    """Prompts of different lengths and answers of different lengths, stepped together,
    must give exactly the tokens each gives alone (greedy and seeded sampling)."""
    from edgemm.engine.decode import generate_batch
    asks = [("describe the image", 402_000), ("how many shapes ?", 402_001),
            ("what does the text say ?", 402_002), ("what color is the circle ?", 402_003)]
    for options in ({"max_new_tokens": 20}, {"max_new_tokens": 12, "temperature": 0.9, "seed": 5}):
        items = _batch_items(runtime, asks, **options)
        together = generate_batch(runtime.generator, items)
        for item, got in zip(items, together):
            alone = generate(runtime.generator, BatchItem(item.features, item.input_ids, item.image_start, item.options))
            assert got.tokens == alone.tokens and got.finish_reason == alone.finish_reason
            assert got.stats["decode_batch"] == len(items)


def test_requests_joining_a_running_batch_get_their_own_tokens(runtime):
    """Continuous batching: requests join between steps (shorter and longer prompts than the
    rows running), rows leave as they end, each gets the tokens it gets alone and is handed
    back when its row stops; the padded cache never outgrows the longest live row."""
    from edgemm.engine.decode import DecodingBatch
    endless = generator_with_stops(runtime, set())  # no stop token: rows end on their budgets
    asks = [("describe the image", 402_030), ("how many shapes ?", 402_031),
            ("what does the text say ?", 402_032), ("what color is the circle ?", 402_033)]
    items = _batch_items(runtime, asks, max_new_tokens=6)
    items[0].options = dataclasses.replace(items[0].options, max_new_tokens=10)
    items[2].options = dataclasses.replace(items[2].options, max_new_tokens=3)
    finished: list[tuple[int, object, int]] = []  # (key, outcome, decoder steps made by then)
    batch = DecodingBatch(endless, lambda key, outcome: finished.append(
        (key, outcome, sum(batch.steps_by_rows.values()))))
    batch.join([(0, items[0])])
    batch.step()
    batch.step()
    batch.join([(1, items[1]), (2, items[2])])  # one shorter prompt, one longer
    batch.step()
    batch.join([(3, items[3])])
    widths = []
    while batch:
        batch.step()
        widths.append(batch.mask.shape[1])
        live = [a.length + len(a.tokens) for a in batch.answers]
        assert not batch.answers or batch.mask.shape[1] == max(live), "padding no row needs was kept"
    assert sorted(key for key, _, _ in finished) == [0, 1, 2, 3]
    for key, got, _ in finished:
        item = items[key]
        alone = generate(endless, BatchItem(item.features, item.input_ids, item.image_start, item.options))
        assert got.tokens == alone.tokens and len(got.tokens) == item.options.max_new_tokens, f"request {key}"
    assert [key for key, _, _ in finished].index(2) < [key for key, _, _ in finished].index(0)
    assert finished[0][2] < finished[-1][2]  # the first answer came back while others still decoded
    assert max(batch.steps_by_rows) == 4
    assert any(b <= a for a, b in zip(widths, widths[1:])), widths  # a step where padding was cut


def test_prompts_of_one_length_are_prefilled_in_one_decoder_call(runtime):
    """Three requests with the same question (so the same prompt length) and one other:
    two prefill calls, not four, and each request still gets the logits it gets alone."""
    from edgemm.engine.decode import generate_batch
    asks = [("how many shapes ?", 402_020), ("how many shapes ?", 402_021),
            ("describe the image", 402_022), ("how many shapes ?", 402_023)]
    items = _batch_items(runtime, asks, max_new_tokens=1)  # no decode step: only prefills call
    lengths = {item.input_ids.shape[1] for item in items}
    assert len(lengths) == 2
    before = runtime.generator.decoder.stats.calls
    together = generate_batch(runtime.generator, items)
    assert runtime.generator.decoder.stats.calls - before == len(lengths)
    for item, got in zip(items, together):
        embeds = runtime.generator.embed_prompt(item.input_ids, item.features, item.image_start)
        alone_logits, _ = runtime.generator.step(embeds, np.ones_like(item.input_ids), runtime.generator.empty_past(1))
        assert got.tokens == [int(alone_logits[0].argmax())]


def test_a_failing_request_does_not_fail_its_batch(runtime):
    from edgemm.engine.decode import generate_batch
    items = _batch_items(runtime, [("describe the image", 402_010), ("how many shapes ?", 402_011)],
                         max_new_tokens=8)
    items[0].input_ids = items[0].input_ids[:, :3]  # fewer image placeholders than features

    def hang_up(token):
        raise ConnectionError("client went away")
    extra = _batch_items(runtime, [("how many shapes ?", 402_012)], max_new_tokens=8)[0]
    extra.on_token = hang_up
    results = generate_batch(runtime.generator, items + [extra])
    assert isinstance(results[0], Exception) and "image placeholders" in str(results[0])
    assert isinstance(results[2], ConnectionError)
    alone = generate(runtime.generator, BatchItem(items[1].features, items[1].input_ids, items[1].image_start, items[1].options))
    assert results[1].tokens == alone.tokens


# ---- the token-embedding table of the decode loop --------------------------------------

def test_embed_next_matches_the_graph_and_runs_it_once_per_token(runtime, monkeypatch):
    g = generator_with_stops(runtime, set())
    tokens = [5, 9, 5, 12]
    want = g.embed.run({"input_ids": np.array(tokens, np.int64)[:, None]})["inputs_embeds"]
    calls = g.embed.stats.calls
    got = g.embed_next(tokens)
    assert got.shape == (4, 1, want.shape[-1])
    np.testing.assert_array_equal(got, want)
    assert g.embed.stats.calls == calls + 1  # one call for the 3 distinct tokens
    np.testing.assert_array_equal(g.embed_next([12, 9]), want[[3, 1]])
    assert g.embed.stats.calls == calls + 1  # all known: no call

    import edgemm.engine.generate as generate
    monkeypatch.setattr(generate, "TOKEN_EMBED_BYTES", want[0].nbytes * 3)  # room for 3 tokens
    np.testing.assert_array_equal(g.embed_next([7]), g.embed.run({"input_ids": np.array([[7]])})["inputs_embeds"])
    assert len(g._token_embeds) == 1  # the table started afresh instead of growing past its bound


def test_an_image_span_places_the_features_as_the_positions_do(runtime, sample):
    """A prompt whose placeholders are one run carries them as a slice too (Prompt.image_span):
    the embeddings, the prefix split and its key are the ones the index array gives, bit for
    bit, and a run of the wrong length is refused like an index array of it."""
    from edgemm.errors import ModelError
    from edgemm.engine.generate import PrefixReuse
    pixels, tier = runtime.preprocess(sample)
    prompt = runtime.adapter.build_prompt(PROMPT, runtime.manifest.tiers[tier])
    gen = runtime.generator
    features = gen.encode(pixels)
    assert prompt.image_span == slice(prompt.image_start, prompt.image_start + prompt.image_tokens)
    by_span = gen.embed_prompt(prompt.input_ids, features, prompt.image_span)
    by_index = gen.embed_prompt(prompt.input_ids, features, prompt.image_positions)
    assert by_span.dtype == by_index.dtype and np.array_equal(by_span, by_index)
    assert not np.array_equal(by_span, gen.embed_prompt(prompt.input_ids, features[:, ::-1], prompt.image_span))
    reuse = PrefixReuse(runtime.cache, b"image")
    assert gen.prefix_key(features, prompt.input_ids, prompt.image_span, reuse) == \
        gen.prefix_key(features, prompt.input_ids, prompt.image_positions, reuse)
    short = slice(prompt.image_start, prompt.image_start + prompt.image_tokens - 1)
    with pytest.raises(ModelError, match="image placeholders"):
        gen.embed_prompt(prompt.input_ids, features, short)
    with pytest.raises(ModelError, match="image placeholders"):
        gen.embed_prompt(prompt.input_ids, features, prompt.image_positions[:-1])
