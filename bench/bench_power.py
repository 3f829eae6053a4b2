#!/usr/bin/env python3
"""What the telemetry sampler costs: process CPU time over wall time, sampling in the background.

    python -m bench.bench_power                    # fake Orin NX tree, default period, 5 runs of 10 s
    python -m bench.bench_power --root / --runs 3  # this machine's own sysfs (on a Jetson: the real thing)

Each run starts a Sampler at the period, sleeps for --seconds in the main thread, and
divides the process CPU time used meanwhile by the wall time: the share of one core the
sampler takes (the sleeping main thread costs nothing measurable). The median of the
runs is reported against the issue's target of at most 1 % of one core. A second figure,
the CPU time of one reading (the median of 1000 direct reads), divided by the period,
says the same thing without waiting.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from edgemm.config import PowerConfig
from edgemm.power.telemetry import Sampler, Sensors

TARGET = 0.01  # at most 1 % of one core


def background_share(sensors: Sensors, period_s: float, seconds: float) -> float:
    sampler = Sampler(sensors, period_s, PowerConfig().history)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def per_reading_s(sensors: Sensors, n: int = 1000) -> float:
    costs = []
    for _ in range(n):
        started = time.process_time_ns()
        sensors.read()
        costs.append((time.process_time_ns() - started) / 1e9)
    return statistics.median(costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="sysfs root to read (default: a fake Orin NX tree in a temporary folder)")
    parser.add_argument("--period", type=float, default=PowerConfig().sample_period_s, help="sample period in s")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of one run")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            from tests.support.fake_jetson import orin_nx
            orin_nx(Path(tmp))
            root = tmp
        sensors = Sensors.discover(root)
        found = {kind: len(files) for kind, files in sensors.files().items()}
        shares = [background_share(sensors, args.period, args.seconds) for _ in range(args.runs)]
        reading = per_reading_s(sensors)
    share = statistics.median(shares)
    print(f"root: {args.root or 'fake Orin NX'}; files per reading: {found}")
    print(f"period {args.period:g} s, {args.runs} runs of {args.seconds:g} s: CPU share of one core "
          f"median {share * 100:.3f} % (runs: {', '.join(f'{s * 100:.3f}' for s in shares)} %)")
    print(f"one reading: {reading * 1e6:.0f} µs CPU → {reading / args.period * 100:.3f} % of a core at this period")
    print(f"target ≤ {TARGET * 100:g} %: {'met' if share <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
