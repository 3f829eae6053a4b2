"""Which precision `auto` gives each graph on the CPU: the fastest measured on this machine.

tools/choose_precisions.py times every precision present for each graph
(edgemm.engine.precision_timing) and keeps the medians here, one small JSON file per
model folder, device and thread count:

    $EDGEMM_PRECISIONS or $XDG_CACHE_HOME/edgemm/precisions (~/.cache/edgemm/precisions)/<key>.json

keyed by every graph file's path, size and mtime, the CPU and the intra-op threads, so a
regraphed folder, another machine or another thread count finds no measurement and `auto`
keeps its fixed order (AUTO_ORDER). A file that cannot be read or parsed counts as none.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime

from edgemm.model.manifest_types import ModelManifest, variant_file
from edgemm.model.quantization import BATCH_DEPENDENT

TOOL = "tools/choose_precisions.py"
# A measured precision replaces the fixed order's (AUTO_ORDER: fewest weight bytes first) only
# where it saves more than this a call: below it the time saved is noise next to a request,
# while the order's pick saves memory (the embedding: q4 is a few times slower than fp32's
# gather, but a fraction of a millisecond, and its table is an eighth the size)
SAVING_MS = 1.0
SAVING_SHARE = 0.05


def precisions_dir() -> Path:
    """$EDGEMM_PRECISIONS, else $XDG_CACHE_HOME/edgemm/precisions (~/.cache/edgemm/precisions).
    A user with no home (a container's uid without a passwd entry) raises OSError: no measurement."""
    if os.environ.get("EDGEMM_PRECISIONS"):
        return Path(os.environ["EDGEMM_PRECISIONS"])
    try:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    except RuntimeError as e:  # Path.home(): no HOME and no passwd entry
        raise OSError(str(e)) from None
    return Path(cache) / "edgemm" / "precisions"


def cpu_identity() -> str:
    """The CPU a measurement holds for: its model name and architecture."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {name or platform.processor() or 'unknown'} ({platform.machine()})"


def graphs_identity(manifest: ModelManifest) -> list[list]:
    """[component, precision, path, size, mtime_ns] for every graph file present."""
    found = []
    for component, precisions in manifest.graph_precisions().items():
        for precision in precisions:
            path = variant_file(manifest.path / manifest.files[component], precision).resolve()
            st = path.stat()
            found.append([component, precision, str(path), st.st_size, st.st_mtime_ns])
    return found


def format_ms(ms: float) -> str:
    """981 ms, 5.64 ms, 0.007 ms: three significant digits, no exponent."""
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


@dataclass
class Measurement:
    """Median milliseconds of each graph in each precision on one device and thread count."""
    device: str
    threads: int
    # component → precision → {"ms": median, "kind": the quantization kind its operators say}
    timings: dict[str, dict[str, dict]] = field(default_factory=dict)
    measured_at: str = ""  # ISO date

    def choose(self, component: str, present: list[str], preferred: tuple[str, ...] = ()) -> tuple[str, str] | None:
        """(precision, why) for `component` among the precisions `present`: the fastest measured,
        never a batch-dependent kind where another is measured; None where none is measured.
        The first of `preferred` measured (AUTO_ORDER: the fewest weight bytes first) stays
        unless the fastest saves more than SAVING_MS and SAVING_SHARE of its time per call."""
        # among what the CPU's order may take (q4, fp32: what the model card vouches for), or, where
        # the folder has none of those, what it has: a measurement changes speed, never accuracy
        allowed = [p for p in present if p in preferred] or present
        measured = {p: t for p, t in self.timings.get(component, {}).items() if p in allowed}
        exact = {p: t for p, t in measured.items() if t.get("kind") not in BATCH_DEPENDENT}
        candidates = exact or measured
        if not candidates:
            return None
        ms = {p: float(t["ms"]) for p, t in candidates.items()}
        best = min(ms, key=ms.get)
        kept = next((p for p in preferred if p in ms), best)
        saving = ms[kept] - ms[best]
        small = saving <= SAVING_MS or saving <= SAVING_SHARE * ms[kept]
        chosen = kept if small else best
        others = [f"{p} {format_ms(t)}" for p, t in sorted(ms.items(), key=lambda i: i[1]) if p != chosen]
        why = f"measured {format_ms(ms[chosen])}" + (f" against {', '.join(others)}" if others else "")
        if small and kept != best:
            why += (f", {best} saving no more than {format_ms(SAVING_MS)} or {SAVING_SHARE:.0%} a call: "
                    f"the order {' > '.join(preferred)} kept")
        return chosen, why + f" ({self.threads} thread{'s' if self.threads != 1 else ''}; {TOOL}, {self.measured_at})"


def cache_file(manifest: ModelManifest, device: str, threads: int) -> Path:
    """The measurement file of this folder's graphs on `device` with `threads` intra-op threads."""
    # the onnxruntime version too: another release's kernels make another measurement
    key = json.dumps([graphs_identity(manifest), device, threads, onnxruntime.__version__])
    return precisions_dir() / f"{manifest.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load_measurement(manifest: ModelManifest, device: str, threads: int) -> Measurement | None:
    """The measurement kept for this folder, device and threads; None if absent or unreadable."""
    try:
        data = json.loads(cache_file(manifest, device, threads).read_text())
        measurement = Measurement(data["device"], int(data["threads"]), data["timings"], str(data["measured_at"]))
        if measurement.device != device or measurement.threads != threads:
            return None
        for component in measurement.timings.values():  # every entry usable by choose()
            for timing in component.values():
                if not (math.isfinite(float(timing["ms"])) and float(timing["ms"]) >= 0):
                    return None
        return measurement
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_measurement(manifest: ModelManifest, measurement: Measurement) -> Path:
    """Write it atomically (a reader sees the old file or the new one, never half)."""
    path = cache_file(manifest, measurement.device, measurement.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"model": str(manifest.path.resolve()), "device": measurement.device, "threads": measurement.threads,
            "measured_at": measurement.measured_at, "timings": measurement.timings}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

