#!/usr/bin/env python3
"""Time each graph of a model folder in every precision present, on this CPU, and keep the
result for `precision: auto` (edgemm.engine.precision_choice).

    python tools/choose_precisions.py MODEL_DIR [--threads N] [--runs 5]

--threads is the intra-op thread count edgemm will run with: `backend.intra_op_threads`, or
where that is 0, all usable cores for `infer` and half of them for `serve` and `stream`
(their encoder and decoder run at once). A measurement holds for that count only: run the
tool once per count you use. It prints the table (median ms per graph and precision, the
choice `auto` will make) and where the measurement was kept. Exit 2 for a bad model folder.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgemm.engine.loading import usable_cpus
from edgemm.engine.precision_choice import format_ms, save_measurement
from edgemm.engine.precision_timing import measure
from edgemm.errors import EdgemmError
from edgemm.model.manifest import load_manifest
from edgemm.model.manifest_types import AUTO_ORDER


def table(measurement, manifest) -> str:
    """One row per graph: each precision's median ms, and the one `auto` takes."""
    precisions = [p for p in dict.fromkeys(p for t in measurement.timings.values() for p in t)]
    lines = ["| graph | " + " | ".join(p for p in precisions) + " | auto takes |",
             "|---" * (len(precisions) + 2) + "|"]
    present = manifest.graph_precisions()
    for component, timings in measurement.timings.items():
        cells = [format_ms(timings[p]["ms"]) if p in timings else "—" for p in precisions]
        chosen = measurement.choose(component, present[component], AUTO_ORDER["onnxruntime"])
        lines.append(f"| {component} | " + " | ".join(cells) + f" | {chosen[0] if chosen else '—'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="intra-op threads edgemm runs with (default: all usable cores)")
    ap.add_argument("--runs", type=int, default=5, help="timed calls per graph and precision (median)")
    args = ap.parse_args()
    if not 1 <= args.threads <= usable_cpus():
        sys.exit(f"error: --threads must be between 1 and the {usable_cpus()} cores this process may use")
    try:
        manifest = load_manifest(args.model)
        measurement = measure(args.model, args.threads, max(1, args.runs),
                              report=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgemmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    print(f"{manifest.name} on {measurement.device}, {measurement.threads} thread"
          f"{'s' if measurement.threads != 1 else ''}, median of {args.runs} ({measurement.measured_at}):\n")
    print(table(measurement, manifest))
    try:
        path = save_measurement(manifest, measurement)
    except OSError as e:  # a read-only or missing home: the table above is still the result
        print(f"error: could not keep the measurement ({e.strerror or e}); set EDGEMM_PRECISIONS to a folder "
              "this user may write (and the service reads)", file=sys.stderr)
        sys.exit(2)
    print(f"\nkept in {path}")


if __name__ == "__main__":
    main()
