"""Process memory as the benchmarks report it: VmRSS from /proc (Linux)."""
from __future__ import annotations


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of `pid` (default: this process) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
