#!/usr/bin/env python3
"""Alerts (edgemm/streams/alerts/): how right and how quick they are, and what they cost a stream.

    python -m bench.bench_alerts [--frames 600] [--fps 10] [--hold 20] [--seconds 8] [--rounds 5]
                                 [--no-browser] [--skip accuracy|cost]

One daemon (edgemm.server.daemon.Daemon in this process, the built-in model, its shipped
config but for backend.intra_op_threads 1, the socket and a loopback TCP port for the
browser) on a temporary UNIX socket; everything is read through its HTTP API.

  accuracy   one stream on synthetic://?fps=FPS&hold=HOLD (a camera at FPS watching
             scenes that each last HOLD frames, with fresh noise on every frame), prompt
             "describe the image", and two alerts of the built-in model's questions:
             red  = "what color is the circle ?" match red,
             many = "how many shapes are there ?" above 2,
             both on_after 2, off_after 3. Listens to its events until `frames` frames
             were answered. Ground truth per frame from edgemm.model.scenes: red holds when
             the scene has exactly one circle and it is red, many when it has 3 or more
             shapes. Per answered frame, the alert's state then (from the events whose
             frame is at most it) against the truth: precision and recall of "true".
             Per onset (the truth turning true at a scene change): the delay to the
             alert's true event, in frames and in seconds (the event's time minus the
             onset frame's capture time), against the target on_after frames + one
             pipeline latency (on_after / FPS + the stream's median capture-to-answer
             time).
  cost       the stream's answers per second, on the same daemon, in these set-ups,
             `seconds` each, every one between two `none` windows (none A none B
             none, then none B none A none, ...) and compared with their mean:
               none      no alerts, nothing watching
               watched   3 alerts (red, many and "what color is the square ?" match
                         blue) due on every frame (`every: 1`, max_every as the
                         config's default, or --max-every),
                         and the live view page open in a headless chromium over TCP
                         (tests/support/headless_browser.py) at the same time
               old rule  the same, but max_every 1: every alert asked on every frame
                         whether or not the stream keeps up (the rule before
                         spare-capacity scheduling), for comparison
             for a paced source (a camera at FPS) and an unpaced one (synthetic://, as
             fast as the pipeline goes: the stream's prompt and the alerts compete for
             the same cores). Each window also records the process's CPU time per
             answer (the daemon is this process; the browser's CPU is its own process
             tree's, shown apart), and the alerts' evaluations and deferrals over the
             window (GET /v1/alerts). With --no-browser (or no chromium) the view is
             left out. --sources and --setups pick which of them run; --setups may
             also name `view` (the browser, no alerts) and `alerts` (the alerts, no
             browser), the two halves of `watched`, and `remote view` / `remote
             watched`: instead of the browser, the page's requests made by
             tests/support/page_traffic.py in a process of its own (what a page open on
             another computer costs the daemon), alone / with the 3 alerts.

The machine may be shared: the figures are medians over rounds and ratios of runs side
by side. Paste the printed Markdown into docs/BENCHMARKS.md with the command.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from edgemm.config import load_config
from edgemm.engine.runtime import Runtime
from edgemm.model.scenes import make_scene
from bench.bench_view import cpu_s, free_port, tree_cpu_s
from tests.support.daemon_thread import DaemonThread
from tests.support.headless_browser import HeadlessBrowser, find_chromium

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


def daemon_thread(runtime: Runtime) -> DaemonThread:
    """The daemon of every round, with the live view on a TCP port (`.port`) for the browser."""
    port = free_port()
    d = DaemonThread(runtime, {"backend": {"intra_op_threads": 1}, "server": {"tcp_port": port}},
                     prefix="edgemm-alerts-")
    d.port = port
    return d


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
            "deferred": metric(metrics, f'edgemm_alert_deferred_total{{stream="watch",alert="{name}"}}'),
            "evaluations": metric(metrics, f'edgemm_alert_evaluations_total{{stream="watch",alert="{name}"}}'),
            "unknown": metric(metrics, f'edgemm_alert_answers_total{{stream="watch",alert="{name}",reading="unknown"}}'),
        }
    return report


def metric(text: str, start: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(start)), 0.0)


# ---- cost ------------------------------------------------------------------------------------------

SETUPS = ("none", "watched", "old rule")
# the two halves of `watched` (the browser alone, the alerts alone), and the page's requests without
# a browser (tests/support/page_traffic.py: a page open on another computer) alone and with the alerts
EXTRA_SETUPS = ("view", "alerts", "remote view", "remote watched")
REMOTE = ("remote view", "remote watched")


@dataclass
class Window:
    answers_per_s: float
    cpu_ms_per_answer: float  # this process's (the daemon's) CPU over the window, per answer
    browser_cpu: float  # the browser's (or page_traffic's) CPU over the window, share of one core (0 without one)
    questions_per_answer: float  # alert questions asked per answered frame over the window
    deferred_per_answer: float


class PageTrafficProcess:
    """tests/support/page_traffic.py against the daemon's port, in a process of its own (its CPU is not the daemon's)."""

    def __init__(self, port: int):
        tool = Path(__file__).resolve().parent.parent / "tests" / "support" / "page_traffic.py"
        self.process = subprocess.Popen([sys.executable, str(tool), f"http://127.0.0.1:{port}/"])

    def cpu_s(self) -> float:
        return tree_cpu_s(self.process.pid)

    def close(self) -> None:
        if self.process.poll() is not None:  # it failed during the window (it says why): no figure
            raise SystemExit(f"page_traffic.py ended early (exit {self.process.returncode}): the window measured nothing")
        self.process.terminate()
        self.process.wait(WAIT_S)


class ViewInBrowser:
    """The live view page open in headless chromium on `port`, showing stream `stream_id`."""

    def __init__(self, port: int, stream_id: str):
        self.browser = HeadlessBrowser(f"http://127.0.0.1:{port}/")
        check = (f"(c => !!c && c.querySelector('img.frame').naturalWidth > 0 && !!c.querySelector('.answer').textContent)"
                 f"(document.querySelector('[data-stream=\"{stream_id}\"]'))")
        deadline = time.monotonic() + WAIT_S
        while not self.browser.evaluate(check):
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit("the live view showed nothing within 60 s")
            time.sleep(0.05)

    def cpu_s(self) -> float:
        return tree_cpu_s(self.browser.process.pid)

    def close(self) -> None:
        self.browser.close()


def alert_counts(http: httpx.Client, stream_id: str) -> tuple[int, int]:
    rows = [r for r in http.get("/v1/alerts").json()["data"] if r["stream"] == stream_id]
    return sum(r["evaluations"] for r in rows), sum(r["deferred"] for r in rows)


def window(d: DaemonThread, source: str, setup: str, seconds: float, n: int, browser: bool,
           max_every: int | None = None) -> Window:
    floor = {"max_every": 1} if setup == "old rule" else {"max_every": max_every} if max_every else {}
    alerts = {} if setup in ("none", "view", "remote view") else {name: {**alert, "every": 1, **floor} for name, alert in {**ALERTS, **THIRD}.items()}
    stream_id = f"cost{n}"
    spec = {"id": stream_id, "source": source, "prompt": "describe the image", "alerts": alerts}
    me = os.getpid()
    with d.client() as http:
        assert http.post("/v1/streams", json=spec).status_code == 201
        frames = lambda: http.get(f"/v1/streams/{stream_id}").json()["frames"]  # noqa: E731
        while frames() < 3:  # past the start
            time.sleep(0.05)
        view = (PageTrafficProcess(d.port) if setup in REMOTE else
                ViewInBrowser(d.port, stream_id) if browser and setup not in ("none", "alerts") else None)
        try:
            time.sleep(1.0)
            asked0, deferred0 = alert_counts(http, stream_id) if alerts else (0, 0)
            browser0 = view.cpu_s() if view else 0.0
            began, count, cpu0 = time.perf_counter(), frames(), cpu_s(me)
            time.sleep(seconds)
            answered, elapsed, cpu = frames() - count, time.perf_counter() - began, cpu_s(me) - cpu0
            browser_cpu = (view.cpu_s() - browser0) / elapsed if view else 0.0
            asked, deferred = alert_counts(http, stream_id) if alerts else (0, 0)
        finally:
            if view is not None:
                view.close()
        http.delete(f"/v1/streams/{stream_id}")
        # its last frames and questions answered before the next window starts
        while any(http.get("/v1/status").json()["queue"]["depths"].values()):
            time.sleep(0.05)
    time.sleep(0.3)
    per = max(1, answered)
    return Window(answered / elapsed, 1e3 * cpu / per, browser_cpu, (asked - asked0) / per, (deferred - deferred0) / per)


def cost(d: DaemonThread, source: str, seconds: float, rounds: int, browser: bool, counter: list[int],
         setups: tuple[str, ...] = SETUPS, max_every: tuple[int | None, ...] = (None,)) -> dict:
    """`max_every`: one `watched` set-up for each (None: the config's default).

    Every set-up's window runs between two `none` windows (none A none B none …, the set-ups'
    order reversed every other round), and its ratio is taken to the mean of those two: a
    neighbour's load that changes over a minute moves both sides of the ratio alike, where a
    `none` window several set-ups away measured another machine."""
    floored = ("watched", "alerts", "remote watched")  # the set-ups with alerts
    runs = [(f"{setup}, max_every {n}" if setup in floored and n else setup, setup, n)
            for setup in setups if setup != "none" for n in (max_every if setup in floored else (None,))]
    windows: dict[str, list[Window]] = {"none": [], **{label: [] for label, _, _ in runs}}
    bracketed: dict[str, list[float]] = {label: [] for label, _, _ in runs}  # window / mean of its two nones

    def measure(label: str, setup: str, n: int | None, r: int) -> Window:
        counter[0] += 1
        windows[label].append(w := window(d, source, setup, seconds, counter[0], browser, n))
        print(f"{source} round {r + 1} {label}: {w.answers_per_s:.2f} answers/s, {w.cpu_ms_per_answer:.2f} CPU "
              f"ms/answer, {w.questions_per_answer:.2f} alert questions/answer, browser "
              f"{100 * w.browser_cpu:.1f} % of a core", file=sys.stderr, flush=True)
        return w

    before = measure("none", "none", None, 0)  # a round's last none window opens the next round
    for r in range(rounds):
        for label, setup, n in (runs if r % 2 == 0 else runs[::-1]):
            w = measure(label, setup, n, r)
            after = measure("none", "none", None, r)
            bracketed[label].append(w.answers_per_s / max(1e-9, (before.answers_per_s + after.answers_per_s) / 2))
            before = after
    out: dict = {"source": source, "browser": browser, "setups": {}}
    base = {k: statistics.median(getattr(w, k) for w in windows["none"]) for k in ("answers_per_s", "cpu_ms_per_answer")}
    for setup, ws in windows.items():
        row = {}
        for key in ("answers_per_s", "cpu_ms_per_answer", "browser_cpu", "questions_per_answer", "deferred_per_answer"):
            values = [getattr(w, key) for w in ws]
            row[key] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                        "max": round(max(values), 3), "rounds": [round(v, 3) for v in values]}
        row["rate_ratio"] = round(row["answers_per_s"]["median"] / base["answers_per_s"], 3)
        row["cpu_ratio"] = round(row["cpu_ms_per_answer"]["median"] / base["cpu_ms_per_answer"], 3)
        row["rate_ratio_bracketed"] = [round(v, 3) for v in bracketed.get(setup, [1.0] * len(ws))]
        out["setups"][setup] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=600)
    parser.add_argument("--fps", type=float, default=10.0)
    parser.add_argument("--hold", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip", choices=("accuracy", "cost"), action="append", default=[])
    parser.add_argument("--no-browser", action="store_true", help="leave the live view out of the cost rounds")
    parser.add_argument("--max-every", default="", help="the watched alerts' max_every, or several (10,30): one "
                        "set-up each (default: the config's)")
    parser.add_argument("--sources", default="paced,unpaced", help="cost: paced, unpaced or both")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"cost: some of {', '.join(SETUPS)}")
    args = parser.parse_args()
    browser = not args.no_browser and find_chromium() is not None
    if not args.no_browser and not browser:
        print("no chromium on PATH: the cost rounds run without the live view", file=sys.stderr)
    runtime = Runtime(load_config({"backend": {"intra_op_threads": 1}}))
    out: dict = {}
    with daemon_thread(runtime) as d:
        if "accuracy" not in args.skip:
            out["accuracy"] = accuracy(d, args.frames, args.fps, args.hold)
            print(json.dumps(out["accuracy"], indent=1), flush=True)
        if "cost" not in args.skip:
            counter = [0]
            sources = {"paced": f"synthetic://?fps={args.fps:g}", "unpaced": "synthetic://"}
            setups = tuple(args.setups.split(","))
            if "none" not in setups or not set(setups) <= set(SETUPS + EXTRA_SETUPS):
                raise SystemExit(f"--setups: 'none' and any of {', '.join(SETUPS + EXTRA_SETUPS)}")
            floors = tuple(int(n) for n in args.max_every.split(",")) if args.max_every else (None,)
            out["cost"] = [cost(d, sources[name], args.seconds, args.rounds, browser, counter, setups, floors)
                           for name in args.sources.split(",")]
            print(json.dumps(out["cost"], indent=1), flush=True)
    markdown(out, args)


def markdown(out: dict, args) -> None:
    if "accuracy" in out:
        a = out["accuracy"]
        print(f"\nAccuracy: {a['answered']} frames answered of {a['source_frames']} from the source "
              f"({a['dropped']} dropped by the stream), pipeline latency p50 {a['pipeline_latency_ms_p50']} ms, "
              f"bound on_after/fps + latency = {a['bound_s']} s\n")
        print("| alert | precision | recall | ... where the question is well posed (frames) | onsets detected | "
              "delay frames p50 (max) | delay s p50 (max) | within bound | evaluations | deferred | skipped | unknown |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in a["alerts"].items():
            print(f"| {name} | {r['precision']} | {r['recall']} | {r['precision_posed']} / {r['recall_posed']} "
                  f"({r['frames_posed']}) | {r['detected']}/{r['onsets']} | "
                  f"{r['delay_frames_p50']} ({r['delay_frames_max']}) | {r['delay_s_p50']} ({r['delay_s_max']}) | "
                  f"{r['within_bound']}/{r['detected']} | {r['evaluations']:g} | {r['deferred']:g} | {r['skipped']:g} | "
                  f"{r['unknown']:g} |")
    if "cost" in out:
        print("\n| source | set-up | windows | answers/s median (min-max) | vs none | ratio to the two none windows "
              "around it, median (min-max) | CPU ms per answer median (min-max) | vs none | alert questions per answer | "
              "deferred per answer | browser (or page traffic) CPU, % of a core |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in out["cost"]:
            for setup, r in c["setups"].items():
                label = setup if setup in ("none", "alerts", *REMOTE) or c["browser"] else f"{setup} (no browser)"
                per_round = r["rate_ratio_bracketed"]
                rate, cpu = r["answers_per_s"], r["cpu_ms_per_answer"]
                print(f"| `{c['source']}` | {label} | {len(rate['rounds'])} | {rate['median']:.2f} ({rate['min']:.2f}-{rate['max']:.2f}) | "
                      f"{r['rate_ratio']:.3f} | {statistics.median(per_round):.3f} ({min(per_round):.3f}-{max(per_round):.3f}) | "
                      f"{cpu['median']:.2f} ({cpu['min']:.2f}-{cpu['max']:.2f}) | {r['cpu_ratio']:.3f} | "
                      f"{r['questions_per_answer']['median']:.2f} | {r['deferred_per_answer']['median']:.2f} | "
                      f"{100 * r['browser_cpu']['median']:.1f} |")


if __name__ == "__main__":
    main()
