#!/usr/bin/env python3
"""edgemm benchmarks. Medians and ratios measured side by side in one run.

    python tools/bench.py runtime [--n 50] [--model DIR] [--threads 1]

`runtime` (runtime core):
  overhead   end-to-end infer latency minus the time inside the backend's raw run
             calls, median over N requests at the top tier
  kv-cache   tokens/s of a 20-token answer with the KV cache vs recomputing the
             prefix at every step
  cold start `edgemm infer` as a fresh process: wall time to the answer and peak RSS
Paste the printed Markdown into docs/BENCHMARKS.md together with the command.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemm.config import load_config  # noqa: E402
from edgemm.generate import GenerationOptions, Generator  # noqa: E402
from edgemm.runtime import Runtime  # noqa: E402
from edgemm.scenes import make_scene  # noqa: E402

BENCH_SEED_BASE = 300_000


def median(xs) -> float:
    return statistics.median(xs)


def bench_overhead(rt: Runtime, n: int) -> dict:
    """Runtime overhead = end-to-end minus raw backend time, per request."""
    scenes = [make_scene(BENCH_SEED_BASE + i, n_shapes=4).image for i in range(n)]
    e2e, backend, overhead = [], [], []
    for image in scenes:
        before = rt.backend_seconds()
        t0 = time.perf_counter()
        rt.infer(image, "describe the image")
        total = time.perf_counter() - t0
        inside = rt.backend_seconds() - before
        e2e.append(total * 1e3)
        backend.append(inside * 1e3)
        overhead.append((total - inside) * 1e3)
    ratios = [o / t for o, t in zip(overhead, e2e)]
    return {"requests": n, "tier": rt.manifest.default_tier,
            "e2e_ms_median": round(median(e2e), 3), "backend_ms_median": round(median(backend), 3),
            "overhead_ms_median": round(median(overhead), 3),
            "overhead_fraction_median": round(median(ratios), 4)}


def bench_kv_cache(rt: Runtime, tokens: int = 20, repeats: int = 7) -> dict:
    """Same prompt, same 20 tokens (stop tokens disabled), with and without the cache."""
    g = rt.generator
    no_stop = Generator(g.encoder, g.embed, g.decoder, rt.manifest.max_context, stop_ids=set())
    scene = make_scene(BENCH_SEED_BASE, n_shapes=4)
    pixel_values, tier = rt.preprocess(scene.image)
    prompt = rt.adapter.build_prompt("describe the image", rt.manifest.tiers[tier])
    features = no_stop.encode(pixel_values)
    rates: dict[str, list[float]] = {"cache": [], "recompute": []}
    answers = {}
    for _ in range(repeats):  # interleaved, so both see the same machine load
        for mode, use_cache in (("cache", True), ("recompute", False)):
            opts = GenerationOptions(max_new_tokens=tokens, use_cache=use_cache)
            t0 = time.perf_counter()
            gen = no_stop.generate(features, prompt.input_ids, prompt.image_start, opts)
            rates[mode].append(len(gen.tokens) / (time.perf_counter() - t0))
            answers[mode] = gen.tokens
    assert answers["cache"] == answers["recompute"], "cache and recompute disagree"
    cache, recompute = median(rates["cache"]), median(rates["recompute"])
    return {"tokens": tokens, "prompt_tokens": int(prompt.input_ids.shape[1]),
            "tokens_per_s_cache": round(cache, 1), "tokens_per_s_recompute": round(recompute, 1),
            "speedup": round(cache / recompute, 2)}


def bench_cold_start(model: Path, runs: int = 5) -> dict:
    """`edgemm infer` as a new process each time: wall time and peak RSS (ru_maxrss)."""
    exe = shutil.which("edgemm", path=str(Path(sys.executable).parent)) or "edgemm"
    sample = model / "samples" / "scene_11.png"
    walls, rss = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.Popen([exe, "infer", str(sample), "--model", str(model)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        walls.append((time.perf_counter() - t0) * 1e3)
        rss.append(usage.ru_maxrss / 1024)  # KiB → MiB on Linux
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"edgemm infer failed: {proc.stderr.read().decode()}")
    return {"runs": runs, "wall_ms_median": round(median(walls), 1),
            "peak_rss_mb_max": round(max(rss), 1), "peak_rss_mb_median": round(median(rss), 1)}


def runtime_section(args) -> dict:
    rt = Runtime(load_config({"model": {"path": str(args.model)},
                              "backend": {"intra_op_threads": args.threads}}))
    return {"overhead": bench_overhead(rt, args.n), "kv_cache": bench_kv_cache(rt),
            "cold_start": bench_cold_start(args.model)}


def markdown(results: dict) -> str:
    o, k, c = results["overhead"], results["kv_cache"], results["cold_start"]
    return "\n".join([
        "| measure | value |", "|---|---|",
        f"| end-to-end infer, median of {o['requests']} ({o['tier']} tier) | {o['e2e_ms_median']} ms |",
        f"| inside backend run calls, median | {o['backend_ms_median']} ms |",
        f"| runtime overhead, median | {o['overhead_ms_median']} ms ({100 * o['overhead_fraction_median']:.2f} % of end-to-end) |",
        f"| decode, KV cache ({k['tokens']} tokens) | {k['tokens_per_s_cache']} tokens/s |",
        f"| decode, recompute prefix ({k['tokens']} tokens) | {k['tokens_per_s_recompute']} tokens/s |",
        f"| KV cache speed-up | {k['speedup']}× |",
        f"| cold start `edgemm infer`, median of {c['runs']} | {c['wall_ms_median']} ms |",
        f"| peak RSS of `edgemm infer` (max of {c['runs']}) | {c['peak_rss_mb_max']} MB |",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=["runtime"])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    results = runtime_section(args)
    print(json.dumps(results, indent=1))
    print()
    print(markdown(results))


if __name__ == "__main__":
    main()
