"""The daemon's lifecycle: its sockets, systemd, signals, and draining.

    bind the UNIX socket (or take systemd's) ─► load + warm up the model (backend.warmup) ─► READY=1
    ─► serve (edgemm.server.app) with WATCHDOG=1 pings ─► SIGTERM: stop accepting,
    finish requests and streams in flight within server.grace_period_s ─► exit 0

The socket is bound before the model loads, so a path in use fails at once and
clients that connect meanwhile wait in the backlog, as with socket activation.
"""
from __future__ import annotations

import asyncio
import contextlib
import grp
import importlib.util
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass

import uvicorn

from edgemm.config import Config, ServerConfig
from edgemm.server.sockets import creatable_socket, socket_choices
from edgemm.power.offload import OffloadClient
from edgemm.engine.batching import encoder_batch_limits
from edgemm.engine.pipeline import Pipeline
from edgemm.power.telemetry import Sampler
from edgemm.power.router import Router
from edgemm.engine.runtime import Runtime
from edgemm.server.app import create_app
from edgemm.server.errors import ListenError
from edgemm.server.service import Service
from edgemm.streams.manager import check_configured, reserved_places
from edgemm.server.systemd import Notifier, listen_sockets, watchdog_interval

HTTPTOOLS = importlib.util.find_spec("httptools") is not None  # a dependency; h11 if a distro lacks it


