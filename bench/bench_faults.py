#!/usr/bin/env python3
"""Fault injection under load: a real daemon keeps answering while some requests blow up.

    python -m bench.bench_faults [--model DIR] [--duration 20] [--clients 8] [--poison-every 20]
                                 [--max-tokens 16] [--stall-s 2] [--watchdog-usec 1000000]
                                 [--stalls 3] [--no-stall | --stall]

Everything runs in this one process: the built-in model loaded once
(`Runtime(config, concurrent=True)`), a `Daemon` in a thread on a temporary UNIX socket
(the shipped server defaults, except server.queue_size = clients so none is refused), and
the clients as threads, each with its own httpx.Client over the socket, POST /v1/infer.

The feature cache is off (cache.max_bytes 0), so every request runs the encoder, as
distinct camera frames would. The vision encoder of every loaded device is wrapped (its Component.run) so that two
marker images misbehave inside it. A marker is a uniform image of one colour, recognised
from its preprocessed pixels (every pixel of the encoder's input row equal to the
marker's):
  magenta (255, 0, 255)  "encoder poison": the encoder raises RuntimeError
  cyan    (0, 255, 255)  "NaN poison": the encoder answers NaN features for that image,
                         so its decoder logits are NaN: the decode loop fails that
                         request's row alone (edgemm/engine/decode.py), and it gets a 500.
  yellow (255, 255, 0)   "stall" (the --stall section only): the encoder blocks

load (default, and with --no-stall): first every normal request alone, sequentially,
through the daemon (the reference answers); `warmup` s of the same load as below (the
allocator's arenas and onnxruntime's buffers grow to their working size); then `clients` clients for
`duration` s, request n being the encoder poison when n % poison_every == 0, the NaN
poison when n % poison_every == poison_every // 2, else the next of the normal requests:
the four sample images × the tiny VLM's four questions. Reported: statuses, whether every
poison got a 500, whether every other request got its reference answer, 5xx among the
others (target 0), edgemm_requests_in_flight once the clients stopped (target 0: every
admission slot back), /readyz, and this process's VmRSS after the warm-up, every second
of the load and at the end. The target (growth ≤ 20 MB) is judged on the trend: the
median of the load's last five readings minus that of its first five, since single
readings move by ±15 MB with the allocator's sawtooth under this load.

stall (default, and with --stall): a daemon with server.stall_s = stall_s, a fake
NOTIFY_SOCKET (an AF_UNIX datagram socket in a temporary folder) and WATCHDOG_USEC =
watchdog_usec (ping interval = half of it, as under systemd). A yellow request blocks the
encoder until the daemon has reported itself unhealthy for three beats. Per stall: the
time from the block to the last WATCHDOG=1 (target ≤ stall_s + one interval), /readyz
during the stall, and the time from the release to the next WATCHDOG=1. Repeated `stalls`
times; medians.

Prints one JSON object; exit 0 when every target is met, else 1.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import cv2
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from edgemm.config import load_config  # noqa: E402
from edgemm.engine.runtime import Runtime  # noqa: E402
from tests.support.daemon_thread import DaemonThread
from tests.support.fake_systemd import FakeSystemd

QUESTIONS = ["describe the image", "how many shapes are there ?", "what color is the circle ?",
             "what does the text say ?"]
MARKERS = {"encoder_poison": (255, 0, 255), "nan_poison": (0, 255, 255), "stall": (255, 255, 0)}
RSS_TARGET_MB = 20.0
WAIT_S = 60.0  # bound on anything that should happen soon


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def marker_png(rgb: tuple[int, int, int], side: int = 256) -> bytes:
    image = np.empty((side, side, 3), np.uint8)
    image[:] = rgb
    ok, data = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    assert ok
    return data.tobytes()


class FaultyEncoder:
    """Wraps every loaded vision encoder's run(): raises for the encoder poison, NaN rows for
    the NaN poison, blocks on `unblock` for the stall marker."""

    def __init__(self, runtime: Runtime, images: dict[str, bytes]):
        # each marker's per-channel value after preprocessing (a uniform image stays uniform)
        self.values = {kind: runtime.prepare(png, QUESTIONS[0]).pixel_values[0, :, 0, 0].astype(np.float32)
                       for kind, png in images.items()}
        self.unblock = threading.Event()
        self.blocked_at: list[float] = []
        self.calls = Counter()
        for device, component in runtime.standby["vision_encoder"].items():
            component.run = self._wrap(component.run)

    def kind(self, row: np.ndarray) -> str | None:
        corner = row[:, 0, 0].astype(np.float32)
        for kind, value in self.values.items():
            if np.allclose(corner, value, atol=1e-4) and np.allclose(row, value[:, None, None], atol=1e-4):
                return kind
        return None

    def _wrap(self, run):
        def faulty_run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            kinds = [self.kind(row) for row in feeds["pixel_values"]]
            for k in kinds:
                self.calls[k or "normal"] += 1
            if "encoder_poison" in kinds:
                raise RuntimeError("bench_faults: encoder poison image\n(injected failure inside the vision encoder)")
            if "stall" in kinds:
                self.blocked_at.append(time.monotonic())
                self.unblock.wait(WAIT_S)
            out = run(feeds)
            if "nan_poison" in kinds:
                features = np.array(out["image_features"], copy=True)
                for i, k in enumerate(kinds):
                    if k == "nan_poison":
                        features[i] = np.nan
                out = {**out, "image_features": features}
            return out
        return faulty_run


def daemon_thread(runtime: Runtime, model: Path, **server) -> DaemonThread:
    """A Daemon serving `runtime` in a thread on a fresh socket."""
    return DaemonThread(runtime, {"model": {"path": str(model)}, "server": server}, prefix="edgemm-faults-")


def post(http: httpx.Client, image: bytes, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    try:
        r = http.post("/v1/infer", params={"prompt": prompt, "max_tokens": max_tokens}, content=image)
    except httpx.HTTPError as e:
        return {"status": "transport", "error": f"{type(e).__name__}: {e}", "ms": (time.perf_counter() - started) * 1e3}
    out = {"status": r.status_code, "ms": (time.perf_counter() - started) * 1e3}
    try:
        body = r.json()
    except ValueError:
        body = {"error": {"message": r.text[:200]}}
    if r.status_code == 200:
        out["answer"] = (body["answer"], tuple(body["tokens"]))
    else:
        out["error"] = body.get("error", {}).get("message")
    return out


def load_section(runtime: Runtime, model: Path, faulty: FaultyEncoder, images: dict[str, bytes],
                 args: argparse.Namespace) -> dict:
    samples = sorted((model / "samples").glob("*.png"))
    normal = [(f"{s.name}|{q}", s.read_bytes(), q) for s in samples for q in QUESTIONS]
    poison = {"encoder_poison": ("encoder_poison", images["encoder_poison"], QUESTIONS[1]),
              "nan_poison": ("nan_poison", images["nan_poison"], QUESTIONS[1])}
    half = args.poison_every // 2

    def pick(n: int) -> tuple[str, bytes, str]:
        if n % args.poison_every == 0:
            return poison["encoder_poison"]
        if n % args.poison_every == half:
            return poison["nan_poison"]
        return normal[n % len(normal)]

    with daemon_thread(runtime, model, queue_size=args.clients) as d:
        with d.client() as http:
            reference = {key: post(http, image, prompt, args.max_tokens) for key, image, prompt in normal}
            alone_poison = {key: post(http, image, prompt, args.max_tokens) for key, image, prompt in poison.values()}
        bad_refs = [k for k, v in reference.items() if v["status"] != 200]
        if bad_refs:
            raise SystemExit(f"reference requests failed: {bad_refs}")

        def run_clients(seconds: float | None, total: int | None) -> list[tuple[str, dict]]:
            counter, lock, records = itertools.count(), threading.Lock(), []
            deadline = time.monotonic() + seconds if seconds else None

            def client() -> None:
                with d.client() as http:
                    while True:
                        with lock:
                            n = next(counter)
                        late = deadline is not None and time.monotonic() >= deadline
                        if late or (total is not None and n >= total):
                            return
                        key, image, prompt = pick(n)
                        record = post(http, image, prompt, args.max_tokens)
                        with lock:
                            records.append((key, record))
            threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join((seconds or 0) + WAIT_S)
            return records

        run_clients(args.warmup, None)  # warm-up round: every kind of request, concurrently
        rss_before = rss_mb()
        timeline: list[float] = []  # VmRSS every second of the load: growth that levels off, or a leak
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(1.0):
                timeline.append(round(rss_mb(), 1))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        records = run_clients(args.duration, None)
        seconds = time.monotonic() - started
        sampling.set()
        sampler.join(5)
        in_flight_deadline = time.monotonic() + WAIT_S
        while d.metric("edgemm_requests_in_flight") != 0 and time.monotonic() < in_flight_deadline:
            time.sleep(0.05)
        in_flight = d.metric("edgemm_requests_in_flight")
        limit = d.metric("edgemm_admission_limit")
        rss_after = rss_mb()
        with d.client() as http:
            ready = http.get("/readyz")
            after = post(http, *normal[0][1:], args.max_tokens)
        failed = d.daemon.service.pipeline.stats.failed
        encoder_batch = dict(d.daemon.service.pipeline.encoder_batch)  # what encoder_batching auto chose

    statuses = Counter(str(r["status"]) for _, r in records)
    by_kind: dict[str, Counter] = {"encoder_poison": Counter(), "nan_poison": Counter(), "normal": Counter()}
    nan_answers: Counter = Counter()
    mismatches, other_5xx, messages = [], 0, Counter()
    for key, r in records:
        kind = key if key in poison else "normal"
        by_kind[kind][str(r["status"])] += 1
        if kind == "normal":
            if r["status"] != 200 or r["answer"] != reference[key]["answer"]:
                mismatches.append({"request": key, "status": r["status"], "got": r.get("answer") or r.get("error"),
                                   "reference": reference[key]["answer"][0]})
            if r["status"] == "transport" or (isinstance(r["status"], int) and r["status"] >= 500):
                other_5xx += 1
        else:
            if r["status"] == 200:
                nan_answers[r["answer"][0]] += 1
            elif r.get("error"):
                messages[r["error"]] += 1
    every_encoder_poison_500 = by_kind["encoder_poison"]["500"] == sum(by_kind["encoder_poison"].values()) > 0
    every_nan_poison_500 = by_kind["nan_poison"]["500"] == sum(by_kind["nan_poison"].values()) > 0
    trend = round(statistics.median(timeline[-5:]) - statistics.median(timeline[:5]), 1) if len(timeline) >= 10 \
        else round(rss_after - rss_before, 1)
    latencies = sorted(r["ms"] for key, r in records if key not in poison and r["status"] == 200)
    result = {
        "requests": len(records), "seconds": round(seconds, 2), "requests_per_s": round(len(records) / seconds, 2),
        "clients": args.clients, "statuses": dict(statuses),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "encoder_poison_alone": {"status": alone_poison["encoder_poison"]["status"],
                                 "message": alone_poison["encoder_poison"].get("error")},
        "nan_poison_alone": {"status": alone_poison["nan_poison"]["status"],
                             "answer": (alone_poison["nan_poison"].get("answer") or ("",))[0],
                             "message": alone_poison["nan_poison"].get("error")},
        "poison_messages": dict(messages.most_common(3)),
        "nan_poison_answers": dict(nan_answers.most_common(3)),
        "every_encoder_poison_500": every_encoder_poison_500,
        "every_nan_poison_500": every_nan_poison_500,
        "normal_answers_equal_alone": not mismatches, "mismatches": mismatches[:5], "mismatch_count": len(mismatches),
        "other_5xx": other_5xx,
        "normal_latency_ms_p50": round(latencies[len(latencies) // 2], 2) if latencies else None,
        "normal_latency_ms_p99": round(latencies[int(len(latencies) * 0.99)], 2) if latencies else None,
        "in_flight_at_end": in_flight, "admission_limit": limit, "pipeline_failed": failed,
        "readyz_at_end": ready.status_code, "answer_after": after["status"],
        "rss_mb_before": round(rss_before, 1), "rss_mb_after": round(rss_after, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "rss_mb_each_second": timeline,
        # the allocator's sawtooth moves single readings by ±15 MB under this load; a leak is
        # a trend: the median of the load's last 5 readings against its first 5
        "rss_trend_mb": trend,
        "encoder_calls": dict(faulty.calls),
        "encoder_images_per_call": encoder_batch,
    }
    result["targets"] = {
        "every poison gets a 500": every_encoder_poison_500 and every_nan_poison_500,
        "every other answer equals its answer alone": not mismatches,
        "no other 5xx": other_5xx == 0,
        "in flight back to 0": in_flight == 0,
        "readyz 200 and answering after": ready.status_code == 200 and after["status"] == 200,
        f"RSS growth <= {RSS_TARGET_MB:g} MB (trend over the load)": trend <= RSS_TARGET_MB,
    }
    return result


def stall_section(runtime: Runtime, model: Path, faulty: FaultyEncoder, images: dict[str, bytes],
                  args: argparse.Namespace) -> dict:
    interval = args.watchdog_usec / 2e6
    folder = Path(tempfile.mkdtemp(prefix="edgemm-notify-", dir="/tmp"))
    fake = FakeSystemd(folder)
    saved = {k: os.environ.get(k) for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    os.environ.update(NOTIFY_SOCKET=fake.path, WATCHDOG_USEC=str(args.watchdog_usec), WATCHDOG_PID=str(os.getpid()))
    runs = []
    try:
        with daemon_thread(runtime, model, stall_s=args.stall_s) as d:
            fake.expect(lambda m: "WATCHDOG=1" in m, 0)
            for _ in range(args.stalls):
                faulty.unblock.clear()
                faulty.blocked_at.clear()
                out: list = []

                def request() -> None:
                    with d.client() as http:
                        out.append(post(http, images["stall"], QUESTIONS[1], args.max_tokens))
                thread = threading.Thread(target=request, daemon=True)
                thread.start()
                deadline = time.monotonic() + WAIT_S
                while not faulty.blocked_at and time.monotonic() < deadline:
                    time.sleep(0.005)
                blocked = faulty.blocked_at[0]
                unhealthy_at, status = fake.expect(lambda m: "WATCHDOG=1" not in m and "unhealthy" in m, blocked)
                for _ in range(3):  # three beats without a ping
                    fake.expect(lambda m: "unhealthy" in m, fake.messages[-1][0])
                pings = fake.pings()
                last_ping = max(t for t in pings if t < unhealthy_at)
                pings_during = [t for t in pings if t > unhealthy_at]
                with d.client() as http:
                    ready = http.get("/readyz")
                released = time.monotonic()
                faulty.unblock.set()
                resumed, _ = fake.expect(lambda m: "WATCHDOG=1" in m, released)
                thread.join(WAIT_S)
                runs.append({"block_to_last_ping_s": round(last_ping - blocked, 3),
                             "block_to_unhealthy_status_s": round(unhealthy_at - blocked, 3),
                             "pings_while_unhealthy": len(pings_during),
                             "readyz_during": ready.status_code, "reason": ready.json().get("reason"),
                             "release_to_next_ping_s": round(resumed - released, 3),
                             "stalled_request_status": out[0]["status"] if out else None})
    finally:
        faulty.unblock.set()
        fake.close()
        shutil.rmtree(folder, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    bound = args.stall_s + interval
    worst = max(r["block_to_last_ping_s"] for r in runs)
    return {"stall_s": args.stall_s, "watchdog_usec": args.watchdog_usec, "interval_s": interval, "runs": runs,
            "block_to_last_ping_s_median": statistics.median(r["block_to_last_ping_s"] for r in runs),
            "block_to_last_ping_s_max": worst,
            "release_to_next_ping_s_median": statistics.median(r["release_to_next_ping_s"] for r in runs),
            "targets": {f"last ping within stall_s + one interval ({bound:g} s)": worst <= bound,
                        "no ping while unhealthy": all(r["pings_while_unhealthy"] == 0 for r in runs),
                        "readyz 503 while stalled": all(r["readyz_during"] == 503 for r in runs),
                        "pings resume within one interval of the release":
                            all(r["release_to_next_ping_s"] <= interval + 0.1 for r in runs)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load (>= 20 for the documented run)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of the same load before RSS is first read")
    ap.add_argument("--poison-every", type=int, default=20, help="1 request in N is each kind of poison")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stall-s", type=float, default=2.0, help="server.stall_s of the stall daemon")
    ap.add_argument("--watchdog-usec", type=int, default=1_000_000, help="WATCHDOG_USEC of the stall daemon")
    ap.add_argument("--stalls", type=int, default=3)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--stall", action="store_true", help="only the stall section")
    which.add_argument("--no-stall", action="store_true", help="only the load section")
    args = ap.parse_args()
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(name, None)  # the load daemon must not ping a real systemd

    started = time.monotonic()
    # no feature cache: every request runs the encoder, as distinct camera frames would, and a
    # marker image reaches the wrapped encoder every time it is sent
    runtime = Runtime(load_config({"model": {"path": str(args.model)}, "cache": {"max_bytes": 0}}), concurrent=True)
    images = {kind: marker_png(rgb) for kind, rgb in MARKERS.items()}
    faulty = FaultyEncoder(runtime, images)
    report: dict = {"model": str(args.model), "cpus": os.cpu_count()}
    if not args.stall:
        report["load"] = load_section(runtime, args.model, faulty, images, args)
    if not args.no_stall:
        report["stall"] = stall_section(runtime, args.model, faulty, images, args)
    report["seconds"] = round(time.monotonic() - started, 1)
    targets = {**report.get("load", {}).get("targets", {}), **report.get("stall", {}).get("targets", {})}
    report["ok"] = all(targets.values())
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
