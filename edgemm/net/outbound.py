"""Outbound HTTP: the one client edgemm sends requests out with, to alert webhooks and to the
offload endpoint.

    outbound_client(url, timeout_s, headers, backend) ─► httpx.Client on a DeadlineTransport
        DeadlineBackend.attempt(timeout_s): the whole attempt (name lookup, connect, TLS
        handshake, every write and read) within timeout_s · the environment's proxy for the
        URL (HTTP_PROXY / HTTPS_PROXY / ALL_PROXY, NO_PROXY), used by the transport itself ·
        redirects never followed (they must not carry a token or a key elsewhere)

httpx has no total timeout of its own, and its connect timeout does not cover the name
lookup (NameLookups): so the transport is httpcore's connection pool on sockets of our own.
"""
from __future__ import annotations

import errno
import math
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx
from httpcore._backends.sync import SyncStream  # httpcore's socket stream; its package does not export it


def outbound_client(url: str, timeout_s: float, headers: Mapping[str, str], backend: DeadlineBackend,
                    transport: httpx.BaseTransport | None = None, connections: int = 1,
                    senders: str = "webhooks") -> httpx.Client:
    """The client for requests to `url` (its host; the proxy is chosen for it), each attempt of
    which is made inside `backend.attempt(timeout_s)`. `connections`: the most requests at once;
    `senders` names them in an error ("webhooks"). `transport`: for tests, in place of the
    DeadlineTransport (then no deadline holds)."""
    transport = transport or DeadlineTransport(backend, environment_proxy(url), connections, senders)
    return httpx.Client(timeout=httpx.Timeout(timeout_s), headers=dict(headers), transport=transport,
                        trust_env=False,  # the proxy is the transport's already
                        follow_redirects=False)  # a redirect must not carry a token or key elsewhere


# host names being resolved at once by all webhooks together (NAME_LOOKUPS); a client that sends
# several requests at once (offload) has a NameLookups of its own, so a webhook host whose
# resolver hangs cannot take the lookups offload needs
MAX_NAME_LOOKUPS = 4
KEEPALIVE_EXPIRY_S = 5.0  # an idle connection is not reused after this (httpx's default): a NAT may have dropped it


