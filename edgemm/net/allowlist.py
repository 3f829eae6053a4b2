"""Host allow-lists: which hosts a URL names, and whether server.webhook_hosts /
server.source_hosts let the API send there (entries 'host' for any port, 'host:port')."""
from __future__ import annotations

import urllib.parse
from typing import Any


def url_host(url: Any) -> tuple[str, int] | None:
    """An http(s) URL's host name (lower case) and port (given, else 80 / 443); None unless
    it is such a URL, with a host name and no whitespace or control characters."""
    if not isinstance(url, str) or " " in url or not url.isprintable():
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:  # a port out of range, a broken [IPv6] address
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def webhook_host(entry: Any) -> tuple[str, int | None] | None:
    """A server.webhook_hosts entry, 'host' (any port) or 'host:port' ('[::1]:8080'), as
    (host in lower case, port or None); None unless it is one."""
    if not isinstance(entry, str) or not entry or " " in entry or not entry.isprintable():
        return None
    try:
        parts = urllib.parse.urlsplit(f"//{entry}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.path or parts.query or parts.fragment or "@" in parts.netloc \
            or parts.netloc.endswith(":"):
        return None
    return parts.hostname, port


def webhook_allowed(url: str, hosts: list[str]) -> bool:
    """Whether server.webhook_hosts (validated) lets POST /v1/streams give this webhook URL."""
    return host_allowed(url_host(url), hosts)


def host_allowed(target: tuple[str, int] | None, hosts: list[str]) -> bool:
    """Whether (host, port) is one of `hosts`, entries as server.webhook_hosts / source_hosts
    take them (validated): 'host' for any port, 'host:port' for that one."""
    if target is None:
        return False
    for entry in hosts:
        host, port = webhook_host(entry) or ("", None)
        if host == target[0] and port in (None, target[1]):
            return True
    return False
