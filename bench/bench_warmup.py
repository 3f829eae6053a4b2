#!/usr/bin/env python3
"""`edgemm serve`'s start at real size: this tree against an earlier commit, side by side.

    python -m bench.bench_warmup REV [--model DIR] [--rounds 2]

Each run is a fresh `edgemm serve` process (`python -m edgemm.cli.main serve`) on the model
(default: the SmolVLM-256M-shaped folder of tools/make_sized_model.py, which must be
built) with the default config except: feature cache off, and `server.encoder_batching:
off`, so that the figure is the load and the warm-up (backend.warmup: all) and not the
encoder's batch timing. Measured per run: spawn → the `ready in` line, the process's
peak RSS (VmHWM) and its RSS (VmRSS) at that moment, and the warm-up lines it printed.
REV is checked out into a temporary git worktree; the trees alternate, in a rotating
order, so both see the same phases of a noisy machine. Each process imports edgemm from
its own tree (PYTHONPATH, run outside the repository). Prints one JSON line per run, then
a Markdown table of medians (min–max) for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZED_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgemm" / "sized"
READY_TIMEOUT_S = 1800.0  # the old warm-up of three tiers at real size, on a busy machine


def status_mb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    raise SystemExit(f"no {key} for process {pid}")


def start_once(tree: Path, config: Path, scratch: Path) -> dict:
    """One `edgemm serve` from `tree`, until it says it is ready; then SIGTERM."""
    socket_path = scratch / "edgemm.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGEMM_", "NOTIFY_", "LISTEN_"))}
    env["PYTHONPATH"] = str(tree)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "edgemm.cli.main", "serve", "--config", str(config),
                             "--socket", str(socket_path)], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=scratch)
    lines: list[str] = []
    try:
        for line in proc.stderr:
            lines.append(line.rstrip())
            if " ready in " in line:
                break
            if time.perf_counter() - started > READY_TIMEOUT_S:
                raise SystemExit(f"{tree}: not ready after {READY_TIMEOUT_S:.0f} s")
        else:
            raise SystemExit(f"{tree}: serve ended before it was ready:\n" + "\n".join(lines[-20:]))
        ready_s = time.perf_counter() - started
        peak, rss = status_mb(proc.pid, "VmHWM"), status_mb(proc.pid, "VmRSS")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"ready_s": round(ready_s, 2), "peak_rss_mb": peak, "rss_at_ready_mb": rss,
            "warm_up_lines": [line for line in lines if "warm" in line.replace(str(scratch), "")]}


def spread(values: list[float], unit: str, digits: int = 1) -> str:
    return (f"{round(statistics.median(values), digits)} {unit} "
            f"({round(min(values), digits)}–{round(max(values), digits)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare against, e.g. main")
    ap.add_argument("--model", type=Path, default=SIZED_CACHE / "smolvlm-256m")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not (args.model / "onnx").is_dir():
        raise SystemExit(f"{args.model}: no model folder (python tools/make_sized_model.py smolvlm-256m)")
    with tempfile.TemporaryDirectory(prefix="edgemm-warmup-") as tmp:
        scratch = Path(tmp)
        base = scratch / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), args.rev],
                       check=True)
        config = scratch / "edgemm.yaml"
        config.write_text(json.dumps({"model": {"path": str(args.model.resolve())}, "cache": {"max_bytes": 0},
                                      "server": {"encoder_batching": "off"}}))  # JSON is YAML
        trees = [(args.rev, base), ("this tree", ROOT)]
        runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
        try:
            for round_ in range(args.rounds):
                for name, tree in trees[round_ % 2:] + trees[:round_ % 2]:
                    result = start_once(tree, config, scratch)
                    runs[name].append(result)
                    print(json.dumps({"tree": name, **result}), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print()
    print(f"| `edgemm serve` start, {args.model.name} (median of {args.rounds}, min–max) | spawn → ready "
          "| peak RSS | RSS when ready |")
    print("|---|---|---|---|")
    for name, results in runs.items():
        print(f"| {name} | {spread([r['ready_s'] for r in results], 's')} "
              f"| {spread([r['peak_rss_mb'] for r in results], 'MB', 0)} "
              f"| {spread([r['rss_at_ready_mb'] for r in results], 'MB', 0)} |")


if __name__ == "__main__":
    sys.exit(main())
