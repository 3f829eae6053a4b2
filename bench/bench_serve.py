#!/usr/bin/env python3
"""`edgemm serve` benchmarks: real daemons on temporary UNIX sockets, real HTTP clients.

    python -m bench.bench_serve [--model DIR] [--rounds 3] [--requests 64]
                                [--clients 8] [--burst 64] [--overhead-n 100] [--threads 0]

Every daemon is `edgemm serve --config TMP.yaml --socket TMP.sock` as a subprocess (the
console script next to sys.executable), waited for on /readyz and stopped with SIGTERM.
Every request body is a PNG of a generated scene (edgemm.model.scenes.make_scene, a distinct
seed per request, so the feature cache never answers for the encoder), sent with the
prompt "how many shapes are there ?" (batching: also "describe the image"). The config is the shipped default except for
the keys named below; backend.intra_op_threads is onnxruntime's choice (0) unless
--threads says otherwise. Clients are threads of this process, each with its own
httpx.Client over the UNIX socket, so they share the machine's cores with the daemon.

  batching   throughput (requests/s) and P50/P99 latency of POST /v1/infer with
             `clients` concurrent clients: dynamic batching (server.max_batch=8,
             batch_timeout_ms=5) with server.continuous_batching auto (the default),
             on (requests join a decoding batch between tokens) and off (they wait
             for it to end), vs batch size 1 (max_batch=1); all four daemons running,
             rounds in the order A B C D, D C B A, …, `requests` requests per round;
             ratios of the median
             throughputs. server.queue_size = clients, so none is refused. Run for a
             one-word answer (count) and a description (describe). The batched
             daemons keep server.encoder_batching at its default, auto. Also the
             cores each side used while a round ran (CPU time / wall time, from
             /proc): the clients share the machine with the daemon.
  ceiling    per prompt, before any daemon starts, in this process on one thread:
             the pipeline's work per request alone and with every call carrying 8
             requests (see batching_ceiling): the most batching can shrink it here.
  overload   bursts of `burst` concurrent POST /v1/infer (connections opened first, then
             released together) at a daemon with server.queue_size=2, `rounds` times with
             httpx clients and `rounds` times with raw-socket clients (prebuilt request
             bytes, so the client process's own Python work barely counts): statuses, P50/P99
             of the 503s' response time as each client measured it, and as the daemon's
             /v1/infer duration histogram bounds it; no 5xx other than 503; daemon RSS
             before/after. server.max_connections = burst + 16, so the 503s are the
             admission's (the connection cap answers 503 too, code "over_capacity"; they
             are told apart by body and counted separately).
  idle/api   daemon RSS after warm-up with no request yet (VmRSS of the process), and
             API overhead: per request, the client's round trip minus the pipeline's own
             time (timings_ms.total: submit → answer, in the `edgemm` field of
             /v1/chat/completions, at top level for /v1/infer); median over `overhead-n`
             sequential requests per endpoint, on the default batched and the batch-1 daemons, each
             request with its own image; GET /healthz round trips beside them are the
             floor of one HTTP exchange between the two processes. /v1/infer is timed
             twice: with httpx (what the openai client uses) and with the standard
             library's http.client on a kept-alive UNIX socket ("infer_raw"), whose own
             Python work is small, so it shows the socket round trip more nearly.

    python -m bench.bench_serve --mode stalled [--stalled 200] [--rounds 3] [--requests 64]

  stalled    valid requests while `stalled` connections stay open without finishing a
             request (half of them half a request line, half nothing; one the daemon
             closes is opened again 1 s later): median latency of GET /healthz and POST
             /v1/infer, each on a fresh connection, against the same daemon unloaded, in
             alternating rounds; on the shipped defaults (max_connections 64: the cap
             makes room) and with max_connections 256 (all stalled ones held). Target:
             median at most 50 ms above unloaded.
Paste the printed Markdown into docs/BENCHMARKS.md together with the command.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path

import cv2
import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent

from edgemm.config import load_config  # noqa: E402
from edgemm.engine.runtime import Runtime  # noqa: E402
from edgemm.model.scenes import make_scene  # noqa: E402
from bench.procstat import rss_mb

PROMPT = "how many shapes are there ?"
# batching is measured for a one-word answer (encoder and prefill bound) and a description
# (about 12 tokens: the decoder's steps, which batch best, dominate)
BATCH_PROMPTS = {"count": PROMPT, "describe": "describe the image"}
SEED_BASE = 600_000  # scenes of this benchmark (other benchmarks use 300 000, 450 000)
CLIENTS = 8
BURST = 64
OVERHEAD_N = 100
BATCH_TIMEOUT_MS = 5.0
SMALL_QUEUE = 2
READY_TIMEOUT_S = 180.0  # model load + warm-up, on a busy machine
CLIENT_TIMEOUT_S = 120.0  # per request; the daemon's own request_timeout_s is 60 s


# ---- request bodies ------------------------------------------------------------------------

class Scenes:
    """PNG bytes of generated scenes, a fresh seed for every body handed out."""

    def __init__(self, base: int = SEED_BASE):
        self.next = base

    def take(self, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            rgb = make_scene(self.next).image
            ok, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
            assert ok, "cv2.imencode failed"
            out.append(png.tobytes())
            self.next += 1
        return out


def chat_body(png: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


# ---- a daemon as a subprocess --------------------------------------------------------------

def edgemm_command() -> list[str]:
    exe = shutil.which("edgemm", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "edgemm.cli.main"]


def client(sock: str, timeout: float = CLIENT_TIMEOUT_S) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://edgemm", timeout=timeout)


class ServeProcess:
    """`edgemm serve` on a fresh socket in a short temporary folder; log in that folder."""

    def __init__(self, name: str, model: Path, server: dict, threads: int):
        self.name = name
        self.folder = Path(tempfile.mkdtemp(prefix="edgemm-bs-", dir="/tmp"))  # sun_path ≤ 107 bytes
        self.sock = str(self.folder / "edgemm.sock")
        self.config = {"model": {"path": str(model.resolve())}, "backend": {"intra_op_threads": threads},
                       "server": dict(server)}
        config_path = self.folder / "edgemm.yaml"
        config_path.write_text(yaml.safe_dump(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGEMM_", "LISTEN_", "NOTIFY_", "WATCHDOG_"))}
        self.log = open(self.folder / "serve.log", "wb")
        self.proc = subprocess.Popen([*edgemm_command(), "serve", "--config", str(config_path), "--socket", self.sock],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.exit_code: int | None = None

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        text = (self.folder / "serve.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds from spawn to /readyz 200."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError), client(self.sock, timeout=2) as http:
                if http.get("/readyz").status_code == 200:
                    return time.perf_counter() - t0
            time.sleep(0.1)
        raise SystemExit(f"daemon {self.name} not ready within {timeout} s:\n{self.log_tail()}")

    def rss_mb(self) -> float:
        return round(rss_mb(self.proc.pid), 1)

    def metrics(self) -> str:
        with client(self.sock, timeout=10) as http:
            return http.get("/metrics").text

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no request is in flight (admitted ones finish after their client got a 503 burst)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if metric(self.metrics(), "edgemm_requests_in_flight") == 0:
                return
            time.sleep(0.05)
        raise SystemExit(f"daemon {self.name} still busy after {timeout} s")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; SIGKILL only if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.exit_code = self.proc.returncode
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.exit_code


@contextlib.contextmanager
def daemons(*specs: tuple[str, dict], model: Path, threads: int):
    """Start all, wait until all are ready (they load at the same time), stop all at the end."""
    started: list[ServeProcess] = []
    try:
        for name, server in specs:
            started.append(ServeProcess(name, model, server, threads))
        for d in started:
            d.wait_ready()
        yield started
    finally:
        for d in started:
            d.stop()


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"no sample {line_start!r} in /metrics")


def encoder_batches(text: str) -> Counter:
    """edgemm_encoder_recent_batches: batch size → encoder calls among the last 1000."""
    out: Counter = Counter()
    for line in text.splitlines():
        if line.startswith('edgemm_encoder_recent_batches{size="'):
            size = int(line.split('"')[1])
            out[size] = int(float(line.rsplit(" ", 1)[1]))
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc/PID/stat."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decoder_steps(text: str) -> Counter:
    """edgemm_decoder_steps_total: rows stepped together → decoder calls, ever."""
    out: Counter = Counter()
    for line in text.splitlines():
        if line.startswith('edgemm_decoder_steps_total{rows="'):
            out[int(line.split('"')[1])] = int(float(line.rsplit(" ", 1)[1]))
    return out


# ---- clients ---------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


def post_infer(http: httpx.Client, png: bytes, prompt: str = PROMPT) -> dict:
    """One POST /v1/infer: status (or the transport error), client time, where a 503 came from."""
    t0 = time.perf_counter()
    try:
        r = http.post("/v1/infer", params={"prompt": prompt}, content=png,
                      headers={"Content-Type": "image/png"})
    except httpx.TransportError as e:
        return {"status": f"transport:{type(e).__name__}", "ms": (time.perf_counter() - t0) * 1e3}
    ms = (time.perf_counter() - t0) * 1e3
    out = {"status": r.status_code, "ms": ms}
    if r.status_code == 503:
        try:
            kind = refused_by(r.json()["error"])  # edgemm's: OpenAI error shape, type "overloaded"
        except (ValueError, KeyError, TypeError):
            kind = "uvicorn:" + r.text[:40]  # uvicorn's limit_concurrency: plain text
        out["refused_by"] = kind
        out["retry_after"] = r.headers.get("retry-after")
    return out


def refused_by(error: dict) -> str:
    """Who refused: the admission ("overloaded") or the connection cap ("overloaded:over_capacity")."""
    return error["type"] + (":over_capacity" if error.get("code") == "over_capacity" else "")


def launch(threads: list[threading.Thread], start: threading.Barrier, failures: list, who: str) -> None:
    """Start the client threads and wait until all are connected (they meet at `start`)."""
    for t in threads:
        t.start()
    try:
        start.wait(60)
    except threading.BrokenBarrierError:
        for t in threads:
            t.join(10)
        raise SystemExit(f"{who} could not connect: {failures[:3]}") from None


def concurrent_requests(sock: str, bodies: list[bytes], clients: int,
                        prompt: str = PROMPT) -> tuple[list[dict], float]:
    """`clients` threads with their own connection share `bodies` (each one request, in order
    taken); all connect first, then start together. Returns the records and the wall time."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for b in bodies:
        work.put(b)
    records: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    ends: list[float] = []

    failures: list[str] = []

    def worker() -> None:
        with client(sock) as http:
            try:
                http.get("/healthz")  # the connection is open before the clock starts
                start.wait(60)
            except (httpx.HTTPError, threading.BrokenBarrierError) as e:
                failures.append(f"{type(e).__name__}: {e}")
                start.abort()
                return
            while True:
                try:
                    body = work.get_nowait()
                except queue.Empty:
                    break
                record = post_infer(http, body, prompt)
                with lock:
                    records.append(record)
            with lock:
                ends.append(time.perf_counter())

    threads = [threading.Thread(target=worker, name=f"client-{i}", daemon=True) for i in range(clients)]
    launch(threads, start, failures, "clients")
    t0 = time.perf_counter()
    for t in threads:
        t.join(CLIENT_TIMEOUT_S * (len(bodies) // clients + 2))
    if any(t.is_alive() for t in threads) or len(records) != len(bodies):
        raise SystemExit(f"clients did not finish: {len(records)}/{len(bodies)} answered")
    return records, max(ends) - t0


def burst(sock: str, bodies: list[bytes]) -> list[dict]:
    """One httpx request per thread, all released at once on already open connections."""
    records, _ = concurrent_requests(sock, bodies, len(bodies))
    return records


def raw_exchange(conn: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request, read one response (Content-Length framed, or up to EOF)."""
    conn.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            raise ConnectionError("connection closed before the response headers")
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        piece = conn.recv(65536)
        if not piece:
            break
        body += piece
    return int(lines[0].split()[1]), headers, body


def raw_burst(sock: str, bodies: list[bytes]) -> list[dict]:
    """As `burst`, with plain sockets and prebuilt request bytes: a thread does little more
    than send and receive (the GIL is free meanwhile), so the times are the daemon's more
    than this process's 64 threads taking turns in httpx."""
    query = "/v1/infer?" + urllib.parse.urlencode({"prompt": PROMPT})
    requests = [(f"POST {query} HTTP/1.1\r\nHost: edgemm\r\nContent-Type: image/png\r\n"
                 f"Content-Length: {len(png)}\r\n\r\n").encode() + png for png in bodies]
    records: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(bodies) + 1)

    def worker(request: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(CLIENT_TIMEOUT_S)
            try:
                conn.connect(sock)
                status, _, _ = raw_exchange(conn, b"GET /healthz HTTP/1.1\r\nHost: edgemm\r\n\r\n")
                assert status == 200, status
                start.wait(60)
            except (OSError, AssertionError, threading.BrokenBarrierError) as e:
                failures.append(f"{type(e).__name__}: {e}")
                start.abort()
                return
            t0 = time.perf_counter()
            try:
                status, headers, body = raw_exchange(conn, request)
            except OSError as e:
                record = {"status": f"transport:{type(e).__name__}", "ms": (time.perf_counter() - t0) * 1e3}
            else:
                record = {"status": status, "ms": (time.perf_counter() - t0) * 1e3}
                if status == 503:
                    try:
                        record["refused_by"] = refused_by(json.loads(body)["error"])
                    except (ValueError, KeyError, TypeError):
                        record["refused_by"] = "uvicorn:" + body[:40].decode("latin-1")
                    record["retry_after"] = headers.get("retry-after")
            with lock:
                records.append(record)

    threads = [threading.Thread(target=worker, args=(r,), name=f"raw-{i}", daemon=True)
               for i, r in enumerate(requests)]
    launch(threads, start, failures, "raw clients")
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 10)
    if any(t.is_alive() for t in threads) or len(records) != len(bodies):
        raise SystemExit(f"raw clients did not finish: {len(records)}/{len(bodies)} answered")
    return records


# ---- the sections ------------------------------------------------------------------------------

def bench_batching(pair: dict[str, ServeProcess], scenes: Scenes, rounds: int, requests: int,
                   clients: int, prompt: str = PROMPT) -> dict:
    names = list(pair)
    for name in names:  # untimed: first runs of every batch shape, connections, allocator
        concurrent_requests(pair[name].sock, scenes.take(2 * clients), clients, prompt)
    before = {name: encoder_batches(pair[name].metrics()) for name in names}
    decode_before = {name: decoder_steps(pair[name].metrics()) for name in names}
    rps: dict[str, list[float]] = {n: [] for n in names}
    lat: dict[str, list[float]] = {n: [] for n in names}
    statuses: dict[str, Counter] = {n: Counter() for n in names}
    cpu: dict[str, list[tuple[float, float]]] = {n: [] for n in names}  # (clients, daemon) cores in use
    order = []
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):  # A B C D, D C B A, A B C D, …
            bodies = scenes.take(requests)
            cpu_before = process_cpu_seconds(os.getpid()), process_cpu_seconds(pair[name].proc.pid)
            records, wall = concurrent_requests(pair[name].sock, bodies, clients, prompt)
            cpu[name].append(((process_cpu_seconds(os.getpid()) - cpu_before[0]) / wall,
                              (process_cpu_seconds(pair[name].proc.pid) - cpu_before[1]) / wall))
            statuses[name].update(str(x["status"]) for x in records)
            ok = [x["ms"] for x in records if x["status"] == 200]
            lat[name] += ok
            rps[name].append(len(ok) / wall)
            order.append(name)
    out: dict = {"prompt": prompt, "clients": clients, "rounds": rounds, "requests_per_round": requests,
                 "order": order}
    for name in names:
        decode_steps = decoder_steps(pair[name].metrics()) - decode_before[name]
        after = encoder_batches(pair[name].metrics())
        calls = after - before[name]
        window_full = sum(after.values()) >= 1000  # the gauge covers the last 1000 calls only
        images = sum(size * n for size, n in calls.items())
        out[name] = {
            "server": {k: v for k, v in pair[name].config["server"].items() if k != "socket"},
            "rps_per_round": [round(x, 2) for x in rps[name]],
            "rps_median": round(statistics.median(rps[name]), 2),
            "p50_ms": round(percentile(lat[name], 50), 1), "p99_ms": round(percentile(lat[name], 99), 1),
            "statuses": dict(statuses[name]),
            "encoder_batches": {str(k): v for k, v in sorted(calls.items())},
            "mean_encoder_batch": None if window_full or not calls else round(images / sum(calls.values()), 2),
            # rows per decoder step call (prefills not counted)
            "mean_decoder_batch": round(sum(k * v for k, v in decode_steps.items())
                                        / max(1, sum(decode_steps.values())), 2),
            # CPU time over wall time while the round ran: the clients (this process) and the daemon
            "cores_used_clients": round(statistics.median(c for c, _ in cpu[name]), 2),
            "cores_used_daemon": round(statistics.median(d for _, d in cpu[name]), 2),
        }
    base = out[names[-1]]  # the last daemon is the baseline (batch size 1)
    out["ratios"] = {name: {"throughput": round(out[name]["rps_median"] / base["rps_median"], 3),
                            "p50": round(out[name]["p50_ms"] / base["p50_ms"], 3),
                            "p99": round(out[name]["p99_ms"] / base["p99_ms"], 3)} for name in names[:-1]}
    return out


def batching_ceiling(rt: Runtime, prompt: str, batch: int = 8, groups: int = 3) -> dict:
    """The most dynamic batching of `batch` can give on this machine for `prompt`: the
    pipeline's work per request timed in this process on one thread (prepare; encoder;
    decoder: prefill and every step), alone and with every call carrying `batch` requests
    (one encoder call on `batch` images; generate_batch on `batch` requests). The encoder
    counts as batched only where server.encoder_batching: auto would batch it (at least
    ENCODER_BATCH_GAIN faster per image). HTTP, JSON and the hand-offs between threads are
    left out (they do not batch), so the daemon's real ceiling is lower still.
    Returns per-request medians over `groups` groups of `batch` new scenes."""
    from edgemm.engine.decode import BatchItem, generate, generate_batch
    from edgemm.engine.batching import ENCODER_BATCH_GAIN

    gen = rt.generator  # its graphs directly: the runtime's feature cache would answer the second encode
    scenes = Scenes(SEED_BASE + 900_000)
    parts: dict[str, list[float]] = {k: [] for k in ("prepare", "encoder", "decoder", "encoder_batched",
                                                     "decoder_batched")}
    for g in range(groups + 1):  # the first group only warms up every shape
        bodies = scenes.take(batch)
        t0 = time.perf_counter()
        prepared = [rt.prepare(png, prompt) for png in bodies]
        prepare_ms = (time.perf_counter() - t0) * 1e3 / batch
        pixels = [p.pixel_values for p in prepared]
        if len({x.shape for x in pixels}) != 1:
            raise SystemExit("batching ceiling: the scheduler chose different tiers within a group")
        t0 = time.perf_counter()
        features = [gen.encode(x) for x in pixels]
        encoder_ms = (time.perf_counter() - t0) * 1e3 / batch
        t0 = time.perf_counter()
        gen.encode(np.concatenate(pixels))
        encoder_batched_ms = (time.perf_counter() - t0) * 1e3 / batch
        items = [BatchItem(f, p.prompt.input_ids, p.prompt.image_positions, p.options)
                 for f, p in zip(features, prepared)]
        t0 = time.perf_counter()
        alone = [generate(gen, i) for i in items]
        decoder_ms = (time.perf_counter() - t0) * 1e3 / batch
        t0 = time.perf_counter()
        together = generate_batch(gen, items)
        decoder_batched_ms = (time.perf_counter() - t0) * 1e3 / batch
        if [a.tokens for a in alone] != [t.tokens for t in together]:
            raise SystemExit("batching ceiling: batched decoding changed an answer")
        if g:
            for key, value in zip(parts, (prepare_ms, encoder_ms, decoder_ms, encoder_batched_ms,
                                          decoder_batched_ms)):
                parts[key].append(value)
    ms = {k: round(statistics.median(v), 3) for k, v in parts.items()}
    encoder_gain = ms["encoder"] / ms["encoder_batched"]
    encoder_used = ms["encoder_batched"] if encoder_gain >= ENCODER_BATCH_GAIN else ms["encoder"]
    alone_ms = ms["prepare"] + ms["encoder"] + ms["decoder"]
    batched_ms = ms["prepare"] + encoder_used + ms["decoder_batched"]
    return {"prompt": prompt, "batch": batch, "groups": groups, "tier": prepared[0].tier.name,
            "tokens_mean": round(statistics.fmean(len(a.tokens) for a in alone), 1), "per_request_ms": ms,
            "encoder_gain": round(encoder_gain, 2), "encoder_batched": encoder_used != ms["encoder"],
            "decoder_gain": round(ms["decoder"] / ms["decoder_batched"], 2),
            "ceiling": round(alone_ms / batched_ms, 3)}


class UnixHTTPConnection(http.client.HTTPConnection):
    """The standard library's HTTP/1.1 client (keep-alive) over a UNIX socket."""

    def __init__(self, unix_path: str, timeout: float = CLIENT_TIMEOUT_S):
        super().__init__("edgemm", timeout=timeout)
        self.unix_path = unix_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def bench_overhead(pair: dict[str, ServeProcess], scenes: Scenes, n: int) -> dict:
    """Sequential requests, endpoints and daemons interleaved: round trip − pipeline total.

    Every request has its own image (a repeated one would be answered by the feature cache,
    shortening the pipeline, not the API); the JSON body is serialised before the clock
    starts. GET /healthz round trips, interleaved the same way, give the floor of an HTTP
    exchange between these two processes on this machine.
    """
    names = list(pair)
    endpoints = ("chat", "infer", "infer_raw", "healthz")
    rows = {(name, ep): {"rtt": [], "pipeline": [], "overhead": []} for name in names for ep in endpoints}
    clients = {name: client(pair[name].sock) for name in names}
    lean = {name: UnixHTTPConnection(pair[name].sock) for name in names}
    infer_path = "/v1/infer?" + urllib.parse.urlencode({"prompt": PROMPT})
    json_headers = {"Content-Type": "application/json"}
    png_headers = {"Content-Type": "image/png"}

    def timed(http: httpx.Client, ep: str, png: bytes, conn: UnixHTTPConnection) -> tuple[float, float | None]:
        body = json.dumps(chat_body(png)).encode() if ep == "chat" else png
        t0 = time.perf_counter()
        if ep == "infer_raw":
            conn.request("POST", infer_path, body=body, headers=png_headers)
            reply = conn.getresponse()
            data = reply.read()
            rtt = (time.perf_counter() - t0) * 1e3
            if reply.status != 200:
                raise RuntimeError(f"/v1/infer answered {reply.status}: {data[:200]!r}")
            return rtt, json.loads(data)["timings_ms"]["total"]
        if ep == "chat":
            r = http.post("/v1/chat/completions", content=body, headers=json_headers)
        elif ep == "infer":
            r = http.post("/v1/infer", params={"prompt": PROMPT}, content=body, headers=png_headers)
        else:
            r = http.get("/healthz")
        rtt = (time.perf_counter() - t0) * 1e3
        r.raise_for_status()
        if ep == "healthz":
            return rtt, None
        payload = r.json()
        return rtt, (payload["edgemm"] if ep == "chat" else payload)["timings_ms"]["total"]

    try:
        for name in names:  # one of each, untimed
            for ep in endpoints:
                timed(clients[name], ep, scenes.take(1)[0] if ep != "healthz" else b"", lean[name])
        before = {name: duration_sums(pair[name].metrics()) for name in names}
        for _ in range(n):
            for name in names:
                for ep in endpoints:
                    rtt, total = timed(clients[name], ep, scenes.take(1)[0] if ep != "healthz" else b"",
                                       lean[name])
                    row = rows[(name, ep)]
                    row["rtt"].append(rtt)
                    if total is not None:
                        row["pipeline"].append(total)
                        row["overhead"].append(rtt - total)
        after = {name: duration_sums(pair[name].metrics()) for name in names}
    finally:
        for client in clients.values():
            client.close()
        for conn in lean.values():
            conn.close()
    out: dict = {"requests": n}
    paths = {"chat": "/v1/chat/completions", "infer": "/v1/infer", "healthz": "/healthz"}
    for (name, ep), row in rows.items():
        x = out.setdefault(name, {})[ep] = {"rtt_ms_median": round(statistics.median(row["rtt"]), 2)}
        if ep == "infer_raw":  # shares /v1/infer's duration histogram with the httpx requests: no means
            x.update(pipeline_ms_median=round(statistics.median(row["pipeline"]), 2),
                     overhead_ms_median=round(statistics.median(row["overhead"]), 3),
                     overhead_ms_p90=round(percentile(row["overhead"], 90), 3))
            continue
        if row["overhead"]:
            x.update(pipeline_ms_median=round(statistics.median(row["pipeline"]), 2),
                     overhead_ms_median=round(statistics.median(row["overhead"]), 3),
                     overhead_ms_p90=round(percentile(row["overhead"], 90), 3))
        # where the time goes, in means: the daemon's own duration of the request (its ASGI app,
        # from the parsed request to the last byte handed to uvicorn) against the round trip
        # and the pipeline; (round trip − daemon) is the client, the socket and uvicorn's parsing
        # (/v1/infer's histogram counts both of its clients' requests: the daemon's mean is over both)
        (s0, c0), (s1, c1) = before[name].get(paths[ep], (0.0, 0)), after[name].get(paths[ep], (0.0, 0))
        sent = len(row["rtt"]) + (len(rows[(name, "infer_raw")]["rtt"]) if ep == "infer" else 0)
        if c1 - c0 == sent:
            x["means_ms"] = {"rtt": round(statistics.fmean(row["rtt"]), 2),
                             "daemon": round((s1 - s0) / (c1 - c0) * 1e3, 2)}
            if row["pipeline"]:
                x["means_ms"]["pipeline"] = round(statistics.fmean(row["pipeline"]), 2)
    return out


def duration_sums(text: str) -> dict[str, tuple[float, int]]:
    """The daemon's request-duration histogram: endpoint → (sum in seconds, count)."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        for field, i in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("edgemm_http_request_duration_seconds" + field):
                endpoint = line.split('endpoint="')[1].split('"')[0]
                out.setdefault(endpoint, [0.0, 0])[i] = float(line.rsplit(" ", 1)[1])
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def infer_buckets(text: str) -> dict[str, float]:
    """The daemon's own /v1/infer duration histogram: le → cumulative count."""
    prefix = 'edgemm_http_request_duration_seconds_bucket{endpoint="/v1/infer",le="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def burst_stats(records: list[dict]) -> dict:
    statuses = Counter(str(r["status"]) for r in records)
    refused = [r for r in records if r["status"] == 503]
    ms_503 = [r["ms"] for r in refused]
    ms_200 = [r["ms"] for r in records if r["status"] == 200]
    return {"statuses": dict(statuses), "refused_by": dict(Counter(r["refused_by"] for r in refused)),
            "retry_after_on_all_503": all(r.get("retry_after") for r in refused),
            "p50_503_ms": round(percentile(ms_503, 50), 2), "p99_503_ms": round(percentile(ms_503, 99), 2),
            "max_503_ms": round(max(ms_503), 2) if ms_503 else None,
            "p50_200_ms": round(percentile(ms_200, 50), 1) if ms_200 else None,
            "other_5xx": {s: n for s, n in statuses.items() if s.isdigit() and 500 <= int(s) < 600 and s != "503"},
            "transport_errors": sum(n for s, n in statuses.items() if s.startswith("transport:"))}


def bench_overload(model: Path, scenes: Scenes, bursts: int, size: int, threads: int) -> dict:
    """`bursts` rounds of one httpx burst and one raw-socket burst (order alternated)."""
    server = {"queue_size": SMALL_QUEUE, "max_batch": 8, "batch_timeout_ms": BATCH_TIMEOUT_MS,
              "max_connections": size + 16}
    kinds = {"httpx": burst, "raw": raw_burst}
    with daemons(("small_queue", server), model=model, threads=threads) as (d,):
        for png in scenes.take(2):  # warm-up, so "before" is a daemon that has answered
            with client(d.sock) as http:
                http.post("/v1/infer", params={"prompt": PROMPT}, content=png).raise_for_status()
        rss = [d.rss_mb()]
        buckets_before = infer_buckets(d.metrics())
        records: dict[str, list[dict]] = {k: [] for k in kinds}
        for r in range(bursts):
            for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                records[kind] += kinds[kind](d.sock, scenes.take(size))
                d.wait_idle()
                rss.append(d.rss_mb())
        stats = d.metrics()
        buckets = infer_buckets(stats)
        refused_metric = sum(float(line.rsplit(" ", 1)[1]) for line in stats.splitlines()
                             if line.startswith("edgemm_http_requests_total{") and 'status="503"' in line)
    # the daemon's own durations of all bursts' /v1/infer responses (refused and answered):
    # le (ms) → how many took at most that long. Its clock starts once uvicorn has parsed the
    # request, so the wait for the event loop in a burst is not in it.
    server_le = {str(round(float(le) * 1e3)): int(buckets[le] - buckets_before.get(le, 0))
                 for le in ("0.005", "0.01", "0.025", "0.05", "0.1") if le in buckets}
    n_refused = sum(r["status"] == 503 for rs in records.values() for r in rs)
    # an upper bound of the 503s' P99 as the daemon timed them: the first bucket holding 99 %
    # of them (valid while no answered request is that fast, as p50_200_ms shows)
    server_p99 = next((int(le) for le, n in server_le.items() if n_refused and n >= 0.99 * n_refused), None)
    return {"server": server, "bursts_per_client_kind": bursts, "burst_size": size,
            **{kind: burst_stats(rs) for kind, rs in records.items()},
            "refused_in_metrics": int(refused_metric),
            "server_side_le_ms": server_le, "server_side_p99_503_at_most_ms": server_p99,
            "rss_mb_before": rss[0], "rss_mb_after_each_burst": rss[1:],
            "rss_growth_mb": round(rss[-1] - rss[0], 1), "daemon_exit_code": d.exit_code}


# ---- stalled connections (--mode stalled) --------------------------------------------------

HALF_REQUEST_LINE = b"POST /v1/chat/completions HT"


class StallKeeper:
    """`n` connections that never finish a request: odd ones send half a request line, even
    ones nothing. One the daemon closes is opened again `reconnect_s` later, as a slowloris
    client does, so `n` stay open from this side for as long as the keeper runs."""

    def __init__(self, sock: str, n: int, reconnect_s: float = 1.0):
        self.sock, self.n, self.reconnect_s = sock, n, reconnect_s
        self.open: dict[int, socket.socket] = {}
        self.due: dict[int, float] = {i: 0.0 for i in range(n)}  # slot → when to (re)open it
        self.closed_by_daemon = Counter()  # "408", "431", "silent" (closed without an answer)
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-keeper", daemon=True)

    def __enter__(self) -> "StallKeeper":
        self._open_due()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.open.values():
            s.close()

    def _open_due(self) -> None:
        now = time.monotonic()
        for slot, when in list(self.due.items()):
            if when > now:
                continue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(1.0)
                s.connect(self.sock)
                if slot % 2:
                    s.sendall(HALF_REQUEST_LINE)
                s.setblocking(False)
            except OSError:
                s.close()
                self.due[slot] = now + self.reconnect_s
                continue
            self.reopened += when > 0
            self.open[slot] = s
            del self.due[slot]

    def _run(self) -> None:
        import selectors
        while not self._stop.is_set():
            with selectors.DefaultSelector() as sel:
                for slot, s in self.open.items():
                    sel.register(s, selectors.EVENT_READ, slot)
                for key, _ in sel.select(0.05):
                    slot, s = key.data, key.fileobj
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    self.closed_by_daemon[data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "silent"] += 1
                    s.close()
                    del self.open[slot]
                    self.due[slot] = time.monotonic() + self.reconnect_s
            self._open_due()


def open_sockets(pid: int) -> int:
    """Socket file descriptors the process holds (its listener and every connection)."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


def fresh_request(sock: str, kind: str, png: bytes) -> tuple[int, float]:
    """One request on a new connection, as a new client makes it: (status, ms from connect to
    the last byte). Raw socket, request bytes built before the clock starts (an httpx.Client
    per request would time its own set-up, ~20 ms, more than the daemon's part)."""
    if kind == "healthz":
        request = b"GET /healthz HTTP/1.1\r\nHost: edgemm\r\nConnection: close\r\n\r\n"
    else:
        query = urllib.parse.urlencode({"prompt": PROMPT})
        request = (f"POST /v1/infer?{query} HTTP/1.1\r\nHost: edgemm\r\nContent-Type: image/png\r\n"
                   f"Content-Length: {len(png)}\r\nConnection: close\r\n\r\n").encode() + png
    t0 = time.perf_counter()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CLIENT_TIMEOUT_S)
        s.connect(sock)
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    ms = (time.perf_counter() - t0) * 1e3
    return (int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0), ms


def bench_stalled(model: Path, scenes: Scenes, rounds: int, n: int, stalled: int, threads: int) -> dict:
    """Valid requests with and without `stalled` stalled connections open, side by side.

    Two daemons: the shipped defaults (max_connections 64, so most stalled connections are
    closed to make room and opened again by the keeper) and max_connections 256 (all of them
    held). Each round, per daemon: `n` GET /healthz and `n` POST /v1/infer, each on a fresh
    connection, unloaded; then the same with the keeper running; rounds alternate the order."""
    specs = (("default", {}), ("max_connections_256", {"max_connections": 256}))
    kinds = ("healthz", "infer")
    samples = {(name, load, kind): [] for name, _ in specs for load in ("unloaded", "stalled") for kind in kinds}
    statuses: Counter = Counter()
    held: dict[str, list[int]] = {name: [] for name, _ in specs}
    keepers: dict[str, dict] = {}
    with daemons(*specs, model=model, threads=threads) as running:
        for d in running:  # warm-up: one of each
            for kind in kinds:
                fresh_request(d.sock, kind, scenes.take(1)[0])
        for r in range(rounds):
            for (name, _), d in zip(specs, running):
                for load in (("unloaded", "stalled") if r % 2 == 0 else ("stalled", "unloaded")):
                    keeper = StallKeeper(d.sock, stalled) if load == "stalled" else contextlib.nullcontext()
                    with keeper:
                        if load == "stalled":
                            time.sleep(1.0)  # all opened, the daemon's cap applied
                        for _ in range(n):
                            for kind in kinds:
                                status, ms = fresh_request(d.sock, kind, scenes.take(1)[0])
                                statuses[f"{load}:{status}"] += 1
                                samples[(name, load, kind)].append(ms)
                            if load == "stalled":
                                held[name].append(open_sockets(d.proc.pid) - 1)
                    if load == "stalled":
                        k = keepers.setdefault(name, {"reopened": 0, "closed_by_daemon": Counter(),
                                                      "open_client_side_at_end": []})
                        k["reopened"] += keeper.reopened
                        k["closed_by_daemon"] += keeper.closed_by_daemon
                        k["open_client_side_at_end"].append(len(keeper.open))
        limited = {d.name: {line.split('"')[1]: int(float(line.rsplit(" ", 1)[1]))
                            for line in d.metrics().splitlines()
                            if line.startswith("edgemm_http_connections_limited_total{")} for d in running}
    out: dict = {"stalled": stalled, "rounds": rounds, "requests_per_phase": n, "statuses": dict(statuses),
                 "limited_by_reason": limited}
    for name, server in specs:
        x = out[name] = {"server": server, "daemon_connections_held_median": statistics.median(held[name]),
                         "keeper": {**keepers[name], "closed_by_daemon": dict(keepers[name]["closed_by_daemon"])}}
        for kind in kinds:
            base, loaded = (statistics.median(samples[(name, load, kind)]) for load in ("unloaded", "stalled"))
            x[kind] = {"unloaded_ms_median": round(base, 2), "stalled_ms_median": round(loaded, 2),
                       "stalled_ms_p90": round(percentile(samples[(name, "stalled", kind)], 90), 2),
                       "difference_ms": round(loaded - base, 2), "ratio": round(loaded / base, 2)}
    return out


def stalled_markdown(r: dict) -> str:
    rows = ["| daemon | request (fresh connection) | unloaded median | with stalled connections: median / P90 | "
            "difference (target ≤ 50 ms) |", "|---|---|---|---|---|"]
    for name in ("default", "max_connections_256"):
        x = r[name]
        for kind, label in (("healthz", "GET /healthz"), ("infer", "POST /v1/infer")):
            y = x[kind]
            rows.append(f"| {name} | {label} | {y['unloaded_ms_median']} ms | {y['stalled_ms_median']} / "
                        f"{y['stalled_ms_p90']} ms | **{y['difference_ms']:+} ms** ({y['ratio']}×) |")
    rows.append("")
    for name in ("default", "max_connections_256"):
        x = r[name]
        rows.append(f"- {name}: connections the daemon held while {r['stalled']} were open from the client's side "
                    f"(median) {x['daemon_connections_held_median']}; the keeper reopened {x['keeper']['reopened']} "
                    f"the daemon had closed ({x['keeper']['closed_by_daemon']}); daemon's reasons: "
                    f"{r['limited_by_reason'][name]}")
    rows.append(f"- statuses: {r['statuses']}")
    return "\n".join(rows)


def serve_section(model: Path, rounds: int, requests: int, *, clients: int = CLIENTS, burst_size: int = BURST,
                  overhead_n: int = OVERHEAD_N, threads: int = 0) -> dict:
    # in this process, before any daemon runs: nothing else competes for the cores
    rt = Runtime(load_config({"model": {"path": str(model)}, "backend": {"intra_op_threads": 1}}))
    ceilings = {kind: batching_ceiling(rt, prompt) for kind, prompt in BATCH_PROMPTS.items()}
    del rt
    scenes = Scenes()
    common = {"queue_size": clients, "batch_timeout_ms": BATCH_TIMEOUT_MS}
    specs = (("batched", {**common, "max_batch": 8}),  # continuous_batching: auto, the default
             ("batched_joins_on", {**common, "max_batch": 8, "continuous_batching": "on"}),
             ("batched_joins_off", {**common, "max_batch": 8, "continuous_batching": "off"}),
             ("batch1", {**common, "max_batch": 1}))
    with daemons(*specs, model=model, threads=threads) as running:
        pair = {name: d for (name, _), d in zip(specs, running)}
        time.sleep(1.0)  # let both settle after warm-up and /readyz
        idle = {name: d.rss_mb() for name, d in pair.items()}
        batching = {kind: bench_batching(pair, scenes, rounds, requests, clients, prompt)
                    for kind, prompt in BATCH_PROMPTS.items()}
        overhead = bench_overhead({name: pair[name] for name in ("batched", "batch1")}, scenes, overhead_n)
        after = {name: d.rss_mb() for name, d in pair.items()}
    exits = {name: d.exit_code for name, d in pair.items()}
    overload = bench_overload(model, scenes, rounds, burst_size, threads)
    return {"model": str(model), "intra_op_threads": threads, "cpus": os.cpu_count(),
            "prompt": PROMPT, "png_bytes_example": len(Scenes().take(1)[0]),
            "batching": batching, "batching_ceiling": ceilings, "overload": overload, "overhead": overhead,
            "rss_mb_idle": idle, "rss_mb_after_batching_and_overhead": after, "daemon_exit_codes": exits}


def _statuses(stats: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(stats["statuses"].items()))


def serve_markdown(r: dict) -> str:
    o, h = r["overload"], r["overhead"]
    threads = r["intra_op_threads"] or "onnxruntime's choice"
    rows = ["| measure | value |", "|---|---|",
            f"| setup | {r['cpus']} CPUs, intra_op_threads {threads}, clients in the same machine |"]
    labels = {"batched": "max_batch=8, continuous_batching auto (the default)",
              "batched_joins_on": "max_batch=8, continuous_batching on", "batched_joins_off":
              "max_batch=8, continuous_batching off"}
    for kind, b in r["batching"].items():
        b1 = b["batch1"]
        rows.append(f"| {kind}: {b['clients']} clients, POST /v1/infer \"{b['prompt']}\", {b['rounds']} × "
                    f"{b['requests_per_round']} requests per daemon; max_batch=1 | {b1['rps_median']} requests/s, "
                    f"P50 {b1['p50_ms']} ms, P99 {b1['p99_ms']} ms (cores in use: daemon {b1['cores_used_daemon']}, "
                    f"clients {b1['cores_used_clients']}) |")
        for name, ratio in b["ratios"].items():
            ba = b[name]
            rows += [
                f"| {kind}: {labels[name]} (batch_timeout {ba['server']['batch_timeout_ms']} ms) | "
                f"{ba['rps_median']} requests/s, P50 {ba['p50_ms']} ms, P99 {ba['p99_ms']} ms (mean encoder batch "
                f"{ba['mean_encoder_batch']}, mean decoder batch {ba['mean_decoder_batch']}; cores in use: daemon "
                f"{ba['cores_used_daemon']}, clients {ba['cores_used_clients']}) |",
                f"| {kind}: {labels[name]} / batch 1 | throughput **{ratio['throughput']}×**, P50 {ratio['p50']}×, "
                f"P99 {ratio['p99']}× |"]
        c = r["batching_ceiling"][kind]
        m = c["per_request_ms"]
        rows.append(
            f"| {kind}: ceiling, in-process on one thread, per request alone → with every call carrying "
            f"{c['batch']} ({c['tier']} tier, {c['tokens_mean']} tokens) | prepare {m['prepare']} ms; encoder "
            f"{m['encoder']} → {m['encoder_batched']} ms ({c['encoder_gain']}×, "
            f"{'batched' if c['encoder_batched'] else 'not batched: under 1.2×'}); decoder {m['decoder']} → "
            f"{m['decoder_batched']} ms ({c['decoder_gain']}×): **at most {c['ceiling']}×** |")
    rows += [
        f"| overload: {o['bursts_per_client_kind']} + {o['bursts_per_client_kind']} bursts of "
        f"{o['burst_size']} at queue_size={o['server']['queue_size']}: statuses (httpx / raw sockets) | "
        f"{_statuses(o['httpx'])} / {_statuses(o['raw'])} |",
        f"| 503 response time, httpx clients (64 threads in one process): P50 / P99 / max | "
        f"{o['httpx']['p50_503_ms']} / {o['httpx']['p99_503_ms']} / {o['httpx']['max_503_ms']} ms "
        f"(target P99 ≤ 50 ms) |",
        f"| 503 response time, raw-socket clients: P50 / P99 / max | {o['raw']['p50_503_ms']} / "
        f"{o['raw']['p99_503_ms']} / {o['raw']['max_503_ms']} ms (target P99 ≤ 50 ms) |",
        f"| same, as the daemon timed them (its /v1/infer histogram): P99 at most | "
        f"{o['server_side_p99_503_at_most_ms']} ms "
        f"({', '.join(f'≤ {k} ms: {v}' for k, v in o['server_side_le_ms'].items())}) |",
        f"| 5xx other than 503 / transport errors | "
        f"{sum(o['httpx']['other_5xx'].values()) + sum(o['raw']['other_5xx'].values())} / "
        f"{o['httpx']['transport_errors'] + o['raw']['transport_errors']} |",
        f"| overload daemon RSS before → after | {o['rss_mb_before']} → {o['rss_mb_after_each_burst'][-1]} MB "
        f"({o['rss_growth_mb']:+} MB) |",
        f"| idle daemon RSS after warm-up (batched / batch 1) | {r['rss_mb_idle']['batched']} / "
        f"{r['rss_mb_idle']['batch1']} MB |",
    ]
    for name in ("batched", "batch1"):
        for ep, label in (("chat", "/v1/chat/completions"), ("infer", "/v1/infer"),
                          ("infer_raw", "/v1/infer, http.client")):
            x = h[name][ep]
            means = x.get("means_ms", {})
            split = (f"; means: round trip {means['rtt']}, in the daemon's app {means['daemon']}, pipeline "
                     f"{means['pipeline']} ms") if means else ""
            rows.append(f"| API overhead {label} ({name}), median of {h['requests']} sequential | "
                        f"{x['overhead_ms_median']} ms (round trip {x['rtt_ms_median']} ms, pipeline "
                        f"{x['pipeline_ms_median']} ms{split}; target ≤ 3 ms) |")
        rows.append(f"| GET /healthz round trip ({name}), median of {h['requests']} | "
                    f"{h[name]['healthz']['rtt_ms_median']} ms |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--rounds", type=int, default=3, help="batching rounds per configuration; overload bursts")
    ap.add_argument("--requests", type=int, default=64, help="requests per batching round")
    ap.add_argument("--clients", type=int, default=CLIENTS, help="concurrent clients for batching")
    ap.add_argument("--burst", type=int, default=BURST, help="concurrent requests per overload burst")
    ap.add_argument("--overhead-n", type=int, default=OVERHEAD_N, help="sequential requests per endpoint and daemon")
    ap.add_argument("--threads", type=int, default=0, help="backend.intra_op_threads (0 = onnxruntime decides)")
    ap.add_argument("--mode", choices=("serve", "stalled"), default="serve",
                    help="serve: batching, ceiling, overload, idle/api; stalled: valid requests with "
                         "--stalled connections open that never finish a request")
    ap.add_argument("--stalled", type=int, default=200, help="stalled connections (--mode stalled)")
    args = ap.parse_args()
    for name in ("rounds", "requests", "clients", "burst", "overhead_n", "stalled"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.mode == "stalled":
        results = bench_stalled(args.model, Scenes(), args.rounds, args.requests, args.stalled, args.threads)
        print(json.dumps(results, indent=1))
        print()
        print(stalled_markdown(results))
        return
    results = serve_section(args.model, args.rounds, args.requests, clients=args.clients, burst_size=args.burst,
                            overhead_n=args.overhead_n, threads=args.threads)
    print(json.dumps(results, indent=1))
    print()
    print(serve_markdown(results))


if __name__ == "__main__":
    main()
