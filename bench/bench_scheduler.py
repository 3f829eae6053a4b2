"""`python -m bench.bench scheduler`: the resolution scheduler, the feature cache and gated beams.

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

A pixel-budget family (Qwen2-VL: tiers are budgets, the tokens follow each image's shape)
has a mode of its own, run directly:

    python -m bench.bench_scheduler budgets --model tests/fixtures/qwen2-vl-tiny [--frames 120]

  budgets    a mixed set of frames (scenes with and without text, flat frames, wide, tall
             and square, all larger than the top budget) and two questions (one asking to
             read): the image tokens per frame the thresholds scheduler chooses vs always the
             top budget, and the encoder time of both, measured interleaved frame by frame
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

from tools.calibrate_scheduler import Table, measure, mixed_questions

import argparse
import json

from edgemm.config import Config, load_config
from edgemm.engine.decode import BatchItem, generate
from edgemm.engine.generate import GenerationOptions
from edgemm.engine.runtime import Runtime
from edgemm.model.scenes import TASKS, make_scene, normalise_answer
from edgemm.engine.tiers import POLICY_FILE, TierPolicy, saliency_stats
from bench.procstat import rss_mb

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


# ---- pixel budgets (Qwen2-VL) --------------------------------------------------------------------

BUDGET_PROMPTS = ("What is in the image?", "Read the text in the image.")  # the second asks for detail
BUDGET_SIZES = ((360, 640), (640, 360), (512, 512))  # (h, w): wide, tall, square


def budget_frames(n: int) -> list[tuple[str, np.ndarray]]:
    """(kind, RGB frame): generated scenes with and without text and flat frames (a wall, the
    sky), each resized to a wide, tall or square frame larger than the top budget."""
    frames = []
    for i in range(n):
        kind = ("scene with text", "scene", "flat")[i % 3]
        if kind == "flat":
            rng = np.random.default_rng(EVAL_SEED_BASE + i)
            image = np.clip(rng.normal(rng.integers(40, 215), 2.0, (256, 256, 3)), 0, 255).astype(np.uint8)
        else:
            image = make_scene(EVAL_SEED_BASE + i, text_probability=1.0 if kind == "scene with text" else 0.0).image
        h, w = BUDGET_SIZES[(i // 3) % len(BUDGET_SIZES)]
        frames.append((kind, cv2.resize(image, (w, h), interpolation=cv2.INTER_LINEAR)))
    return frames


def bench_budgets(model: Path, n: int, threads: int) -> dict:
    sections = {"model": {"path": str(model)}, "backend": {"intra_op_threads": threads, "warmup": False},
                "cache": {"max_bytes": 0}}
    chosen_rt = Runtime(load_config({**sections, "scheduler": {"policy": "thresholds"}}))
    top_rt = Runtime(load_config({**sections, "scheduler": {"policy": "top"}}))
    top = list(chosen_rt.manifest.tiers)[-1]
    rows = []
    for i, (kind, frame) in enumerate(tqdm(budget_frames(n), desc="budgets", file=sys.stderr)):
        prompt = BUDGET_PROMPTS[(i // 3) % 2]
        picked, always = chosen_rt.prepare(frame, prompt), top_rt.prepare(frame, prompt)
        assert always.tier.name == top
        times: dict[str, list[float]] = {"chosen": [], "top": []}
        for _ in range(4):  # interleaved; the first round only warms the shape up (onnxruntime allocates)
            for name, request in (("chosen", picked), ("top", always)) if i % 2 else (("top", always), ("chosen", picked)):
                started = time.perf_counter()
                chosen_rt.encode(request.pixel_values)  # one encoder for both: only the pixels differ
                times[name].append((time.perf_counter() - started) * 1e3)
        times = {name: min(ms[1:]) for name, ms in times.items()}
        rows.append({"kind": kind, "tier": picked.tier.name, "tokens": picked.prompt.image_tokens,
                     "top_tokens": always.prompt.image_tokens, "ms": times["chosen"], "top_ms": times["top"]})
    tokens, top_tokens = [r["tokens"] for r in rows], [r["top_tokens"] for r in rows]
    ratios = [r["ms"] / r["top_ms"] for r in rows]
    by_kind = {kind: {"tokens_mean": round(statistics.mean(r["tokens"] for r in rows if r["kind"] == kind), 1),
                      "top_tokens_mean": round(statistics.mean(r["top_tokens"] for r in rows if r["kind"] == kind), 1)}
               for kind in dict.fromkeys(r["kind"] for r in rows)}
    return {"model": chosen_rt.manifest.name, "frames": len(rows), "tiers": list(chosen_rt.manifest.tiers),
            "policy": chosen_rt.scheduler.name, "tokens_mean": round(statistics.mean(tokens), 1),
            "top_tokens_mean": round(statistics.mean(top_tokens), 1),
            "token_ratio": round(sum(tokens) / sum(top_tokens), 3),
            "encoder_ms_ratio_median": round(statistics.median(ratios), 3),
            "encoder_ms_total_ratio": round(sum(r["ms"] for r in rows) / sum(r["top_ms"] for r in rows), 3),
            "encoder_ms_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "encoder_ms_median": round(statistics.median(r["ms"] for r in rows), 3),
            "top_encoder_ms_median": round(statistics.median(r["top_ms"] for r in rows), 3),
            "tiers_chosen": dict(Counter(r["tier"] for r in rows)), "by_kind": by_kind}


def budgets_markdown(r: dict) -> str:
    lines = [f"{r['frames']} frames, model {r['model']} (tiers {', '.join(r['tiers'])}), policy {r['policy']}", "",
             "| frames | image tokens / frame, scheduler | always the top budget |", "|---|---|---|"]
    lines += [f"| {kind} | {v['tokens_mean']} | {v['top_tokens_mean']} |" for kind, v in r["by_kind"].items()]
    lines += [f"| all | {r['tokens_mean']} | {r['top_tokens_mean']} |", "",
              f"tokens chosen / top: {r['token_ratio']}; encoder time chosen / top per frame: median "
              f"{r['encoder_ms_ratio_median']} (min–max {r['encoder_ms_ratio_range'][0]}–{r['encoder_ms_ratio_range'][1]}), "
              f"in total {r['encoder_ms_total_ratio']}; "
              f"tiers chosen: {r['tiers_chosen']}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="The scheduler on a pixel-budget family (see the module docstring).")
    ap.add_argument("mode", choices=["budgets"])
    ap.add_argument("--model", type=Path, required=True, help="a pixel-budget model folder (Qwen2-VL)")
    ap.add_argument("--frames", type=int, default=120)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    results = bench_budgets(args.model, args.frames, args.threads)
    print(json.dumps(results, indent=1))
    print()
    print(budgets_markdown(results))


if __name__ == "__main__":
    main()
