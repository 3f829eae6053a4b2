#!/usr/bin/env python3
"""edgemm benchmarks. Medians and ratios measured side by side in one run.

    python -m bench.bench runtime [--n 50] [--model DIR] [--threads 1]
    python -m bench.bench pipeline [--frames 200] [--soak 10000]
    python -m bench.bench scheduler [--n 500] [--cache-images 10000] [--beam-n 200]
    python -m bench.bench detokenize

`runtime` (runtime core):
  overhead   end-to-end infer latency minus the time inside the backend's raw run
             calls, median over N requests at the top tier
  kv-cache   tokens/s of a 20-token answer with the KV cache vs recomputing the
             prefix at every step
  cold start `edgemm infer` as a fresh process: wall time to the answer and peak RSS
  batching   per tier, one call on 8 items vs single calls for the encoder, a prefill and
             a decode step: the per-item speed-up dynamic batching can get on this backend
`pipeline` (stream engine):
  throughput pipeline vs a sequential loop over the same folder of generated frames,
             with the bound min(prepare workers / prepare, 1 / encode, 1 / decode,
             cores / sum of stage times) (see pipeline_bound)
  freshness  live synthetic source faster than the model: age of the frame behind
             each answer (capture → answer) vs the pipeline latency (submit → answer)
  soak       RSS growth over many frames through the pipeline, twice in one process
             (the first run also carries the allocator's warm-up; a leak grows in both)
`scheduler` (tier scheduler, feature cache, gated beams): see bench/bench_scheduler.py
`detokenize` (streamed answers): total time to turn N streamed tokens into text pieces,
             decoding the whole answer again after every token (edgemm before the
             one-loop change) vs edgemm.engine.detokenize.TextStream, for each tokenizer
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
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from edgemm.config import load_config  # noqa: E402
from edgemm.engine.decode import BatchItem, generate  # noqa: E402
from edgemm.engine.generate import GenerationOptions, Generator  # noqa: E402
from edgemm.engine.runtime import Runtime  # noqa: E402
from edgemm.model.scenes import make_scene  # noqa: E402
from tests.support.pipeline_bound import pipeline_bound
from tests.support.reference_decode import greedy_without_cache
from bench.procstat import rss_mb

BENCH_SEED_BASE = 300_000
SOURCE_FPS = 240  # freshness: a live source well above what the model answers


def median(xs) -> float:
    return statistics.median(xs)


def component_seconds(rt: Runtime) -> dict[str, float]:
    """Seconds inside raw run calls so far, per component kind (every device it is loaded on)."""
    return {kind: sum(c.stats.seconds for c in by_device.values()) for kind, by_device in rt.standby.items()}


def bench_overhead(rt: Runtime, n: int) -> dict:
    """Runtime overhead = end-to-end minus raw backend time, per request, and where it goes:
    prepare (decode, schedule, resize, normalise, prompt ids, cache key: no backend call),
    encode (around the encoder's run), generate (around the embedding's and decoder's runs)
    and the rest (result assembly, the calls between stages)."""
    scenes = [make_scene(BENCH_SEED_BASE + i, n_shapes=4).image for i in range(n)]
    top = max(rt.manifest.tiers.values(), key=lambda t: t.pixels).name  # the "top tier"
    rt.infer(scenes[0], "describe the image", tier=top)  # prompt ids and token table warm, as in service
    e2e, backend, overhead, tiers = [], [], [], set()
    parts: dict[str, list[float]] = {"prepare": [], "encode": [], "generate": [], "rest": []}
    for image in scenes:
        before = component_seconds(rt)
        t0 = time.perf_counter()
        result = rt.infer(image, "describe the image", tier=top)
        total = time.perf_counter() - t0
        inside = {k: (v - before[k]) * 1e3 for k, v in component_seconds(rt).items()}
        t = result.timings_ms
        e2e.append(total * 1e3)
        backend.append(sum(inside.values()))
        overhead.append(total * 1e3 - backend[-1])
        parts["prepare"].append(t["preprocess"])
        parts["encode"].append(t["encode"] - inside["vision_encoder"])
        parts["generate"].append(t["prefill"] + t["decode"] - inside["embed_tokens"] - inside["decoder"])
        parts["rest"].append(overhead[-1] - parts["prepare"][-1] - parts["encode"][-1] - parts["generate"][-1])
        tiers.add(result.tier)
    ratios = [o / t for o, t in zip(overhead, e2e)]
    return {"requests": n, "tier": ",".join(sorted(tiers)),
            "e2e_ms_median": round(median(e2e), 3), "backend_ms_median": round(median(backend), 3),
            "overhead_ms_median": round(median(overhead), 3),
            "overhead_fraction_median": round(median(ratios), 4),
            "overhead_parts_ms_median": {k: round(median(v), 3) for k, v in parts.items()}}


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
        t0 = time.perf_counter()
        answers["cache"] = generate(no_stop, BatchItem(features, prompt.input_ids, prompt.image_start,
                                                       GenerationOptions(max_new_tokens=tokens))).tokens
        rates["cache"].append(len(answers["cache"]) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        answers["recompute"], _ = greedy_without_cache(no_stop, features, prompt.input_ids, prompt.image_start, tokens)
        rates["recompute"].append(len(answers["recompute"]) / (time.perf_counter() - t0))
    assert answers["cache"] == answers["recompute"], "cache and recompute disagree"
    cache, recompute = median(rates["cache"]), median(rates["recompute"])
    return {"tokens": tokens, "prompt_tokens": int(prompt.input_ids.shape[1]),
            "tokens_per_s_cache": round(cache, 1), "tokens_per_s_recompute": round(recompute, 1),
            "speedup": round(cache / recompute, 2)}


def bench_batch_scaling(rt: Runtime, batch: int = 8, repeats: int = 15) -> dict:
    """Per-item speed of one call on `batch` items over single calls, per tier, for the
    encoder, a prefill ("how many shapes are there ?") and one decode step: what dynamic
    batching can gain on this backend (> 1) or lose (< 1). Medians of `repeats` timings."""
    g = rt.generator

    def ms(run) -> float:
        run()  # the shape's first run allocates
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
        return median(times)
    out = {}
    for tier in rt.manifest.tiers:
        req = rt.prepare(make_scene(BENCH_SEED_BASE, n_shapes=4).image, "how many shapes are there ?", tier=tier)
        one, many = req.pixel_values, np.concatenate([req.pixel_values] * batch)
        features = g.encode(one)
        embeds = g.embed_prompt(req.prompt.input_ids, features, req.prompt.image_positions)
        length = embeds.shape[1]
        mask1, mask_b = np.ones((1, length), np.int64), np.ones((batch, length), np.int64)
        _, past1 = g.step(embeds, mask1, g.empty_past(1))
        past_b = {name: np.concatenate([value] * batch) for name, value in past1.items()}
        new1, new_b = g.embed_next([5]), g.embed_next([5] * batch)
        step_mask1, step_mask_b = np.ones((1, length + 1), np.int64), np.ones((batch, length + 1), np.int64)
        pos1, pos_b = np.full((1, 1), length, np.int64), np.full((batch, 1), length, np.int64)
        timed = {
            "encoder": (ms(lambda: g.encode(one)), ms(lambda: g.encode(many))),
            "prefill": (ms(lambda: g.step(embeds, mask1, g.empty_past(1))),
                        ms(lambda: g.step(np.concatenate([embeds] * batch), mask_b, g.empty_past(batch)))),
            "decode_step": (ms(lambda: g.step(new1, step_mask1, past1, pos1)),
                            ms(lambda: g.step(new_b, step_mask_b, past_b, pos_b))),
        }
        out[tier] = {name: {"single_ms": round(a, 3), f"batch{batch}_ms": round(b, 3),
                            "per_item_speedup": round(batch * a / b, 2)} for name, (a, b) in timed.items()}
    return {"batch": batch, "tiers": out}


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
    # cold start first: a forked child's peak RSS (ru_maxrss) counts the parent's pages it
    # shares until exec, so a parent holding a loaded model would be measured instead
    cold_start = bench_cold_start(args.model)
    rt = Runtime(load_config({"model": {"path": str(args.model)},
                              "backend": {"intra_op_threads": args.threads}}))
    return {"overhead": bench_overhead(rt, args.n), "kv_cache": bench_kv_cache(rt), "cold_start": cold_start,
            "batch_scaling": bench_batch_scaling(rt)}


def _scene_folder(n: int) -> Path:
    import tempfile

    import cv2
    folder = Path(tempfile.mkdtemp(prefix="edgemm-bench-"))
    for i in range(n):
        scene = make_scene(BENCH_SEED_BASE + i)
        cv2.imwrite(str(folder / f"frame_{i:05d}.png"), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
    return folder


def _run_stream(rt: Runtime, source, options, emit, stop: threading.Event | None = None):
    """run_stream as `edgemm stream` runs it: in a pipeline of its own, closed at the end."""
    from edgemm.engine.pipeline import Pipeline
    from edgemm.streams.run import run_stream
    with Pipeline(rt, queue_size=options.share(source.live)) as pipeline:
        return run_stream(pipeline, source, options, emit, stop)


def bench_throughput(rt: Runtime, frames: int, prompt: str, repeats: int = 3) -> dict:
    """Same folder, same model: a sequential loop vs the pipeline, interleaved `repeats` times."""
    from edgemm.engine.pipeline import PREPARE_WORKERS  # what _run_stream's pipeline has
    from edgemm.streams.sources import open_source
    from edgemm.streams.run import StreamOptions
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    folder = _scene_folder(frames)
    seq_fps, pipe_fps, bounds, stage_ms = [], [], [], {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        with open_source(str(folder)) as source:
            for frame in source:
                rt.infer(frame.image, prompt)
        seq_fps.append(frames / (time.perf_counter() - t0))

        summary = _run_stream(rt, open_source(str(folder)), StreamOptions(prompt=prompt), lambda r: None)
        assert summary.frames == frames and summary.errors == 0, summary.to_dict()
        pipe_fps.append(frames / summary.seconds)
        per = {k: v / 1e3 for k, v in summary.stage_ms.items()}
        stage_ms = {k: round(v, 3) for k, v in summary.stage_ms.items()}
        bounds.append(pipeline_bound(per, PREPARE_WORKERS, cores))
    shutil.rmtree(folder)
    seq, pipe, bound = median(seq_fps), median(pipe_fps), median(bounds)
    return {"frames": frames, "prompt": prompt, "repeats": repeats, "stage_ms_per_frame": stage_ms,
            "prepare_workers": PREPARE_WORKERS, "cores": cores,
            "sequential_fps": round(seq, 2), "pipeline_fps": round(pipe, 2), "bound_fps": round(bound, 2),
            "pipeline_vs_sequential": round(pipe / seq, 2), "pipeline_vs_bound": round(pipe / bound, 3)}


def bench_freshness(rt: Runtime, seconds: float = 20.0, prompt: str = "how many shapes are there ?") -> dict:
    """A live source producing frames faster than the model answers them."""
    from edgemm.streams.sources import open_source
    from edgemm.streams.run import StreamOptions
    records: list[dict] = []
    source = open_source(f"synthetic://?fps={SOURCE_FPS}")
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    summary = _run_stream(rt, source, StreamOptions(prompt=prompt), records.append, stop)
    ages = [r["e2e_ms"] for r in records if "answer" in r]
    lat = [r["latency_ms"] for r in records if "answer" in r]
    return {"source_fps": SOURCE_FPS, "seconds": round(summary.seconds, 1), "answers": summary.frames,
            "dropped": summary.dropped, "age_ms_median": round(median(ages), 2),
            "latency_ms_median": round(median(lat), 2),
            "age_over_latency": round(median(ages) / median(lat), 3)}


def bench_soak(rt: Runtime, frames: int, prompt: str = "how many shapes are there ?") -> dict:
    """RSS before/after `frames` frames through the pipeline (unpaced synthetic, low tier)."""
    from edgemm.streams.sources import open_source
    from edgemm.streams.run import StreamOptions
    low = list(rt.manifest.tiers)[0]
    warm = StreamOptions(prompt=prompt, max_frames=200, generation={"tier": low})
    _run_stream(rt, open_source("synthetic://?count=200"), warm, lambda r: None)
    before = rss_mb()
    opts = StreamOptions(prompt=prompt, max_frames=frames, generation={"tier": low})
    summary = _run_stream(rt, open_source(f"synthetic://?count={frames}&seed=7"), opts, lambda r: None)
    after = rss_mb()
    return {"frames": summary.frames, "tier": low, "rss_mb_before": round(before, 1),
            "rss_mb_after": round(after, 1), "rss_growth_mb": round(after - before, 1),
            "seconds": round(summary.seconds, 1)}


def pipeline_section(args) -> dict:
    # feature cache off: repeated frames must cost encoder time, and the soak measures leaks,
    # not the cache filling up to its (bounded) size
    rt = Runtime(load_config({"model": {"path": str(args.model)}, "cache": {"max_bytes": 0},
                              "backend": {"intra_op_threads": args.threads}}))
    return {"throughput": bench_throughput(rt, args.frames, args.prompt),
            "freshness": bench_freshness(rt), "soak": bench_soak(rt, args.soak),
            # the same soak again in the same process: the first run also pays for the
            # allocator's warm-up (new pipeline threads); a leak grows in every run
            "soak_again": bench_soak(rt, args.soak)}


def pipeline_markdown(r: dict) -> str:
    t, f, s, s2 = r["throughput"], r["freshness"], r["soak"], r["soak_again"]
    stages = ", ".join(f"{k} {v} ms" for k, v in t["stage_ms_per_frame"].items())
    return "\n".join([
        "| measure | value |", "|---|---|",
        f"| stage time per frame ({t['prompt']!r}) | {stages} |",
        f"| sequential loop, {t['frames']} frames, median of {t['repeats']} | {t['sequential_fps']} frames/s |",
        f"| pipeline, same frames | {t['pipeline_fps']} frames/s |",
        f"| bound min({t['prepare_workers']}/prepare, 1/encode, 1/decode, {t['cores']} cores/sum) "
        f"| {t['bound_fps']} frames/s |",
        f"| pipeline / sequential | {t['pipeline_vs_sequential']}× |",
        f"| pipeline / bound | {100 * t['pipeline_vs_bound']:.1f} % |",
        f"| live {f['source_fps']} fps source: answers / dropped in {f['seconds']} s | {f['answers']} / {f['dropped']} |",
        f"| frame age at answer, median | {f['age_ms_median']} ms |",
        f"| pipeline latency (submit → answer), median | {f['latency_ms_median']} ms |",
        f"| age / latency | {f['age_over_latency']} |",
        f"| soak: RSS growth over {s['frames']} frames ({s['tier']} tier) | {s['rss_growth_mb']} MB "
        f"({s['rss_mb_before']} → {s['rss_mb_after']} MB, {s['seconds']} s) |",
        f"| soak again, same process: RSS growth over {s2['frames']} frames | {s2['rss_growth_mb']} MB "
        f"({s2['rss_mb_before']} → {s2['rss_mb_after']} MB, {s2['seconds']} s) |",
    ])


def detokenize_section(args) -> dict:
    """Streaming n tokens, side by side: the text so far re-decoded after every token
    (what the daemon did for every request), and TextStream's pieces. Random ids of the
    vocabulary's ordinary tokens; medians of 5, interleaved."""
    from tokenizers import Tokenizer
    from edgemm.engine.detokenize import TextStream
    tokenizers = {"tiny-vlm (word-level, 60)": ROOT / "models" / "tiny-vlm" / "tokenizer.json",
                  "idefics3 fixture (byte-level BPE, 320)": ROOT / "tests" / "fixtures" / "idefics3-tiny"
                  / "tokenizer.json"}
    out = {}
    for name, path in tokenizers.items():
        tok = Tokenizer.from_file(str(path))
        special = {t.content for t in tok.get_added_tokens_decoder().values()}
        ordinary = [i for t, i in tok.get_vocab().items() if t not in special]
        rng = np.random.default_rng(0)
        for n in (256, 1024):
            ids = [int(t) for t in rng.choice(ordinary, n)]
            times: dict[str, list[float]] = {"whole answer again": [], "TextStream": []}
            for _ in range(5):
                t0 = time.perf_counter()
                for i in range(n):
                    tok.decode(ids[:i + 1], skip_special_tokens=True)
                times["whole answer again"].append((time.perf_counter() - t0) * 1e3)
                pieces: list[str] = []
                t0 = time.perf_counter()
                stream = TextStream(tok, lambda _t, text: pieces.append(text))
                for token in ids:
                    stream(token)
                stream.finish(tok.decode(ids, skip_special_tokens=True))
                times["TextStream"].append((time.perf_counter() - t0) * 1e3)
                assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
            out[f"{name}, {n} tokens"] = {k: round(median(v), 2) for k, v in times.items()}
    return out


def detokenize_markdown(r: dict) -> str:
    return "\n".join(["| tokenizer, answer length | whole answer again after each token | TextStream | ratio |",
                      "|---|---|---|---|",
                      *[f"| {k} | {v['whole answer again']} ms | {v['TextStream']} ms | "
                        f"{v['whole answer again'] / max(v['TextStream'], 1e-9):.1f}× |" for k, v in r.items()]])


def markdown(results: dict) -> str:
    o, k, c = results["overhead"], results["kv_cache"], results["cold_start"]
    return "\n".join([
        "| measure | value |", "|---|---|",
        f"| end-to-end infer, median of {o['requests']} ({o['tier']} tier) | {o['e2e_ms_median']} ms |",
        f"| inside backend run calls, median | {o['backend_ms_median']} ms |",
        f"| runtime overhead, median | {o['overhead_ms_median']} ms ({100 * o['overhead_fraction_median']:.2f} % of end-to-end) |",
        "| overhead by part, medians | " + ", ".join(f"{k} {v} ms" for k, v in o["overhead_parts_ms_median"].items()) + " |",
        f"| decode, KV cache ({k['tokens']} tokens) | {k['tokens_per_s_cache']} tokens/s |",
        f"| decode, recompute prefix ({k['tokens']} tokens) | {k['tokens_per_s_recompute']} tokens/s |",
        f"| KV cache speed-up | {k['speedup']}× |",
        f"| cold start `edgemm infer`, median of {c['runs']} | {c['wall_ms_median']} ms |",
        f"| peak RSS of `edgemm infer` (max of {c['runs']}) | {c['peak_rss_mb_max']} MB |",
        *[f"| batch of {b['batch']} vs single calls at {tier}, per-item speed-up | " +
          ", ".join(f"{name} {x['per_item_speedup']}×" for name, x in parts.items()) + " |"
          for b in [results["batch_scaling"]] for tier, parts in b["tiers"].items()],
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=["runtime", "pipeline", "scheduler", "detokenize"])
    ap.add_argument("--frames", type=int, default=200, help="pipeline: frames in the throughput folder")
    ap.add_argument("--soak", type=int, default=10_000, help="pipeline: frames in the memory soak")
    ap.add_argument("--prompt", default="describe the image", help="pipeline: prompt for throughput")
    ap.add_argument("--n", type=int, default=None, help="runtime: requests (50); scheduler: scenes (500)")
    ap.add_argument("--saliency-frames", type=int, default=40, help="scheduler: 1080p frames timed")
    ap.add_argument("--cache-n", type=int, default=100, help="scheduler: images asked two questions")
    ap.add_argument("--cache-images", type=int, default=10_000, help="scheduler: distinct images for the bound")
    ap.add_argument("--beam-n", type=int, default=200, help="scheduler: scenes for the decoding comparison")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.section == "runtime":
        args.n = args.n or 50
        results, table = runtime_section(args), markdown
    elif args.section == "scheduler":
        from bench.bench_scheduler import scheduler_markdown, scheduler_section
        args.n = args.n or 500
        results, table = scheduler_section(args), scheduler_markdown
    elif args.section == "detokenize":
        results, table = detokenize_section(args), detokenize_markdown
    else:
        results, table = pipeline_section(args), pipeline_markdown
    print(json.dumps(results, indent=1))
    print()
    print(table(results))


if __name__ == "__main__":
    main()
