"""What a client of the HTTP API may do with the daemon's streams, and what it may see of
them: the sources it may start (none that reads the daemon's files), the hosts its network
sources and webhooks may reach (server.source_hosts, server.webhook_hosts), no tokens of the
daemon's, and a stream's config shown without its secrets. The config file may do all of it."""
from __future__ import annotations

import urllib.parse

from edgemm.config import StreamConfig
from edgemm.net.allowlist import host_allowed, url_host, webhook_allowed
from edgemm.streams.errors import SourceError, StreamForbidden, StreamSpecError
from edgemm.streams.sources.uri import network_address, redact_uri

# Sources a client may start with POST /v1/streams; files and folders only from the config file,
# so the API cannot be used to read the daemon's files.
API_SOURCE_KINDS = ("csi", "v4l2", "rtsp", "synthetic")


def api_may_start(kind: str) -> None:
    if kind not in API_SOURCE_KINDS:
        raise StreamForbidden(f"a {kind} source can only be configured in the config file's streams: "
                              f"the API starts {', '.join(API_SOURCE_KINDS)} sources")


def api_may_use_tokens(spec: StreamConfig) -> None:
    """A webhook's token names a variable or a file of the daemon's: only the config file may
    (else a client could have the daemon send its secrets to a URL of the client's choosing)."""
    hooks = [spec.webhook, *(alert.webhook for alert in spec.alerts.values())]
    if any(h is not None and (h.token_env is not None or h.token_file is not None) for h in hooks):
        raise StreamForbidden("a webhook's token_env or token_file can only be configured in the config file's "
                              "streams: the API may give a webhook url only")


def api_may_post_to(spec: StreamConfig, hosts: list[str]) -> None:
    """A webhook URL from the API is a request the daemon makes for the client: only to the
    hosts of server.webhook_hosts (else a client could reach what only the daemon can: its
    own loopback ports, the cloud's metadata address, the LAN)."""
    hooks = [spec.webhook, *(alert.webhook for alert in spec.alerts.values())]
    for hook in hooks:
        if hook is None or webhook_allowed(hook.url, hosts):
            continue
        if not hosts:
            raise StreamForbidden("the API may not give webhook URLs: server.webhook_hosts is empty (list there the "
                                  "hosts POST /v1/streams may send alert events to)")
        host, port = url_host(hook.url) or ("?", 0)
        raise StreamForbidden(f"a webhook to {host} port {port} is not in server.webhook_hosts "
                              f"({', '.join(hosts)})")


def api_may_connect_to(spec: StreamConfig, hosts: list[str]) -> None:
    """A network source from the API is a connection the daemon makes for the client: only to
    the hosts of server.source_hosts (else a client could reach its loopback ports, the cloud's
    metadata address, the LAN, and read from the stream's state whether a port answers)."""
    try:
        target = network_address(spec.source)
    except SourceError as e:
        raise StreamSpecError(str(e), "source") from None
    if target is None or host_allowed(target, hosts):
        return
    if not hosts:
        raise StreamForbidden("the API may not start network sources: server.source_hosts is empty (list there "
                              "the cameras' hosts POST /v1/streams may connect to)")
    raise StreamForbidden(f"a source at {target[0]} port {target[1]} is not in server.source_hosts "
                          f"({', '.join(hosts)})")


def without_secrets(spec: dict) -> dict:
    """A stream's config as GET /v1/streams shows it: a webhook URL is shown as its scheme and
    host only (a webhook's path often is its secret, as Slack's and Teams' are), a source's
    user:password@ as ***@ (an RTSP camera's credentials)."""
    def hidden(hook: dict | None) -> dict | None:
        if hook is None:
            return None
        parts = urllib.parse.urlsplit(hook["url"])
        return {**hook, "url": f"{parts.scheme}://{parts.hostname or ''}/…"}
    return {**spec, "source": redact_uri(spec["source"]), "webhook": hidden(spec.get("webhook")),
            "alerts": {name: {**alert, "webhook": hidden(alert.get("webhook"))}
                       for name, alert in spec.get("alerts", {}).items()}}
