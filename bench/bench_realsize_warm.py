#!/usr/bin/env python3
"""Warm only, at real size: edgemm `Runtime.infer` against the raw onnxruntime loop, paired.

    python -m bench.bench_realsize_warm [--shape smolvlm-256m | --model DIR] [--rounds 12] [--threads 2]

The two warm candidates of bench/bench_realsize.py (its own classes, each a process of its
own, asked in turn request by request with the order swapped every round), without the cold
starts and without transformers (no torch needed): for the warm target, edgemm ≤ 1.01× the
raw loop. On a shared machine the ratio of each pair of neighbouring requests is steadier
than the ratio of medians; both are printed. Each request's CPU time is its worker's too
(every thread's, from /proc/PID/task/*/schedstat): with --threads 1 the graphs run on the
calling thread, so this is the work done whatever else the machine runs (with more threads
it also counts onnxruntime's spin-waiting). The model folder must have been built by
tools/make_sized_model.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench import bench_realsize


def cpu_ms(pid: int) -> float:
    """CPU time so far of every live thread of process `pid`."""
    tasks = Path(f"/proc/{pid}/task")
    total = 0
    for task in tasks.iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])  # ns on a CPU
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
    return total / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smolvlm-256m")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    args.model = args.model or bench_realsize.SIZED_CACHE / args.shape
    if not (args.model / "reference.json").is_file():
        raise SystemExit(f"{args.model}: no sized model here (python tools/make_sized_model.py {args.shape})")
    inputs = Path(tempfile.mkdtemp(prefix="bench-realsize-warm-")) / "raw_inputs.npz"
    bench_realsize.raw_inputs(args.model, inputs)
    env = {**os.environ, "BENCH_REALSIZE_INPUTS": str(inputs), "OMP_NUM_THREADS": str(args.threads)}
    edgemm, raw = workers = [bench_realsize.Worker(spec, args, env) for spec in ("edgemm:fp32", "raw:fp32")]
    for w in workers:
        w.read()  # loaded, and one untimed answer
    for round_ in range(args.rounds):
        for w in workers if round_ % 2 == 0 else workers[::-1]:
            before = cpu_ms(w.proc.pid)
            run = w.ask("run")
            run["cpu_ms"] = cpu_ms(w.proc.pid) - before
            w.runs.append(run)
    for w in workers:
        w.ask("quit")
        w.proc.wait()
    assert edgemm.runs[-1]["tokens"] == raw.runs[-1]["tokens"], "edgemm and the raw loop gave different tokens"

    def e2e(w) -> list[float]:
        return [r["e2e_ms"] for r in w.runs]

    def rate(w) -> list[float]:
        return [r["steps"] / ((r["e2e_ms"] - r["ttft_ms"]) / 1e3) for r in w.runs if r["steps"]]

    result = {"model": str(args.model.name), "threads": args.threads, "rounds": args.rounds,
              "tokens": len(raw.runs[-1]["tokens"])}
    def cpu(w) -> list[float]:
        return [r["cpu_ms"] for r in w.runs]

    for name, w in (("edgemm", edgemm), ("raw", raw)):
        result[name] = {"e2e_ms": bench_realsize.summary(e2e(w)), "cpu_ms": bench_realsize.summary(cpu(w)),
                        "decode_tokens_per_s": bench_realsize.summary(rate(w))}
    result["edgemm / raw, median of e2e"] = round(result["edgemm"]["e2e_ms"]["median"] / result["raw"]["e2e_ms"]["median"], 4)
    result["edgemm / raw, median of paired e2e"] = round(statistics.median(
        a / b for a, b in zip(e2e(edgemm), e2e(raw))), 4)
    result["edgemm / raw, median of paired CPU time"] = round(statistics.median(
        a / b for a, b in zip(cpu(edgemm), cpu(raw))), 4)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
