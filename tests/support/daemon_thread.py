"""A Daemon in a thread of the tool's own process, on a fresh UNIX socket: what the
benchmarks that talk to a real daemon through its HTTP API (bench_alerts, bench_faults) share."""
from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import httpx

from edgemm.config import load_config
from edgemm.server.daemon import Daemon
from edgemm.engine.runtime import Runtime

WAIT_S = 60.0  # bound on anything that should happen soon


class DaemonThread:
    """A Daemon serving `runtime` in a thread; `config` as edgemm.yaml's, its socket in a
    temporary folder (removed on exit)."""

    def __init__(self, runtime: Runtime, config: dict, prefix: str = "edgemm-bench-"):
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.sock = str(self.folder / "edgemm.sock")
        cfg = load_config({**config, "server": {**config.get("server", {}), "socket": self.sock}})
        self.daemon = Daemon(cfg, runtime=runtime)
        self.thread = threading.Thread(target=self.daemon.run, name="bench-daemon", daemon=True)

    def __enter__(self) -> "DaemonThread":
        self.thread.start()
        if not self.daemon.ready.wait(WAIT_S):
            raise SystemExit("the daemon did not become ready")
        return self

    def __exit__(self, *exc) -> None:
        self.daemon.stop()
        self.thread.join(WAIT_S)
        shutil.rmtree(self.folder, ignore_errors=True)

    def client(self, timeout: float = WAIT_S) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.sock), base_url="http://edgemm", timeout=timeout)

    def metric(self, name: str) -> float:
        """One value of /metrics (NaN if absent)."""
        with self.client() as http:
            for line in http.get("/metrics").text.splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[-1])
        return float("nan")
