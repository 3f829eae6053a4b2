#!/usr/bin/env python3
"""The README's screenshot of the live view: a daemon with two synthetic:// streams (one with two
alerts), the page
in a headless chromium (tests/support/headless_browser.py), a PNG once both streams show a frame.

    python -m tools.dev.live_view_screenshot [--out docs/live-view.png]
"""
from __future__ import annotations

import argparse
import time

from bench.bench_view import Daemon
from edgemm.util.opencv import cv2
from tests.support.headless_browser import HeadlessBrowser

STREAMS = [{"id": "yard", "source": "synthetic://?fps=2&seed=5", "prompt": "what color is the circle ?",
            "max_new_tokens": 3},
           {"id": "door", "source": "synthetic://?fps=2&seed=40", "prompt": "how many shapes are there ?",
            "max_new_tokens": 3,
            "alerts": {"crowd": {"prompt": "how many shapes are there ?", "above": 2, "on_after": 1, "off_after": 1},
                       "red": {"prompt": "what color is the circle ?", "match": "red", "on_after": 1}}}]
SHOWN = ("[...document.querySelectorAll('.card')].length === 2 && [...document.querySelectorAll('.card')]"
         ".every(c => c.querySelector('img.frame').naturalWidth > 0 && c.querySelector('.answer').textContent)"
         " && document.querySelectorAll('.alert').length === 2")


WIDTH, HEIGHT = 1100, 640


def small(path: str) -> None:
    """The synthetic scenes' pixel noise makes a PNG large: 4 bits a channel keep it small, and
    look the same at this size."""
    image = cv2.imread(path)
    cv2.imwrite(path, image & 0xF0, [cv2.IMWRITE_PNG_COMPRESSION, 9])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/live-view.png")
    args = ap.parse_args()
    daemon = Daemon(STREAMS, threads=1)
    try:
        with HeadlessBrowser(f"http://127.0.0.1:{daemon.port}/") as browser:
            browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                         mobile=False)
            deadline = time.monotonic() + 30
            while not browser.evaluate(SHOWN):
                if time.monotonic() > deadline:
                    raise SystemExit("the page did not show both streams within 30 s")
                time.sleep(0.1)
            time.sleep(1.0)  # the status line's first refresh
            browser.screenshot(args.out)
    finally:
        daemon.stop()
    small(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
