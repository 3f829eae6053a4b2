#!/usr/bin/env python3
"""Hostile images against a real `edgemm serve` and `edgemm infer` (issue 17, "limits before work").

    python -m bench.bench_hostile [--model DIR] [--rounds 5]

  memory   one daemon (bench_serve.ServeProcess: the shipped config, server.image_dirs
           a temporary folder, server.max_body_bytes 64 MiB so the image check is what
           refuses), warmed with 3 valid requests; idle = its VmRSS then. For each
           hostile input: VmHWM reset (/proc/PID/clear_refs 5), the request, then VmHWM:
           the peak while it was refused, and its ratio to idle (target ≤ 2). Also
           `edgemm infer FILE` for each file: its peak RSS (VmHWM at exit), next to a
           valid run's.
  latency  the same daemon: a valid POST /v1/infer alone, and the same sent 0.1 s after a
           slow image (a 6000x4000 progressive JPEG at the scan limit) went in; `rounds`
           of each, alternating; medians and their ratio (target: answered within 1 s).
  two_heavy  two 24 MP PNGs (the largest accepted) at once, a valid request 0.3 s
           later: its latency, the heavy ones' statuses, the peak RSS.

Files come from tests/support/hostile_images.py. Results are printed as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tests.support import hostile_images as hostile
from bench.bench_serve import ServeProcess, client
from edgemm.model.image_header import MAX_JPEG_SCANS

PROMPT = "how many shapes are there ?"


def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def hostile_inputs(folder: Path) -> dict[str, dict]:
    """name → {"body": bytes} for /v1/infer, or {"url": ...} for a chat request."""
    fifo = folder / "camera.fifo"
    os.mkfifo(fifo)
    return {
        "TIFF 12000x12000 then 16x16, deflated strip": {"body": hostile.tiff_with_repeated_size(deflated_strip=True)},
        "progressive JPEG 3000x2000, last scan x400": {"body": hostile.progressive_jpeg(2000, 3000, 400, flat=True)},
        "16 MiB of empty JPEG comment segments": {"body": hostile.jpeg_with_comment_run()},
        "6-byte JPEG FF D8 FF FF FF FF": {"body": hostile.SIX_BYTE_JPEG},
        "PNG with a CRC error": {"body": hostile.png_with_bad_crc()},
        "36 MP PNG broken at its end": {"body": hostile.slow_corrupt_png()},
        "file:// URL naming a FIFO": {"url": f"file://{fifo}"},
        # decoded-memory bombs: under the pixel limit, over limits.max_decoded_bytes
        "16-bit RGBA PNG 4000x4000 (65 bytes)": {"body": hostile.png_header_only(4000, 4000)},
        "64-bit float RGB TIFF 4000x3000, cut short": {"body": hostile.tiff_deep()},
        "16-bit RGBA TIFF 4000x4000, cut short": {"body": hostile.tiff_deep(4000, 4000, 16, 4, 1)},
        "animated WebP, 4000x4000 canvas": {"body": hostile.animated_webp_canvas(4000)},
        "RLE8 BMP 4900x4900 (2 KB)": {"body": hostile.bmp_rle8(4900, 4900)},
        "largest accepted: 24 MP RGB PNG (answered)": {"body": big_valid_png()},
    }


def big_valid_png() -> bytes:
    """A 5000x4800 8-bit RGB PNG (24 MP, ~1.5 MB), just within limits.max_decoded_bytes."""
    import numpy as np
    cells = np.random.default_rng(2).integers(0, 256, (600, 625, 3), dtype=np.uint8)
    return hostile.encode(".png", np.repeat(np.repeat(cells, 8, 0), 8, 1), hostile.cv2.IMWRITE_PNG_COMPRESSION, 1)


def chat_body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 2}


def send(sock: str, case: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    with client(sock) as http:
        if "url" in case:
            r = http.post("/v1/chat/completions", json=chat_body(case["url"]))
        else:
            r = http.post("/v1/infer", params={"max_tokens": 2}, content=case["body"])
    return r.status_code, time.perf_counter() - t0


def memory_section(daemon: ServeProcess, cases: dict[str, dict], valid: bytes) -> dict:
    for _ in range(3):
        send(daemon.sock, {"body": valid})
    idle_kb = vm_kb(daemon.proc.pid, "VmRSS")
    rows = {}
    for name, case in cases.items():
        reset_peak(daemon.proc.pid)
        status, seconds = send(daemon.sock, case)
        peak_kb = vm_kb(daemon.proc.pid, "VmHWM")
        rows[name] = {"status": status, "seconds": round(seconds, 3), "peak_mb": round(peak_kb / 1024, 1),
                      "peak_over_idle": round(peak_kb / idle_kb, 3)}
    return {"idle_mb": round(idle_kb / 1024, 1), "cases": rows}


# `edgemm ARGS` in a fresh interpreter that writes its own VmHWM at exit: wait4's
# ru_maxrss would include this (large) process, copied by fork before the exec
PEAK_AT_EXIT = """
import atexit, sys
out, sys.argv = sys.argv[1], ["edgemm", *sys.argv[2:]]
def peak():
    with open("/proc/self/status") as f, open(out, "w") as o:
        o.write(next(l for l in f if l.startswith("VmHWM:")).split()[1])
