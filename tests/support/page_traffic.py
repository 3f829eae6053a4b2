#!/usr/bin/env python3
"""The live view page's requests, without a browser: what a page open on another computer
(an operator's laptop, as the page is meant to be used) asks of the daemon.

    python tests/support/page_traffic.py http://127.0.0.1:PORT/ [--seconds S]

Mirrors edgemm/server/web/index.html: one GET /v1/events?rate=R&frames=jpeg (R = the page's
FRAMES_PER_S, read from the page the daemon serves; each result carries its frame), a stream's
frame.jpg only after a result that came without one, at most R a second, GET /v1/streams every
second, /v1/status and /v1/alerts every 2 seconds. Nothing is drawn. Runs until killed (or `seconds`); prints the requests it made
when it ends, and exits 1 saying why if a request failed (a refused /v1/events measures nothing). bench_alerts.py runs it in a process of its own, so that its CPU is not the
daemon's.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time

import httpx


def page_rate(page: str) -> float:
    """FRAMES_PER_S of the page's text."""
    found = re.search(r"const FRAMES_PER_S = ([0-9.]+)", page)
    if found is None:
        raise SystemExit("page_traffic: the page has no FRAMES_PER_S: keep this tool in step with it")
    return float(found.group(1))


class PageTraffic:
    def __init__(self, base: str):
        self.base = base.rstrip("/")
        self.rate = page_rate(httpx.get(base, timeout=10).text)  # the page the daemon serves
        self.stop = threading.Event()
        self.fresh: set[str] = set()  # streams with a result whose frame is not fetched yet
        self.lock = threading.Lock()
        self.counts = {"events": 0, "frames": 0, "polls": 0}
        self.failed: str | None = None

    def run(self, job) -> None:
        """A job of its own thread; its failure (a refused /v1/events, the daemon gone) ends the tool, said."""
        try:
            job()
        except Exception as e:  # noqa: BLE001 - any of them: what failed is said, the tool stops
            if not self.stop.is_set():
                self.failed = f"page_traffic: {job.__name__}: {type(e).__name__}: {e}"
                self.stop.set()

    def listen(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(10, read=None)) as http, \
                http.stream("GET", f"{self.base}/v1/events?rate={self.rate:g}&frames=jpeg") as events:
            events.raise_for_status()  # a 503 (server.max_stream_listeners): the measure would be of nothing
            for line in events.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: "):
                    record = json.loads(line[6:])
                    self.counts["events"] += 1
                    if "stream" in record and "answer" in record and "jpeg" not in record:
                        with self.lock:
                            self.fresh.add(record["stream"])

    def poll(self) -> None:
        interval, last = 1.0 / self.rate, {"streams": 0.0, "status": 0.0}
        with httpx.Client(base_url=self.base, timeout=10) as http:
            while not self.stop.wait(interval):
                with self.lock:
                    streams, self.fresh = self.fresh, set()
                for stream in streams:
                    http.get(f"/v1/streams/{stream}/frame.jpg")  # 404 once a stream is gone: as the page
                    self.counts["frames"] += 1
                now = time.monotonic()
                if now - last["streams"] >= 1.0:
                    last["streams"] = now
                    http.get("/v1/streams")
                    self.counts["polls"] += 1
                if now - last["status"] >= 2.0:
                    last["status"] = now
                    http.get("/v1/status")
                    http.get("/v1/alerts")
                    self.counts["polls"] += 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the daemon's address, e.g. http://127.0.0.1:8080/")
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: when killed)")
    args = parser.parse_args()
    traffic = PageTraffic(args.base)
    signal.signal(signal.SIGTERM, lambda *_: traffic.stop.set())
    for job in (traffic.listen, traffic.poll):
        threading.Thread(target=traffic.run, args=(job,), daemon=True).start()
    traffic.stop.wait(args.seconds or None)
    print(json.dumps(traffic.counts), file=sys.stderr, flush=True)
    if traffic.failed:
        raise SystemExit(traffic.failed)


if __name__ == "__main__":
    main()
