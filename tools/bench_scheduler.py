"""`python tools/bench.py scheduler`: the resolution scheduler, the feature cache and gated beams.

  policies   on N held-out generated scenes (seeds 450 000 + i; with and without text,
             every question kind in random phrasings): always-low, always-top, the
             config's thresholds and the calibrated policy side by side — accuracy,
             encoder ms per request, tier histogram. Every (scene, tier) is encoded and
             every question answered once, so all policies are scored on the same answers.
  saliency   cost of the statistics per 1920x1080 frame on one core (median), and as a
             fraction of the top tier's encoder time
  cache      end to end (PNG bytes in, answer out) at the top tier: the first question
             about an image vs a second one (questions alternate, so answer lengths balance);
             then many distinct images through Runtime.encode: the byte bound holds
  beams      greedy vs gated (3 beams, gate 0.85) vs full beams (gate 1) on the same
             encoded scenes: accuracy and decode time (prefill + decode)
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate_scheduler import Table, measure, mixed_questions  # noqa: E402

from edgemm.config import Config, load_config  # noqa: E402
from edgemm.decode import BatchItem, generate  # noqa: E402
from edgemm.generate import GenerationOptions  # noqa: E402
from edgemm.runtime import Runtime  # noqa: E402
from edgemm.scenes import TASKS, make_scene, normalise_answer  # noqa: E402
from edgemm.scheduler import POLICY_FILE, TierPolicy, saliency_stats  # noqa: E402
from procstat import rss_mb  # noqa: E402

EVAL_SEED_BASE = 450_000  # < 500 000 (calibration) and < 1 000 000 (training)


def _runtime(args, **sections) -> Runtime:
    return Runtime(load_config({"model": {"path": str(args.model)},
                                "backend": {"intra_op_threads": args.threads}, **sections}))


# ---- policies ---------------------------------------------------------------------------------

def policies(model: Path, tiers: list[str]) -> dict[str, TierPolicy | str]:
    """Name → policy; 'always-…' are fixed tiers. 'prompt hint only' is the ablation: the
    detail-prompt floor without any image statistic, to show what saliency adds."""
    cfg = Config().scheduler
    out: dict[str, TierPolicy | str] = {
        "always-low": tiers[0], "always-top": tiers[-1],
        "prompt hint only": TierPolicy(cfg.statistic, [float("inf")] * (len(tiers) - 1),
                                       tuple(cfg.detail_words), cfg.detail_tier),
        "thresholds": TierPolicy(cfg.statistic, list(cfg.thresholds), tuple(cfg.detail_words), cfg.detail_tier)}
    if (model / POLICY_FILE).is_file():
        out["calibrated"] = TierPolicy.load(model / POLICY_FILE)
    return out


def score_policy(table: Table, policy: TierPolicy | str) -> dict:
    """Accuracy, encoder ms per request and tier histogram, deciding through TierPolicy.choose."""
    tiers = table.tiers
    chosen = np.array([tiers.index(policy) if isinstance(policy, str)
                       else tiers.index(policy.choose(table.stats[s], prompt, tiers)[0])
                       for s, prompt in zip(table.scene, table.prompts)])
    rows = np.arange(len(chosen))
    right = table.correct[rows, chosen]
    tasks = np.array(table.tasks)
    encoder = table.encoder_ms[table.scene, chosen]
    counts = Counter(tiers[i] for i in chosen)
    return {"accuracy": round(100 * right.mean(), 2),
            "accuracy_by_task": {t: round(100 * right[tasks == t].mean(), 1) for t in TASKS if (tasks == t).any()},
            "encoder_ms_mean": round(float(encoder.mean()), 3),
            "tiers": {t: round(counts[t] / len(chosen), 3) for t in tiers}}


def bench_policies(rt: Runtime, model: Path, n: int) -> tuple[dict, Table]:
    table = measure(rt, range(EVAL_SEED_BASE, EVAL_SEED_BASE + n), desc="bench scheduler")
    policies_used = policies(model, table.tiers)
    results = {name: score_policy(table, p) for name, p in policies_used.items()}
    top = results["always-top"]["encoder_ms_mean"]
    saliency_ms = float(np.mean([s.ms for s in table.stats]))
    for name, r in results.items():
        r["encoder_saving_vs_top"] = round(1 - r["encoder_ms_mean"] / top, 4)
        policy = policies_used[name]
        if isinstance(policy, TierPolicy) and policy.uses_statistics:  # these pay for the statistics too,
            looked = np.mean([policy.needs_statistics(p) for p in table.prompts])  # for the prompts whose rule looks
            r["statistics_share_of_requests"] = round(float(looked), 3)
            r["saving_net_of_saliency"] = round(1 - (r["encoder_ms_mean"] + looked * saliency_ms) / top, 4)
    meta = {"scenes": n, "requests": len(table.prompts), "seeds": f"{EVAL_SEED_BASE}..{EVAL_SEED_BASE + n - 1}",
            "saliency_ms_mean_per_scene_256px": round(saliency_ms, 3),
            "encoder_ms_median_per_tier": {t: round(float(v), 3) for t, v in
                                           zip(table.tiers, np.median(table.encoder_ms, axis=0))}}
    return {"meta": meta, "policies": results}, table


# ---- saliency cost --------------------------------------------------------------------------------

def bench_saliency(frames: int, top_encoder_ms: float, repeats: int = 5) -> dict:
    """Median cost of the statistics for a 1920x1080 frame, OpenCV on one thread."""
    images = [make_scene(EVAL_SEED_BASE + i, size=1920).image[420:1500] for i in range(frames)]
    before = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        saliency_stats(images[0])  # first call builds cached frequency masks
        times = [saliency_stats(image).ms for _ in range(repeats) for image in images]
    finally:
        cv2.setNumThreads(before)
    ms = statistics.median(times)
    return {"frames": frames, "calls": len(times), "frame": "1920x1080", "median_ms": round(ms, 3),
            "p90_ms": round(float(np.percentile(times, 90)), 3),
            "fraction_of_top_tier_encoder": round(ms / top_encoder_ms, 4)}


# ---- feature cache ------------------------------------------------------------------------------------

def bench_cache_repeat(args, n: int) -> dict:
    """First vs second question about the same image, end to end, top tier, cache on."""
    rt = _runtime(args)
    top = list(rt.manifest.tiers)[-1]
    questions = ("how many shapes are there ?", "describe the image")
    first, second = [], []
    for i in range(n):
        image = cv2.imencode(".png", cv2.cvtColor(make_scene(EVAL_SEED_BASE + i).image, cv2.COLOR_RGB2BGR))[1].tobytes()
        a, b = questions if i % 2 == 0 else questions[::-1]
        for prompt, out in ((a, first), (b, second)):
            t0 = time.perf_counter()
            rt.infer(image, prompt, tier=top)
            out.append((time.perf_counter() - t0) * 1e3)
    stats = rt.cache.stats()
    return {"images": n, "tier": top, "first_ms_median": round(statistics.median(first), 3),
            "second_ms_median": round(statistics.median(second), 3),
            "speedup": round(statistics.median(first) / statistics.median(second), 2),
            "hits": stats.hits, "misses": stats.misses}


def bench_cache_bound(args, n: int) -> dict:
    """`n` distinct images through Runtime.encode at the top tier: bytes never above the bound."""
    rt = _runtime(args)
    top = rt.manifest.tiers[list(rt.manifest.tiers)[-1]]
    rss_before, peak = rss_mb(), 0
    for i in tqdm(range(n), desc="cache bound", unit="image", file=sys.stderr):
        rt.encode(rt.pixels(make_scene(EVAL_SEED_BASE + i).image, top))
        peak = max(peak, rt.cache.stats().bytes)
    stats = rt.cache.stats()
    return {"images": n, "max_bytes": stats.max_bytes, "peak_bytes": peak, "entries": stats.entries,
            "evictions": stats.evictions, "bound_respected": peak <= stats.max_bytes,
            "rss_growth_mb": round(rss_mb() - rss_before, 1)}


# ---- gated beams ---------------------------------------------------------------------------------------

BEAM_MODES = {"greedy": {}, "gated": {"num_beams": 3, "beam_gate": 0.85},
              "full beams": {"num_beams": 3, "beam_gate": 1.0}}


def bench_beams(rt: Runtime, n: int) -> dict:
    """Greedy, gated and full beams on the same features and questions, interleaved."""
    top = rt.manifest.tiers[list(rt.manifest.tiers)[-1]]
    right = {m: [] for m in BEAM_MODES}
    ms = {m: [] for m in BEAM_MODES}
    rows = {m: [] for m in BEAM_MODES}
    for seed in tqdm(range(EVAL_SEED_BASE, EVAL_SEED_BASE + n), desc="beams", unit="scene", file=sys.stderr):
        scene = make_scene(seed)
        features = rt.generator.encode(rt.pixels(scene.image, top))
        for q in mixed_questions(scene, np.random.default_rng(seed)):
            prompt = rt.adapter.build_prompt(q.prompt, top)
            for mode, extra in BEAM_MODES.items():
                gen = generate(rt.generator, BatchItem(features, prompt.input_ids, prompt.image_start,
                                            GenerationOptions(max_new_tokens=24, **extra)))
                right[mode].append(normalise_answer(rt.adapter.decode(gen.tokens)) == normalise_answer(q.answer))
                ms[mode].append(gen.timings_ms["prefill"] + gen.timings_ms["decode"])
                rows[mode].append(gen.stats["decoder_rows"])
    greedy_ms = float(np.mean(ms["greedy"]))
    return {"scenes": n, "requests": len(right["greedy"]), "tier": top.name,
            "modes": {m: {"accuracy": round(100 * float(np.mean(right[m])), 2),
                          "decode_ms_mean": round(float(np.mean(ms[m])), 3),
                          "decode_ms_median": round(statistics.median(ms[m]), 3),
                          "vs_greedy": round(float(np.mean(ms[m])) / greedy_ms, 3),
                          "decoder_rows_mean": round(float(np.mean(rows[m])), 2)} for m in BEAM_MODES}}


# ---- the section ----------------------------------------------------------------------------------------

def scheduler_section(args) -> dict:
    rt = _runtime(args, cache={"max_bytes": 0})
    policy_results, table = bench_policies(rt, args.model, args.n)
    top_ms = policy_results["meta"]["encoder_ms_median_per_tier"][table.tiers[-1]]
    return {**policy_results, "saliency": bench_saliency(args.saliency_frames, top_ms),
            "cache_repeat": bench_cache_repeat(args, args.cache_n),
            "cache_bound": bench_cache_bound(args, args.cache_images),
            "beams": bench_beams(rt, args.beam_n)}


def scheduler_markdown(r: dict) -> str:
    meta, s, c, b, beams = r["meta"], r["saliency"], r["cache_repeat"], r["cache_bound"], r["beams"]
    tiers = list(meta["encoder_ms_median_per_tier"])
    lines = [f"{meta['scenes']} scenes, {meta['requests']} questions (seeds {meta['seeds']}); "
             "encoder ms median per tier: " + ", ".join(f"{t} {v}" for t, v in meta["encoder_ms_median_per_tier"].items()),
             "", "| policy | accuracy % | " + " | ".join(f"{t} %" for t in TASKS)
             + " | encoder ms / request | saved vs top | net of saliency | " + " / ".join(tiers) + " |",
             "|---|---|" + "---|" * len(TASKS) + "---|---|---|---|"]
    for name, p in r["policies"].items():
        by_task = " | ".join(str(p["accuracy_by_task"].get(t, "–")) for t in TASKS)
        hist = " / ".join(f"{100 * p['tiers'][t]:.0f} %" for t in tiers)
        net = f"{100 * p['saving_net_of_saliency']:.1f} %" if "saving_net_of_saliency" in p else "–"
        lines.append(f"| {name} | {p['accuracy']} | {by_task} | {p['encoder_ms_mean']} | "
                     f"{100 * p['encoder_saving_vs_top']:.1f} % | {net} | {hist} |")
    lines += ["", "| measure | value |", "|---|---|",
              f"| saliency statistics, {s['frame']} frame, one core: median (p90) of {s['calls']} | "
              f"{s['median_ms']} ms ({s['p90_ms']} ms) |",
              f"| … as a fraction of the top tier's encoder time | {100 * s['fraction_of_top_tier_encoder']:.1f} % |",
              f"| statistics on a 256 px scene, mean | {meta['saliency_ms_mean_per_scene_256px']} ms |",
              f"| first question about an image, end to end ({c['tier']}), median of {c['images']} | {c['first_ms_median']} ms |",
              f"| second question, same image (features cached) | {c['second_ms_median']} ms ({c['speedup']}× faster) |",
              f"| cache after {b['images']} distinct images: peak / bound | {b['peak_bytes']} / {b['max_bytes']} bytes "
              f"({b['entries']} entries, {b['evictions']} evictions, RSS +{b['rss_growth_mb']} MB) |"]
    lines += ["", f"| decoding ({beams['requests']} questions, {beams['tier']} tier) | accuracy % | decode ms mean | "
              "vs greedy | decoder rows / answer |", "|---|---|---|---|---|"]
    for mode, m in beams["modes"].items():
        lines.append(f"| {mode} | {m['accuracy']} | {m['decode_ms_mean']} | {m['vs_greedy']}× | {m['decoder_rows_mean']} |")
    return "\n".join(lines)