atexit.register(peak)
from edgemm.cli.main import main
main()
"""


def cli_peak_mb(args: list[str], folder: Path) -> tuple[int, float]:
    out = folder / "peak.kb"
    done = subprocess.run([sys.executable, "-c", PEAK_AT_EXIT, str(out), *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return done.returncode, round(int(out.read_text()) / 1024, 1)


def cli_section(folder: Path, cases: dict[str, dict], valid: bytes) -> dict:
    rows = {}
    good = folder / "valid.png"
    good.write_bytes(valid)
    rows["valid scene PNG (answered)"] = cli_peak_mb(["infer", str(good)], folder)
    for i, (name, case) in enumerate(cases.items()):
        path = Path(case["url"][len("file://"):]) if "url" in case else folder / f"case{i}.img"
        if "body" in case:
            path.write_bytes(case["body"])
        rows[name] = cli_peak_mb(["infer", str(path)], folder)
    return {name: {"exit": code, "peak_mb": mb} for name, (code, mb) in rows.items()}


def latency_section(daemon: ServeProcess, valid: bytes, rounds: int) -> dict:
    slow = hostile.progressive_jpeg(4000, 6000, MAX_JPEG_SCANS - 10, flat=True)  # 24 MP: within max_pixels
    alone, behind, slow_s = [], [], []
    for _ in range(rounds):
        alone.append(send(daemon.sock, {"body": valid})[1])
        out: list = []
        thread = threading.Thread(target=lambda: out.append(send(daemon.sock, {"body": slow})))
        thread.start()
        time.sleep(0.1)
        status, seconds = send(daemon.sock, {"body": valid})
        assert status == 200
        behind.append(seconds)
        thread.join()
        slow_s.append(out[0][1])
    med = statistics.median
    return {"slow_image_bytes": len(slow), "alone_ms": round(med(alone) * 1e3, 1),
            "behind_slow_ms": round(med(behind) * 1e3, 1), "ratio": round(med(behind) / med(alone), 2),
            "slow_image_s": round(med(slow_s), 2), "rounds": rounds}


def two_heavy_section(daemon: ServeProcess, valid: bytes, rounds: int) -> dict:
    """Two of the largest accepted images at once, then a valid small request 0.3 s later:
    its latency, the heavy ones' statuses (the decode budget takes one; the other gets
    503 at once rather than holding the second prepare thread) and the peak RSS."""
    heavy = big_valid_png()
    behind, statuses, peaks = [], [], []
    for _ in range(rounds):
        reset_peak(daemon.proc.pid)
        out: list = []
        threads = [threading.Thread(target=lambda: out.append(send(daemon.sock, {"body": heavy}))) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        status, seconds = send(daemon.sock, {"body": valid})
        assert status == 200
        behind.append(seconds)
        for t in threads:
            t.join()
        statuses.append(sorted(s for s, _ in out))
        peaks.append(vm_kb(daemon.proc.pid, "VmHWM") / 1024)
    med = statistics.median
    return {"small_behind_two_heavy_ms": round(med(behind) * 1e3, 1), "max_ms": round(max(behind) * 1e3, 1),
            "heavy_statuses": statuses, "peak_mb_max": round(max(peaks), 1), "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    valid = (args.model / "samples" / "scene_11.png").read_bytes()
    folder = Path(tempfile.mkdtemp(prefix="edgemm-bh-", dir="/tmp"))
    cases = hostile_inputs(folder)
    daemon = ServeProcess("hostile", args.model, {"image_dirs": [str(folder)], "max_body_bytes": 64 << 20}, 0)
    try:
        daemon.wait_ready()
        result = {"memory": memory_section(daemon, cases, valid), "latency": latency_section(daemon, valid, args.rounds),
                  "two_heavy": two_heavy_section(daemon, valid, args.rounds)}
    finally:
        daemon.stop()
    result["cli"] = cli_section(folder, cases, valid)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