class NameLookups:
    """socket.getaddrinfo within a wait. httpcore's connect timeout does not cover the name:
    its SyncBackend calls socket.create_connection, whose getaddrinfo waits as long as the
    system's resolver does (resolv.conf's timeout x attempts x servers, or forever on a
    stuck NSS module). Here each lookup runs in a thread of its own and the attempt waits
    for it at most until its deadline; a lookup that outlives its attempt keeps its thread
    until the resolver returns, so at most MAX_NAME_LOOKUPS run at once and an attempt
    that finds them all busy fails at once (a ConnectError, retried with backoff)."""

    def __init__(self, limit: int = MAX_NAME_LOOKUPS) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def resolve(self, host: str, port: int, wait: float) -> list[tuple]:
        try:  # an address needs no lookup
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass
        if not self._slots.acquire(blocking=False):
            raise httpcore.ConnectError(f"{self.limit} name lookups are still waiting for the resolver")
        found: dict[str, Any] = {}
        done = threading.Event()

        def look() -> None:
            try:
                found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                found["error"] = e
            finally:
                self._slots.release()
                done.set()

        try:
            threading.Thread(target=look, name="edgemm-name-lookup", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: the slot comes back
            self._slots.release()
            raise httpcore.ConnectError(f"cannot start a name lookup: {e}") from e
        if not done.wait(wait):
            raise httpcore.ConnectTimeout(f"the name lookup of {host} did not finish before the attempt's deadline")
        if "error" in found:
            raise httpcore.ConnectError(f"cannot resolve {host}: {found['error']}")
        return found["addresses"]


NAME_LOOKUPS = NameLookups()


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sockets, where each name lookup, connect, write and read waits at most
    until `deadline` (time.monotonic()), whatever its own timeout: a whole attempt within
    timeout_s, even against a resolver that hangs or a server that drips its reply a byte
    at a time. The deadline is the calling thread's attempt's (`attempt()`: the offload
    client's workers send at once, each on its own clock), and never later than `cutoff`,
    which any thread may bring forward for every attempt (a webhook closed: what it holds
    goes within one more timeout_s). `abandon()` (any thread) shuts the open connections,
    which wakes a read in progress, and the sockets still connecting, which wakes their
    connect: a host that drops the SYNs (firewalled, or its accept queue full) holds no
    thread past abandon()."""

    def __init__(self, lookups: NameLookups | None = None) -> None:
        self.lookups = lookups  # None: the webhooks' shared NAME_LOOKUPS
        self.cutoff = math.inf  # only ever brought forward
        self._attempts = threading.local()  # each thread's attempt's deadline
        self._inner = httpcore.SyncBackend()
        self._lock = threading.Lock()
        self._open: set["DeadlineStream"] = set()
        self._connecting: set[socket.socket] = set()

    @contextmanager
    def attempt(self, timeout_s: float) -> Iterator[None]:
        """The calling thread's requests inside it end within timeout_s (and by the cutoff)."""
        self._attempts.deadline = time.monotonic() + timeout_s
        try:
            yield
        finally:
            self._attempts.deadline = math.inf

    @property
    def deadline(self) -> float:
        return min(getattr(self._attempts, "deadline", math.inf), self.cutoff)

    def left(self, timeout: float | None) -> float | None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise httpcore.TimeoutException("the attempt's deadline passed")
        return remaining if timeout is None else min(timeout, remaining)

    def _track(self, inner: httpcore.NetworkStream) -> "DeadlineStream":
        stream = DeadlineStream(inner, self)
        with self._lock:
            self._open.add(stream)
        return stream

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        """The name resolved within the deadline (NameLookups), then its addresses tried in
        the resolver's order, as socket.create_connection tries them (IPv6 with its scope).
        TLS still checks the host name: httpcore gives start_tls the URL's host, not the address."""
        failure: Exception = httpcore.ConnectError(f"{host} has no address")
        lookups = self.lookups or NAME_LOOKUPS
        for family, kind, proto, _, address in lookups.resolve(host, port, self.left(timeout)):
            try:
                sock = self._connect(family, kind, proto, address, timeout, local_address, socket_options)
            except httpcore.ConnectError as e:  # a timeout is the deadline's: no next address
                failure = e
                continue
            # httpcore's own stream on it, as SyncBackend.connect_tcp returns (reads, writes, TLS)
            return self._track(SyncStream(sock))
        raise failure

    def _connect(self, family: int, kind: int, proto: int, address: tuple, timeout: float | None,
                 local_address: str | None, socket_options: Iterable[tuple] | None) -> socket.socket:
        """One address connected within the deadline, as httpcore's SyncBackend connects (its
        socket options, then TCP_NODELAY), but on a socket abandon() can reach: it is
        registered once the connect has begun (a SYN sent, so a shutdown wakes it; one
        registered later is caught by the deadline check after it) and until it ends."""
        self.left(timeout)  # abandoned, or out of time, after a failed address: no next one
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as e:  # out of fds, or no IPv6 here: the next address may do
            raise httpcore.ConnectError(f"cannot make a socket: {e}") from e
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            if local_address is not None:
                sock.bind((local_address, 0))
            sock.setblocking(False)
            started = sock.connect_ex(address)
            with self._lock:
                self._connecting.add(sock)
            try:
                if started not in (0, errno.EINPROGRESS):
                    raise OSError(started, os.strerror(started))
                wait = self.left(timeout)  # after registering: an abandon() before it is seen here
                if started == errno.EINPROGRESS:
                    poll = select.poll()  # not select(): fds above 1024 are a busy daemon's ordinary case
                    poll.register(sock, select.POLLOUT)
                    if not poll.poll(None if wait is None else math.ceil(wait * 1000)):
                        raise httpcore.ConnectTimeout(f"no connection to {address[0]} within the attempt's deadline")
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error))
                self.left(None)  # abandoned while connecting: a shut socket is no connection
            finally:
                with self._lock:
                    self._connecting.discard(sock)
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            sock.close()
            raise httpcore.ConnectError(str(e)) from e
        except BaseException:
            sock.close()
            raise

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return self._track(self._inner.connect_unix_socket(path, self.left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)

    def forget(self, stream: "DeadlineStream") -> None:
        with self._lock:
            self._open.discard(stream)

    def abandon(self) -> None:
        """Shut, not close: the thread using a socket closes it (a closed fd could be reused
        by then). A connect in progress wakes with ECONNRESET, a read with end of stream."""
        self.cutoff = -math.inf
        with self._lock:
            sockets = [stream.get_extra_info("socket") for stream in self._open] + list(self._connecting)
        for sock in sockets:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, backend: DeadlineBackend):
        self._inner, self._backend = inner, backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._backend.left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._backend.left(timeout))

    def close(self) -> None:
        self._backend.forget(self)
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        """The TLS handshake within the deadline, on a socket abandon() can reach all along (httpcore's
        own start_tls wraps the socket, which takes the fd from the one abandon() would shut)."""
        raw = self._inner.get_extra_info("socket")
        if raw is None or not isinstance(self._inner, SyncStream):  # not a socket of ours (a proxy's TLS-in-TLS)
            tls_stream = self._inner.start_tls(ssl_context, server_hostname, self._backend.left(timeout))
            self._backend.forget(self)
            return self._backend._track(tls_stream)
        try:
            tls = ssl_context.wrap_socket(raw, server_hostname=server_hostname, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as e:
            raise httpcore.ConnectError(str(e)) from e
        self._backend.forget(self)  # the plain stream is the TLS one's now
        with self._backend._lock:
            self._backend._connecting.add(tls)
        try:
            tls.settimeout(self._backend.left(timeout))
            tls.do_handshake()
            self._backend.left(None)  # abandoned during the handshake: no connection
        except socket.timeout as e:
            tls.close()
            raise httpcore.ConnectTimeout(f"TLS handshake: {e}") from e
        except (OSError, ssl.SSLError) as e:
            tls.close()
            raise httpcore.ConnectError(f"TLS handshake: {e}") from e
        except BaseException:
            tls.close()
            raise
        finally:
            with self._backend._lock:
                self._backend._connecting.discard(tls)
        return self._backend._track(SyncStream(tls))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class DeadlineTransport(httpx.BaseTransport):
    """httpx's transport on `backend`'s sockets (httpx has no total timeout of its own): one
    httpcore connection pool, as httpx.HTTPTransport has, with httpcore's errors raised as
    httpx's. Through `proxy` if given, as httpx.HTTPTransport goes through one: plain HTTP
    as absolute-URI requests to it, HTTPS through a CONNECT tunnel (the proxy's own
    connection is on `backend` too, so the deadline covers it)."""

    def __init__(self, backend: DeadlineBackend, proxy_url: str | None = None, connections: int = 1,
                 senders: str = "webhooks") -> None:
        # a context of its own: httpcore sets its ALPN protocols on every connect, which is not safe
        # on a context another webhook's thread is making a connection from
        ssl_context = httpx.create_ssl_context()
        self._refusal: str | None = None  # a proxy it cannot use: each attempt fails, saying so
        self._pool: httpcore.ConnectionPool | httpcore.HTTPProxy | None = None
        scheme = urllib.parse.urlsplit(proxy_url).scheme if proxy_url else None
        try:
            proxy = httpx.Proxy(proxy_url) if scheme in ("http", "https") else None
        except (ValueError, httpx.InvalidURL) as e:
            self._refusal = f"the proxy URL cannot be used: {e}"
            return
        if proxy_url is None:
            self._pool = httpcore.ConnectionPool(ssl_context=ssl_context, max_connections=connections,
                                                 keepalive_expiry=KEEPALIVE_EXPIRY_S, network_backend=backend)
        elif proxy is not None:
            self._pool = httpcore.HTTPProxy(
                proxy_url=httpcore.URL(scheme=proxy.url.raw_scheme, host=proxy.url.raw_host,
                                       port=proxy.url.port, target=proxy.url.raw_path),
                proxy_auth=proxy.raw_auth, proxy_headers=proxy.headers.raw, ssl_context=ssl_context,
                proxy_ssl_context=proxy.ssl_context, max_connections=connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S, network_backend=backend)
        else:
            self._refusal = f"{senders} go through http:// and https:// proxies only, not {scheme}://"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._pool is None:
            raise httpx.UnsupportedProtocol(self._refusal or "closed")
        url = request.url
        core = httpcore.Request(request.method, httpcore.URL(scheme=url.raw_scheme, host=url.raw_host,
                                                              port=url.port, target=url.raw_path),
                                headers=request.headers.raw, content=request.stream,
                                extensions=request.extensions)
        with httpx_errors():
            response = self._pool.handle_request(core)
        return httpx.Response(response.status, headers=response.headers, stream=ReplyStream(response.stream),
                              extensions=response.extensions)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def environment_proxy(url: str) -> str | None:
    """The proxy URL the environment names for `url`: HTTP_PROXY / HTTPS_PROXY / ALL_PROXY,
    none for a host NO_PROXY lists, by the standard library's rules (a host matches an entry
    equal to it or ending in it after a dot; `*` matches every host)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    if not parts.hostname or urllib.request.proxy_bypass(parts.hostname):
        return None
    named = proxies.get(parts.scheme) or proxies.get("all")
    if not named:
        return None
    return named if "://" in named else f"http://{named}"


class ReplyStream(httpx.SyncByteStream):
    def __init__(self, inner: Iterable[bytes]) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with httpx_errors():
            yield from self._inner

    def close(self) -> None:
        with httpx_errors():
            self._inner.close()


# httpcore's errors as httpx's, the most specific first (a ReadTimeout is a TimeoutException)
HTTPX_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError), (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError), (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextmanager
def httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as e:
        for core, ours in HTTPX_ERRORS:
            if isinstance(e, core):
                raise ours(str(e)) from e
        raise


# how httpcore's RemoteProtocolError begins when the server closed the connection before any
# reply (it restarted, or dropped an idle keep-alive connection): retried, unlike a bad reply
DISCONNECTED = "Server disconnected"


def certificate_failure(error: BaseException) -> str | None:
    """Why the webhook's TLS certificate was not trusted ("self-signed certificate", "Hostname
    mismatch, …"), one line, when that is what `error` (an httpx error) comes from; else None.
    httpx raises a plain ConnectError whose cause (the chain httpcore raised it from) holds
    ssl's SSLCertVerificationError."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            reason = cause.verify_message or cause.reason or str(cause)
            return " ".join(str(reason).split())[:200]
        cause = cause.__cause__ or cause.__context__
    return None
