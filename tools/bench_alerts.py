#!/usr/bin/env python3
"""Alerts (edgemm/alerts.py): how right and how quick they are, and what they cost a stream.

    python tools/bench_alerts.py [--frames 600] [--fps 10] [--hold 20] [--seconds 8] [--rounds 5]

One daemon (edgemm.daemon.Daemon in this process, the built-in model, its shipped
config but for backend.intra_op_threads 1 and the socket) on a temporary UNIX socket;
everything is read through its HTTP API.

  accuracy   one stream on synthetic://?fps=FPS&hold=HOLD (a camera at FPS watching
             scenes that each last HOLD frames, with fresh noise on every frame), prompt
             "describe the image", and two alerts of the built-in model's questions:
             red  = "what color is the circle ?" match red,
             many = "how many shapes are there ?" above 2,
             both on_after 2, off_after 3. Listens to its events until `frames` frames
             were answered. Ground truth per frame from edgemm.scenes: red holds when
             the scene has exactly one circle and it is red, many when it has 3 or more
             shapes. Per answered frame, the alert's state then (from the events whose
             frame is at most it) against the truth: precision and recall of "true".
             Per onset (the truth turning true at a scene change): the delay to the
             alert's true event, in frames and in seconds (the event's time minus the
             onset frame's capture time), against the target on_after frames + one
             pipeline latency (on_after / FPS + the stream's median capture-to-answer
             time).
  cost       the stream's answers per second without alerts and with 3 (red, many and
             "what color is the square ?" match blue), rounds interleaved (without, with,
             with, without, ...), `seconds` each, on the same daemon: paced (a camera
             at FPS), and unpaced (synthetic://, as fast as the pipeline goes: the
             stream's prompt and the alerts compete for the same cores), the alerts
             asked on every frame and on every 5th.

The machine may be shared: the figures are medians over rounds and ratios of runs side
by side. Paste the printed Markdown into docs/BENCHMARKS.md with the command.
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgemm.config import load_config  # noqa: E402
from edgemm.daemon import Daemon  # noqa: E402
from edgemm.runtime import Runtime  # noqa: E402
from edgemm.scenes import make_scene  # noqa: E402

WAIT_S = 60.0
SEED = 11
ON_AFTER, OFF_AFTER = 2, 3
ALERTS = {
    "red": {"prompt": "what color is the circle ?", "match": "red", "on_after": ON_AFTER, "off_after": OFF_AFTER},
    "many": {"prompt": "how many shapes are there ?", "above": 2, "on_after": ON_AFTER, "off_after": OFF_AFTER},
}
THIRD = {"blue": {"prompt": "what color is the square ?", "match": "blue", "on_after": ON_AFTER,
                  "off_after": OFF_AFTER}}


@functools.lru_cache(maxsize=4096)
def scene_of(frame: int, hold: int):
    return make_scene(SEED + frame // hold)  # what SyntheticSource shows on that frame


def truth(alert: str, frame: int, hold: int) -> bool:
    scene = scene_of(frame, hold)
    if alert == "red":
        circles = [s for s in scene.shapes if s.kind == "circle"]
        return len(circles) == 1 and circles[0].colour == "red"
    return len(scene.shapes) > 2


def posed(alert: str, frame: int, hold: int) -> bool:
    """The question's premise holds: "what color is the circle ?" about a scene with exactly one
    circle (about any other, the built-in model names some colour all the same)."""
    if alert != "red":
        return True
    return sum(s.kind == "circle" for s in scene_of(frame, hold).shapes) == 1


class DaemonThread:
    def __init__(self, runtime: Runtime):
        self.folder = Path(tempfile.mkdtemp(prefix="edgemm-alerts-", dir="/tmp"))
        self.sock = str(self.folder / "edgemm.sock")
        cfg = load_config({"backend": {"intra_op_threads": 1}, "server": {"socket": self.sock}})
        self.daemon = Daemon(cfg, runtime=runtime)
        self.thread = threading.Thread(target=self.daemon.run, name="bench-daemon", daemon=True)

    def __enter__(self) -> "DaemonThread":
        self.thread.start()
        if not self.daemon.ready.wait(WAIT_S):
            raise SystemExit("the daemon did not become ready")
        return self

    def __exit__(self, *exc) -> None:
        self.daemon.stop()
        self.thread.join(WAIT_S)
        shutil.rmtree(self.folder, ignore_errors=True)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.sock), base_url="http://edgemm", timeout=WAIT_S)


# ---- accuracy and delay ------------------------------------------------------------------------

def accuracy(d: DaemonThread, frames: int, fps: float, hold: int) -> dict:
    spec = {"id": "watch", "source": f"synthetic://?fps={fps:g}&hold={hold}&seed={SEED}",
            "prompt": "describe the image", "alerts": ALERTS}
    results, events = {}, []
    with d.client() as http:
        assert http.post("/v1/streams", json=spec).status_code == 201
        with http.stream("GET", "/v1/streams/watch/events") as response:
            kind = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if kind == "alert":
                        events.append(data)
                    elif "answer" in data:
                        results[data["frame"]] = data
                    kind = None
                    if len(results) >= frames:
                        break
        stream = http.get("/v1/streams/watch").json()
        metrics = http.get("/metrics").text
        http.delete("/v1/streams/watch")
    answered = sorted(results)
    first = answered[0]

    def captured(frame: int) -> float:
        """The frame's capture time; for a frame the stream dropped, the next answered one's
        less the frames between at `fps` (SyntheticSource releases one every 1 / fps)."""
        after = next(n for n in answered if n >= frame)
        return results[after]["capture_time"] - (after - frame) / fps
    latency_s = statistics.median(results[n]["e2e_ms"] for n in answered) / 1e3
    report = {"answered": len(answered), "source_frames": answered[-1] - first + 1, "dropped": stream["dropped"],
              "pipeline_latency_ms_p50": round(latency_s * 1e3, 1),
              "bound_s": round(ON_AFTER / fps + latency_s, 3), "alerts": {}}
    for name in ALERTS:
        mine = sorted((e for e in events if e["alert"] == name), key=lambda e: e["frame"])
        tally = {"all": [0, 0, 0], "posed": [0, 0, 0]}  # true positives, false positives, false negatives
        state, k = "unknown", 0
        for n in answered:
            while k < len(mine) and mine[k]["frame"] <= n:
                state, k = mine[k]["state"], k + 1
            said, real = state == "true", truth(name, n, hold)
            for subset in ("all", "posed") if posed(name, n, hold) else ("all",):
                counts = tally[subset]
                counts[0] += said and real
                counts[1] += said and not real
                counts[2] += real and not said
        delays_f, delays_s, missed, within = [], [], 0, 0
        for onset in range(first + hold - first % hold, answered[-1] - hold, hold):  # whole scenes only
            if not truth(name, onset, hold) or truth(name, onset - 1, hold):
                continue
            end = onset + hold
            while truth(name, end, hold):
                end += hold
            hit = next((e for e in mine if onset <= e["frame"] < end and e["state"] == "true"), None)
            if hit is None:
                missed += 1
                continue
            delays_f.append(hit["frame"] - onset)
            delays_s.append(hit["time"] - captured(onset))
            within += delays_s[-1] <= report["bound_s"]
        tp, fp, fn = tally["all"]
        ptp, pfp, pfn = tally["posed"]
        report["alerts"][name] = {
            "precision": round(tp / (tp + fp), 3) if tp + fp else None,
            "recall": round(tp / (tp + fn), 3) if tp + fn else None,
            "precision_posed": round(ptp / (ptp + pfp), 3) if ptp + pfp else None,
            "recall_posed": round(ptp / (ptp + pfn), 3) if ptp + pfn else None,
            "frames_posed": sum(posed(name, n, hold) for n in answered),
            "frames_true": tp + fn, "onsets": len(delays_f) + missed, "detected": len(delays_f), "missed": missed,
            "delay_frames_p50": statistics.median(delays_f) if delays_f else None,
            "delay_frames_max": max(delays_f) if delays_f else None,
            "delay_s_p50": round(statistics.median(delays_s), 3) if delays_s else None,
            "delay_s_max": round(max(delays_s), 3) if delays_s else None,
            "within_bound": within,
            "skipped": metric(metrics, f'edgemm_alert_skipped_total{{stream="watch",alert="{name}"}}'),
            "unknown": metric(metrics, f'edgemm_alert_answers_total{{stream="watch",alert="{name}",reading="unknown"}}'),
        }
    return report


def metric(text: str, start: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(start)), 0.0)


# ---- cost ------------------------------------------------------------------------------------------

def answers_per_second(d: DaemonThread, source: str, alerts: dict, seconds: float, n: int) -> float:
    spec = {"id": f"cost{n}", "source": source, "prompt": "describe the image", "alerts": alerts}
    with d.client() as http:
        assert http.post("/v1/streams", json=spec).status_code == 201
        frames = lambda: http.get(f"/v1/streams/cost{n}").json()["frames"]  # noqa: E731
        while frames() < 3:  # past the start
            time.sleep(0.05)
        began, count = time.perf_counter(), frames()
        time.sleep(seconds)
        rate = (frames() - count) / (time.perf_counter() - began)
        http.delete(f"/v1/streams/cost{n}")
        # its last frames and questions answered before the next round starts
        while any(http.get("/v1/status").json()["queue"]["depths"].values()):
            time.sleep(0.05)
    time.sleep(0.3)
    return rate


def cost(d: DaemonThread, source: str, seconds: float, rounds: int, every: int = 1) -> dict:
    three = {name: {**alert, "every": every} for name, alert in {**ALERTS, **THIRD}.items()}
    rates: dict[str, list[float]] = {"without": [], "with": []}
    n = 0
    for r in range(rounds):
        for label in (("without", "with") if r % 2 == 0 else ("with", "without")):
            n += 1
            rates[label].append(answers_per_second(d, source, three if label == "with" else {}, seconds, n))
    without, with_ = statistics.median(rates["without"]), statistics.median(rates["with"])
    return {"source": source, "every": every, "without_per_s": [round(x, 2) for x in rates["without"]],
            "with_per_s": [round(x, 2) for x in rates["with"]], "median_without": round(without, 2),
            "median_with": round(with_, 2), "ratio": round(with_ / without, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=600)
    parser.add_argument("--fps", type=float, default=10.0)
    parser.add_argument("--hold", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip", choices=("accuracy", "cost"), action="append", default=[])
    args = parser.parse_args()
    runtime = Runtime(load_config({"backend": {"intra_op_threads": 1}}))
    out: dict = {}
    with DaemonThread(runtime) as d:
        if "accuracy" not in args.skip:
            out["accuracy"] = accuracy(d, args.frames, args.fps, args.hold)
            print(json.dumps(out["accuracy"], indent=1), flush=True)
        if "cost" not in args.skip:
            out["cost"] = [cost(d, f"synthetic://?fps={args.fps:g}", args.seconds, args.rounds),
                           cost(d, "synthetic://", args.seconds, args.rounds),
                           cost(d, "synthetic://", args.seconds, args.rounds, every=5)]
            print(json.dumps(out["cost"], indent=1), flush=True)
    markdown(out, args)


def markdown(out: dict, args) -> None:
    if "accuracy" in out:
        a = out["accuracy"]
        print(f"\nAccuracy: {a['answered']} frames answered of {a['source_frames']} from the source "
              f"({a['dropped']} dropped by the stream), pipeline latency p50 {a['pipeline_latency_ms_p50']} ms, "
              f"bound on_after/fps + latency = {a['bound_s']} s\n")
        print("| alert | precision | recall | ... where the question is well posed (frames) | onsets detected | "
              "delay frames p50 (max) | delay s p50 (max) | within bound | skipped | unknown |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, r in a["alerts"].items():
            print(f"| {name} | {r['precision']} | {r['recall']} | {r['precision_posed']} / {r['recall_posed']} "
                  f"({r['frames_posed']}) | {r['detected']}/{r['onsets']} | "
                  f"{r['delay_frames_p50']} ({r['delay_frames_max']}) | {r['delay_s_p50']} ({r['delay_s_max']}) | "
                  f"{r['within_bound']}/{r['detected']} | {r['skipped']:g} | {r['unknown']:g} |")
    if "cost" in out:
        print("\n| source | alerts' `every` | answers/s without alerts (rounds) | with 3 alerts (rounds) | "
              "median ratio |")
        print("|---|---|---|---|---|")
        for c in out["cost"]:
            print(f"| `{c['source']}` | {c['every']} | {c['median_without']} ({', '.join(map(str, c['without_per_s']))}) | "
                  f"{c['median_with']} ({', '.join(map(str, c['with_per_s']))}) | {c['ratio']} |")


if __name__ == "__main__":
    main()