def run_loop(main: Coroutine) -> object:
    """asyncio.run on uvloop where it is installed (a dependency on Linux): the pipeline's
    threads hand every answer to the event loop, and libuv's wake-up is the cheaper one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)

log = logging.getLogger("edgemm")

BACKLOG = 128


# ---- listening sockets ---------------------------------------------------------------------

@dataclass
class Listener:
    sock: socket.socket
    name: str  # for logs and STATUS=
    path: str | None = None  # a socket file this process created (removed at exit)
    inode: int | None = None

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            if self.path is not None and os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)  # only our own: a newer daemon may have bound the path since


def open_listeners(cfg: ServerConfig, socket_path: str | None = None) -> list[Listener]:
    """systemd's sockets when socket-activated; else the UNIX socket, plus TCP if configured
    (TCP alone when no socket is named: `edgemm serve --port 8080`)."""
    inherited = listen_sockets()
    if inherited:
        return [Listener(s, f"systemd socket {s.getsockname() or 'fd ' + str(s.fileno())}") for s in inherited]
    path = socket_path or cfg.socket
    if path is None and cfg.tcp_port is None:
        path = creatable_socket()
        if path is None:
            folders = [os.path.dirname(p) for p in socket_choices()]
            why = (f"neither {folders[0]} nor {folders[1]} is a folder this user may write" if len(folders) > 1 else
                   f"{folders[0]} is not a folder this user may write and $XDG_RUNTIME_DIR is not set")
            raise ListenError(f"no socket to create: {why} (systemd's edgemm.socket makes /run/edgemm); "
                              "pass --socket PATH, or --port N for TCP on 127.0.0.1")
    listeners = [bind_unix(path, cfg.mode, cfg.socket_group)] if path is not None else []
    if cfg.tcp_port is not None:
        try:
            listeners.append(bind_tcp(cfg.tcp_host, cfg.tcp_port))
        except ListenError:
            for listener in listeners:
                listener.close()
            raise
    return listeners


def bind_unix(path: str, mode: int, group: str | None) -> Listener:
    path = os.path.abspath(path)
    if len(os.fsencode(path)) > 107:  # sun_path is 108 bytes with its NUL
        raise ListenError(f"socket path is too long ({len(os.fsencode(path))} bytes, at most 107): {path}")
    remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # born 0600: never more open than configured, even for an instant
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot create socket {path}: {e.strerror} (set server.socket or --socket)") from None
    finally:
        os.umask(old_umask)
    try:
        if group is not None:
            os.chown(path, -1, group_id(group))
        os.chmod(path, mode)
        sock.listen(BACKLOG)
    except (OSError, ListenError) as e:
        sock.close()
        os.unlink(path)
        raise e if isinstance(e, ListenError) else ListenError(f"cannot set up socket {path}: {e.strerror}") from None
    return Listener(sock, path, path, os.stat(path).st_ino)


def remove_stale_socket(path: str) -> None:
    """A socket file nobody listens on (left by a crash) is removed; anything else is refused."""
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ListenError(f"{path} exists and is not a socket; not touching it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
            return
        except OSError as e:
            raise ListenError(f"cannot check the existing socket {path}: {e.strerror}") from None
    raise ListenError(f"{path} is in use by another process (another edgemm serve?)")


def group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ListenError(f"unknown group {name!r} (server.socket_group)") from None


def bind_tcp(host: str, port: int) -> Listener:
    try:
        sock = socket.create_server((host, port), backlog=BACKLOG)
    except OSError as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    bound = sock.getsockname()
    return Listener(sock, f"http://{bound[0]}:{bound[1]}")


# ---- the daemon ----------------------------------------------------------------------------

class _UvicornServer(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM once it has shut down (exit status 143); the daemon
    handles its signals itself and exits 0 after draining."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Daemon:
    """Bind, load once, serve until SIGTERM/SIGINT or stop(), drain, return.

    `runtime` may be passed in (tests, embedding); otherwise it is loaded from `config`
    after the socket is bound, so clients that connect meanwhile wait in the backlog.
    """

    def __init__(self, config: Config, socket_path: str | None = None, runtime: Runtime | None = None):
        self.config, self.socket_path, self.runtime = config, socket_path, runtime
        self.notifier = Notifier.from_env()
        self.ready = threading.Event()  # set once READY=1 was sent
        self.listeners: list[Listener] = []
        self.service: Service | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: _UvicornServer | None = None
        self._stop_asked = False
        self._drain_started: float | None = None
        self._started = time.monotonic()

    def run(self) -> None:
        cfg = self.config.server
        check_configured(self.config.streams, cfg.max_streams, self.config.limits)  # before the socket and the model
        offload = self.config.offload
        client = OffloadClient.from_config(offload) if offload.enabled else None  # a bad key file: exit 2 now
        started = time.monotonic()
        self.listeners = open_listeners(cfg, self.socket_path)
        log.info("listening on %s", ", ".join(listener.name for listener in self.listeners))
        self._started = started
        router = Router(self.config, Sampler.from_config(self.config.power).start(), client)
        try:
            if self.runtime is None:
                self.notifier.status("loading the model")
                log.info("loading the model …")
                try:
                    self.runtime = Runtime(self.config, concurrent=True, warm_up=False)
                    self.runtime.warmup(self.runtime.warmup_tiers, report=self._warming)
                except Exception as e:
                    self.notifier.status(f"failed to load the model: {e}")
                    raise
            self.notifier.status("timing encoder batches")
            limits = encoder_batch_limits(self.runtime, cfg.max_batch, cfg.encoder_batching)
            # one pipeline for the API and every stream: places for the API's queue_size and
            # for the streams' shares, so that neither fills the other's
            pipeline = Pipeline(self.runtime, cfg.queue_size, cfg.max_batch, cfg.batch_timeout_ms,
                                encoder_batch=limits, decoder_joins=cfg.continuous_batching,
                                reserved=reserved_places(cfg.max_streams), max_rows=cfg.max_decoder_rows)
            self.service = Service(self.runtime, pipeline, self.config, router)
            started_draining = run_loop(self._serve())
            self._finish(pipeline, started_draining)
        finally:
            router.sampler.stop()
            router.close()
            for listener in self.listeners:
                listener.close()
        self.notifier.status("stopped")

    def _warming(self, line: str) -> None:
        """Warm-up progress: to the log (stderr, the journal) and to systemd's STATUS=."""
        log.info("%s", line)
        self.notifier.status(line)

    def stop(self) -> None:
        """Begin draining, as SIGTERM does; from any thread."""
        self._stop_asked = True
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._drain, "stop requested")

    async def _serve(self) -> float:
        """Serve until drained; returns the monotonic time draining began."""
        cfg = self.config.server
        self._loop = asyncio.get_running_loop()
        self._server = _UvicornServer(uvicorn.Config(
            create_app(self.service), lifespan="off", log_config=None, log_level="warning",
            access_log=False, server_header=False, timeout_graceful_shutdown=cfg.grace_period_s,
            **self._connection_limits()))
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, signal.Signals(sig).name)
        self.service.streams.start(self._loop)
        if self._stop_asked:
            self._drain("stop requested")
        helpers = [asyncio.ensure_future(self._announce_ready()), asyncio.ensure_future(self._heartbeat())]
        try:
            await self._server.serve(sockets=[listener.sock for listener in self.listeners])
        finally:
            for task in helpers:
                task.cancel()
        return self._drain_started or time.monotonic()

    def _connection_limits(self) -> dict:
        """uvicorn's settings for the server.* connection limits (edgemm.server.connections)."""
        cfg = self.config.server
        if not HTTPTOOLS:  # h11: uvicorn's own limits, which are coarser (a 400 for a large head,
            # no header timeout, idle connections count against limit_concurrency: a plain-text 503)
            log.warning("httptools is not installed: the HTTP server runs on h11 with coarser connection limits")
            return {"http": "h11", "timeout_keep_alive": cfg.idle_timeout_s, "limit_concurrency": cfg.max_connections + 1,
                    "h11_max_incomplete_event_size": cfg.max_header_bytes}
        from edgemm.server.connections import ConnectionLimits, limited_protocol  # it needs httptools
        limits = ConnectionLimits(cfg.max_connections, cfg.header_timeout_s, cfg.idle_timeout_s, cfg.max_header_bytes,
                                  cfg.retry_after_s, on_limit=self.service.metrics.connection_limited,
                                  send_timeout_s=cfg.send_timeout_s)
        self._limits = limits
        return {"http": limited_protocol(limits), "timeout_keep_alive": cfg.idle_timeout_s}

    def _on_signal(self, name: str) -> None:
        if self.service is not None and self.service.draining and self._server is not None:
            self._server.force_exit = True  # a second signal: stop waiting for requests in flight
        self._drain(name)

    def _drain(self, reason: str) -> None:
        if self.service is None or self._server is None or self.service.draining:
            return
        self._drain_started = time.monotonic()
        self.service.draining = True
        self._server.should_exit = True  # uvicorn stops accepting, then waits for responses in flight
        self.service.streams.stop_all()  # their listeners get the results in flight, then the end
        if HTTPTOOLS:  # ... but not those that read nothing: their end would wait out the grace period
            from edgemm.server.connections import cut_off_stalled
            if stalled := cut_off_stalled(self._limits, self._server.server_state.connections):
                log.info("%s: cut off %d clients that were taking nothing", reason, stalled)
        in_flight = self.service.admission.count
        self.notifier.stopping(f"draining: {in_flight} requests in flight")
        log.info("%s: finishing %d requests in flight (up to %g s)", reason, in_flight,
                 self.config.server.grace_period_s)

    def _finish(self, pipeline: Pipeline, started: float) -> None:
        """Let streams and the pipeline finish their work, within what is left of the grace period."""
        deadline = started + self.config.server.grace_period_s
        self.service.streams.stop_all()
        self.service.streams.join(max(0.0, deadline - time.monotonic()))
        closer = threading.Thread(target=pipeline.close, name="edgemm-close", daemon=True)
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))

    async def _announce_ready(self) -> None:
        while not self._server.started:
            await asyncio.sleep(0.01)
        names = ", ".join(listener.name for listener in self.listeners)
        serving = f"{self.service.model_id} ({self.runtime.precision}) on {names}"
        self.notifier.ready(f"ready: {serving}")
        log.info("ready in %.1f s: %s", time.monotonic() - self._started, serving)
        self.ready.set()

    async def _heartbeat(self) -> None:
        """WATCHDOG=1 (when systemd asks for it) and a fresh STATUS= line, every half
        WatchdogSec. A ping is sent only while the pipeline is healthy (Pipeline.health):
        when a stage thread died or a stage is stuck past server.stall_s, only STATUS= with
        the reason goes out, so systemd's watchdog restarts the unit. Health is checked at
        every ping, so the last ping comes at most stall_s + one interval after a stall began.
        Outside systemd (no NOTIFY_SOCKET) it only logs health changes, every 10 s."""
        interval = watchdog_interval() if self.notifier.active else None
        while not self.ready.is_set():
            await asyncio.sleep(0.05)
        healthy = True
        while True:
            health = self.service.health()
            status = self.service.status_line()
            if health.ok != healthy:  # log the change, not every beat
                healthy = health.ok
                if healthy:
                    log.warning("the pipeline is healthy again%s", "; watchdog pings resume" if interval else "")
                else:
                    log.error("unhealthy: %s%s", health.reason,
                              "; no more watchdog pings (systemd restarts the service)" if interval else "")
            if interval and health.ok:  # (without NOTIFY_SOCKET both are no-ops)
                self.notifier.watchdog(status)
            else:
                self.notifier.status(status)
            await asyncio.sleep(interval or 10.0)


def serve(config: Config, socket_path: str | None = None) -> None:
    """`edgemm serve`: run the daemon in this process until SIGTERM/SIGINT."""
    Daemon(config, socket_path).run()

