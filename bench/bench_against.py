#!/usr/bin/env python3
"""The runtime overhead of this tree and of an earlier commit, side by side.

    python -m bench.bench_against REV [--rounds 3] [--n 50] [--precision fp32]

`bench.py runtime`'s overhead measure (end-to-end `Runtime.infer` minus the time inside
the backend's run calls, median of N requests at the top tier) for the working tree and
for REV, checked out into a temporary git worktree. The two run alternately in fresh
processes, `rounds` times each, so that both see the same phases of a noisy machine. Each
process imports edgemm from its own tree; the model is the built-in one of each tree.
Prints one JSON line per run, then a Markdown table of medians and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# run from the tree's root (-c: the tree, not this one, is first on the path); `bench` is
# bench/bench.py, or tools/bench.py in a tree from before bench/ (its folder then on PYTHONPATH)
RUN = """
import importlib, json
bench = importlib.import_module(%r)
from edgemm.config import load_config
from edgemm.engine.runtime import Runtime
rt = Runtime(load_config({"model": {"path": "models/tiny-vlm", "precision": %r}, "backend": {"intra_op_threads": 1}}))
print(json.dumps(bench.bench_overhead(rt, %d)))
"""


def measure(tree: Path, n: int, precision: str) -> dict:
    env = dict(os.environ)
    if (tree / "bench" / "bench.py").is_file():
        module = "bench.bench"
    else:
        module, env["PYTHONPATH"] = "bench", str(tree / "tools")
    done = subprocess.run([sys.executable, "-c", RUN % (module, precision, n)], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"bench_against: the run in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare against, e.g. 53b3def")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=50, help="requests per run")
    # both trees run the same graphs: fp32 is what every earlier tree has (`auto` is newer and
    # picks the built-in model's _q4 on a CPU, which an older tree does not ship)
    ap.add_argument("--precision", default="fp32", help="model.precision for both trees (default fp32)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgemm-against-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), args.rev],
                       check=True)
        try:
            runs: dict[str, list[dict]] = {args.rev: [], "this tree": []}
            for _ in range(args.rounds):
                for name, tree in ((args.rev, base), ("this tree", ROOT)):
                    result = measure(tree, args.n, args.precision)
                    runs[name].append(result)
                    print(json.dumps({"tree": name, **result}), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)

    def med(name: str, pick) -> float:
        return statistics.median(pick(r) for r in runs[name])

    rows = [("end-to-end infer, ms", lambda r: r["e2e_ms_median"]),
            ("inside backend run calls, ms", lambda r: r["backend_ms_median"]),
            ("runtime overhead, ms", lambda r: r["overhead_ms_median"]),
            ("runtime overhead, % of end-to-end", lambda r: 100 * r["overhead_fraction_median"]),
            *[(f"overhead: {part}, ms", lambda r, p=part: r["overhead_parts_ms_median"][p])
              for part in ("prepare", "encode", "generate", "rest")]]
    print()
    print(f"| measure (median of {args.rounds} runs × {args.n} requests) | {args.rev} | this tree | ratio |")
    print("|---|---|---|---|")
    for label, pick in rows:
        old, new = med(args.rev, pick), med("this tree", pick)
        print(f"| {label} | {old:.3f} | {new:.3f} | {new / old:.2f}× |")


if __name__ == "__main__":
    main()
