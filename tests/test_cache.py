"""edgemm.engine.cache: LRU by bytes, counters, keys, thread safety, and the cache inside Runtime.encode."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from edgemm.engine.cache import FeatureCache, feature_key
from edgemm.model.scenes import make_scene

KB = 1024


def features(value: float, kb: int = 1) -> np.ndarray:
    return np.full((1, kb * KB // 4), value, np.float32)  # kb KiB of float32


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_miss_then_hit_with_counters():
    cache = FeatureCache(10 * KB)
    assert cache.get(key(1)) is None
    cache.put(key(1), features(1.0))
    np.testing.assert_array_equal(cache.get(key(1)), features(1.0))
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries, stats.bytes) == (1, 1, 0, 1, KB)


def test_stored_copy_is_private_and_read_only():
    cache = FeatureCache(10 * KB)
    original = features(1.0)
    cache.put(key(1), original)
    original[:] = 7  # the caller reuses its buffer
    cached = cache.get(key(1))
    assert cached[0, 0] == 1.0
    with pytest.raises(ValueError):
        cached[0, 0] = 3


def test_eviction_is_by_bytes_least_recently_used_first():
    cache = FeatureCache(4 * KB)
    for i in range(3):
        cache.put(key(i), features(i, kb=1))
    cache.get(key(0))  # 0 becomes the most recent: 1 is now the oldest
    cache.put(key(3), features(3, kb=2))  # 5 KiB > 4: one entry must go
    assert cache.get(key(1)) is None
    assert all(cache.get(key(i)) is not None for i in (0, 2, 3))
    stats = cache.stats()
    assert stats.evictions == 1 and stats.bytes == 4 * KB and stats.entries == 3
    cache.put(key(4), features(4, kb=4))  # needs the whole budget
    assert len(cache) == 1 and cache.stats().evictions == 4


def test_an_entry_larger_than_the_budget_is_not_stored():
    cache = FeatureCache(2 * KB)
    cache.put(key(0), features(0))
    cache.put(key(1), features(1, kb=3))
    assert cache.get(key(1)) is None and cache.get(key(0)) is not None


def test_putting_a_key_again_replaces_it_without_double_counting():
    cache = FeatureCache(10 * KB)
    cache.put(key(0), features(0, kb=2))
    cache.put(key(0), features(5, kb=3))
    assert cache.stats().bytes == 3 * KB and cache.get(key(0))[0, 0] == 5


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        FeatureCache(0)


def test_keys_separate_pixels_tier_model_and_precision():
    pixels = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    base = feature_key(pixels, "high", "tiny-vlm", "fp32")
    assert feature_key(pixels.copy(), "high", "tiny-vlm", "fp32") == base
    assert feature_key(pixels[0], "high", "tiny-vlm", "fp32") == base  # [3,H,W] or [1,3,H,W]
    changed = pixels.copy()
    changed[0, 0, 0, 0] += 1e-3
    others = [feature_key(changed, "high", "tiny-vlm", "fp32"), feature_key(pixels, "low", "tiny-vlm", "fp32"),
              feature_key(pixels, "high", "other", "fp32"), feature_key(pixels, "high", "tiny-vlm", "int8")]
    assert len({base, *others}) == 5


def test_many_threads_keep_the_counters_and_the_bound():
    cache = FeatureCache(32 * KB)
    gets_per_thread, threads = 2000, 8
    errors = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(gets_per_thread):
                k = int(rng.integers(0, 64))
                got = cache.get(key(k))
                if got is None:
                    cache.put(key(k), features(k, kb=int(rng.integers(1, 4))))
                elif got[0, 0] != k:
                    errors.append(f"key {k} returned features of {got[0, 0]}")
                assert cache.stats().bytes <= 32 * KB
        except Exception as e:  # surfaced below; a thread's exception would be lost
            errors.append(repr(e))

    pool = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []
    stats = cache.stats()
    assert stats.hits + stats.misses == threads * gets_per_thread
    assert stats.hits > 0 and stats.evictions > 0
    assert stats.bytes == sum(cache.get(k).nbytes for k in list(cache._entries)) <= 32 * KB


# ---- inside the runtime ---------------------------------------------------------------------------

def test_second_question_about_an_image_skips_the_encoder(make_runtime):
    rt = make_runtime()
    image = make_scene(401_000).image
    calls = rt.components.vision_encoder.stats.calls
    first = rt.infer(image, "how many shapes are there ?")
    second = rt.infer(image.copy(), "describe the image")
    again = rt.infer(image, "how many shapes are there ?")
    assert rt.components.vision_encoder.stats.calls == calls + 1
    assert again.tokens == first.tokens
    # features: miss, hit, hit; the image prefix's KV: miss (stored), hit, hit
    assert rt.cache.stats().hits == 4 and rt.cache.stats().misses == 2
    assert not first.prefix_reused and second.prefix_reused and again.prefix_reused
    other_tier = rt.infer(image, "how many shapes are there ?", tier="low")
    assert rt.components.vision_encoder.stats.calls == calls + 2 and other_tier.tier == "low"
    assert second.text  # answered from cached features


def test_prepared_keys_hash_the_smaller_of_image_and_pixels(make_runtime, tmp_path):
    """A prepared request's key is the digest of the decoded RGB when it has fewer bytes
    than the tier's pixel values (else of the pixels): the same picture as an array, as PNG
    bytes or as a file gets one key, another picture or another tier another one."""
    from edgemm.util.opencv import cv2
    rt = make_runtime()
    prep = rt.preparation
    image = make_scene(401_050).image  # 256 px RGB8: a quarter of the top tier's float32 pixels
    as_png = cv2.imencode(".png", image[:, :, ::-1])[1].tobytes()
    (tmp_path / "scene.png").write_bytes(as_png)
    keys = {prep.prepare(source, "describe the image", tier="high").cache_key
            for source in (image, image.copy(), as_png, str(tmp_path / "scene.png"))}
    assert keys == {prep.feature_key(image, "high")}
    assert prep.prepare(image, "describe the image", tier="mid").cache_key == prep.feature_key(image, "mid")
    changed = image.copy()
    changed[0, 0, 0] ^= 1
    assert prep.prepare(changed, "describe the image", tier="high").cache_key not in keys
    large = cv2.resize(image, (640, 640))  # more bytes than the low tier's pixels: those are hashed
    request = prep.prepare(large, "describe the image", tier="low")
    assert request.cache_key == prep.feature_key(request.pixel_values[0], "low") != prep.feature_key(large, "low")
    # a request keyed from its image and one keyed from its pixels find the same features
    rt.infer(image, "describe the image", tier="high")
    calls = rt.components.vision_encoder.stats.calls
    assert rt.infer(as_png, "how many shapes are there ?", tier="high").prefix_reused
    assert rt.components.vision_encoder.stats.calls == calls


def test_batch_with_some_cached_images_equals_an_uncached_batch(make_runtime):
    cached, plain = make_runtime(), make_runtime(cache={"max_bytes": 0})
    assert plain.cache is None
    batch = np.concatenate([cached.preprocess(make_scene(401_100 + i).image)[0] for i in range(3)])
    cached.encode(batch[1:2])  # one of the three is already cached
    calls = cached.components.vision_encoder.stats.calls
    np.testing.assert_allclose(cached.encode(batch), plain.encode(batch), rtol=1e-5, atol=1e-5)
    assert cached.components.vision_encoder.stats.calls == calls + 1  # one call, for the two misses
    assert cached.cache.stats().entries == 3


def test_cache_budget_from_the_config(make_runtime):
    rt = make_runtime(cache={"max_bytes": 100_000})  # tiny-vlm's top tier: 64 x 192 float32 = 49 152 bytes
    for i in range(5):
        rt.infer(make_scene(401_200 + i).image, "how many shapes are there ?", max_new_tokens=1)
    stats = rt.cache.stats()
    fits = 100_000 // (stats.bytes // stats.entries)
    assert stats.entries == fits and stats.evictions == 5 - fits and stats.bytes <= 100_000


def test_reused_prefix_gives_the_same_tokens_as_a_full_prefill(make_runtime):
    """The stored KV of `<bos> <image>*N` must continue exactly like a fresh prefill."""
    # one tier for every prompt (policy top), so each question after the first finds the prefix
    cached = make_runtime(scheduler={"policy": "top"})
    plain = make_runtime(cache={"max_bytes": 0}, scheduler={"policy": "top"})
    prompts = ["describe the image", "how many shapes are there ?", "what does the text say ?",
               "what color is the circle ?"]
    for seed in (401_200, 401_201):
        image = make_scene(seed).image
        for prompt in prompts:
            got = cached.infer(image, prompt, max_new_tokens=24)
            want = plain.infer(image, prompt, max_new_tokens=24)
            assert got.tokens == want.tokens, (seed, prompt)
            assert got.prefix_reused == (prompt != prompts[0])


def test_prefix_is_not_shared_across_tiers_or_sampling_without_cache(make_runtime):
    rt = make_runtime()
    image = make_scene(401_300).image
    rt.infer(image, "describe the image", tier="high")
    assert not rt.infer(image, "how many shapes ?", tier="low").prefix_reused
    assert rt.infer(image, "how many shapes ?", tier="high").prefix_reused


def test_a_tuple_of_views_counts_the_bytes_it_keeps_alive():
    """Prefixes are stored as views of the decoder's outputs (no copy): the cache counts the
    arrays they keep alive, keeps them read-only, and still honours its byte bound."""
    from edgemm.engine.cache import FeatureCache
    cache = FeatureCache(max_bytes=3 * 4000)
    whole = [np.zeros((1, 2, 10, 50), np.float32) for _ in range(2)]  # 4000 bytes each
    cache.put(b"a", tuple(w[:, :, :6] for w in whole), copy=False)
    assert cache.stats().bytes == 8000
    stored = cache.get(b"a")
    assert isinstance(stored, tuple) and stored[0].shape == (1, 2, 6, 50) and not stored[0].flags.writeable
    assert np.shares_memory(stored[0], whole[0])  # no copy was made
    cache.put(b"b", np.ones((1000,), np.float32))  # 4000 more: 12000 fits exactly
    cache.put(b"c", np.ones((10,), np.float32))  # over the bound: the oldest entry goes
    assert cache.get(b"a") is None and cache.stats().bytes == 4040
