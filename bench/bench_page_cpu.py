#!/usr/bin/env python3
"""What the live view page costs the browser: headless chromium's CPU, process by process,
on page variants side by side (issue 23: on a 2-core board the browser's CPU is taken from
the stream).

    git show 529eebb:edgemm/server/web/index.html > /tmp/before.html
    python -m bench.bench_page_cpu --rounds 5 before=/tmp/before.html after=edgemm/server/web/index.html \\
        after@hidden=edgemm/server/web/index.html

One daemon in this process (backend.intra_op_threads 1) runs one unpaced `synthetic://`
stream; each round opens a fresh chromium on each variant in turn (the order reversed every
other round), waits `--settle` s, and counts the chromium process tree's CPU over `--window`
s. The page a browser gets is the variant's file (this process's daemon answers GET / with
it). A name ending in `@hidden` is hidden once loaded, as a browser hides a background tab
(headless chromium never hides a page itself: its visibilityState and a visibilitychange
event). Prints each round, then each variant's median (min–max) share of one core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import edgemm.server.liveview
from bench.bench_alerts import daemon_thread
from bench.bench_view import cpu_s
from tests.support.headless_browser import HeadlessBrowser

from edgemm.config import load_config
from edgemm.engine.runtime import Runtime

HIDE = """(() => {
  Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => 'hidden'});
  Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});
  document.dispatchEvent(new Event('visibilitychange')); return 1; })()"""


def process_tree(pid: int) -> dict[int, str]:
    """`pid` and its descendants, each with its chromium process type (browser, renderer, gpu-process, utility)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass
    tree, todo = {}, [pid]
    while todo:
        current = todo.pop()
        try:
            # chromium's helpers rewrite their title: one string, the arguments split by spaces
            args = Path(f"/proc/{current}/cmdline").read_bytes().replace(b"\0", b" ").split()
        except OSError:
            continue
        kind = next((a[7:].decode() for a in args if a.startswith(b"--type=")), "browser")
        tree[current] = kind
        todo.extend(child for child, parent in parents.items() if parent == current)
    return tree


def serve_variants(current: dict) -> None:
    """GET / answers with current["html"]: the page is swapped in this process's daemon."""
    real = edgemm.server.liveview.Response

    def response(content=None, *args, media_type=None, **kwargs):
        if media_type and media_type.startswith("text/html"):
            content = current["html"]
        return real(content, *args, media_type=media_type, **kwargs)

    edgemm.server.liveview.Response = response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=PAGE.html (NAME@hidden: the page hidden once loaded)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured per variant and round")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the page loads before measuring")
    parser.add_argument("--source", default="synthetic://")
    args = parser.parse_args()
    variants = [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1]).read_bytes()) for spec in args.variants]
    current = {"html": variants[0][1]}
    serve_variants(current)
    shares: dict[str, list[float]] = {name: [] for name, _ in variants}
    runtime = Runtime(load_config({"backend": {"intra_op_threads": 1}}))
    with daemon_thread(runtime) as d, d.client() as http:
        http.post("/v1/streams", json={"id": "s", "source": args.source, "prompt": "describe the image"})
        time.sleep(2)
        for round_ in range(args.rounds):
            for name, html in (variants if round_ % 2 == 0 else variants[::-1]):
                current["html"] = html
                with HeadlessBrowser(f"http://127.0.0.1:{d.port}/") as browser:
                    if name.endswith("@hidden"):
                        browser.evaluate(HIDE)
                    time.sleep(args.settle)
                    tree = process_tree(browser.process.pid)
                    before = {pid: cpu_s(pid) for pid in tree}
                    answered = http.get("/v1/streams/s").json()["frames"]
                    began = time.perf_counter()
                    time.sleep(args.window)
                    elapsed = time.perf_counter() - began
                    answered = http.get("/v1/streams/s").json()["frames"] - answered
                    by_kind: dict[str, float] = {}
                    for pid, kind in tree.items():
                        try:
                            by_kind[kind] = by_kind.get(kind, 0.0) + 100 * (cpu_s(pid) - before[pid]) / elapsed
                        except OSError:
                            pass
                total = sum(by_kind.values())
                shares[name].append(total)
                print(f"round {round_} {name:14s} {total:5.1f} % of a core (" +
                      ", ".join(f"{kind} {share:.1f}" for kind, share in sorted(by_kind.items()) if share >= 0.05) +
                      f"); stream {answered / elapsed:.1f} answers/s, load {os.getloadavg()[0]:.1f}", flush=True)
    for name, values in shares.items():
        print(f"{name:14s} median {statistics.median(values):5.1f} % of a core ({min(values):.1f}–{max(values):.1f}), "
              f"{len(values)} rounds")


if __name__ == "__main__":
    main()
