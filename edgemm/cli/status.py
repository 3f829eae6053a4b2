"""`edgemm status`: the daemon's GET /v1/status when it runs, else what this machine shows now.

Without a daemon there are no loaded components, queues or cache to report; telemetry
and the placement the policy would choose for an idle queue are computed here from
the same config.
"""
from __future__ import annotations

import urllib.parse

import httpx

from edgemm.config import Config
from edgemm.server.sockets import client_socket
from edgemm.errors import EdgemmError
from edgemm.power.offload import read_api_key
from edgemm.power.policy import Load, PowerPolicy
from edgemm.power.telemetry import Sensors


def collect(cfg: Config, socket_path: str | None = None, timeout_s: float = 5.0) -> dict:
    path = socket_path or client_socket(cfg.server)
    report = from_daemon(path, timeout_s)
    if report is not None:
        return {**report, "socket": path}
    return {**here_and_now(cfg), "daemon": "not running", "socket": path}


def from_daemon(path: str, timeout_s: float) -> dict | None:
    """The daemon's /v1/status, or None when nothing answers on the socket."""
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=timeout_s) as client:
            response = client.get("http://edgemm/v1/status")
    except (httpx.HTTPError, OSError):
        return None
    if response.status_code != 200:
        raise EdgemmError(f"the daemon on {path} answered /v1/status with HTTP {response.status_code}")
    return response.json()


def here_and_now(cfg: Config) -> dict:
    telemetry = Sensors.discover(cfg.power.root, cfg.power.nvpmodel_query).read()
    offload = offload_config_state(cfg)
    placement = PowerPolicy.from_config(cfg).decide(telemetry, Load(), "closed" if offload["enabled"] else "off")
    return {"model": None, "telemetry": telemetry.to_dict(), "placement": placement.to_dict(),
            "last_placement": None, "power": None, "components": None, "offload": offload, "cache": None,
            "queue": None, "streams": None, "health": None}


def offload_config_state(cfg: Config) -> dict:
    """What the config says about offload; the key is checked for presence, never shown."""
    offload = cfg.offload
    if not offload.enabled:
        return {"enabled": False, "breaker": "off"}
    try:
        key = "set" if read_api_key(offload) else "none"
    except EdgemmError as e:
        key = f"problem: {e}"
    return {"enabled": True, "endpoint": urllib.parse.urlsplit(offload.url).hostname, "model": offload.model,
            "key": key, "breaker": "closed"}


def render(report: dict) -> list[str]:
    """The report as aligned lines for people."""
    t = report.get("telemetry") or {}
    lines = [("daemon", daemon_line(report))]
    if report.get("health"):
        lines.append(("health", health_line(report["health"])))
    lines += [("power", power_line(t)), ("thermal", thermal_line(t)),
             ("gpu load", "absent" if t.get("gpu_load") is None else f"{t['gpu_load'] * 100:.0f} %"),
             ("power mode", t.get("nvpmodel") or "absent"),
             ("dla cores", "absent" if t.get("dla_cores") is None else str(t["dla_cores"]))]
    placement = report["placement"]
    lines += [("placement", " ".join(f"{k}={v}" for k, v in placement["stages"].items())),
              ("  why", placement["reason"])]
    if report.get("components"):
        lines.append(("components", ", ".join(
            f"{k}: {v['device']} ({v['precision']}, {v['provider']})"
            + (f" + standby {'/'.join(v['standby'])}" if v.get("standby") else "")
            for k, v in report["components"].items())))
    lines.append(("offload", offload_line(report["offload"])))
    if report.get("cache"):
        c = report["cache"]
        lines.append(("cache", f"{c['entries']} entries, {c['bytes'] / 2**20:.1f} of {c['max_bytes'] / 2**20:.0f} MiB, "
                               f"{c['hits']} hits, {c['misses']} misses"))
    if report.get("queue"):
        q = report["queue"]
        depths = ", ".join(f"{k} {v}" for k, v in q["depths"].items())
        lines.append(("queue", f"{q['in_flight']} in flight of {q['limit']}; waiting: {depths}; "
                               f"{q['completed']} answered, {q['failed']} failed, {q['rejected']} refused"))
        if "encoder_batch" in q:
            per_tier = ", ".join(f"{tier} {n}" for tier, n in q["encoder_batch"].items())
            lines.append(("batching", f"encoder images per call: {per_tier}; decoder up to {q['decoder_batch']} "
                                      f"requests, continuous_batching {q['continuous_batching']}"))
    energy = (report.get("power") or {}).get("energy_j") or {}
    if energy.get("requests"):
        lines.append(("energy", f"{energy['mean']:.3f} J per request (mean of {energy['requests']})"))
    return [f"{name:<11} {text}" for name, text in lines]


def daemon_line(report: dict) -> str:
    if report["daemon"] == "not running":
        return f"not running (nothing answers on {report['socket']})"
    return f"{report['daemon']} {report['model']} ({report['precision']}) on {report['socket']}"


def health_line(health: dict) -> str:
    if health.get("ok"):
        return f"ok (stall limit {health.get('stall_s', '?')} s)"
    return f"UNHEALTHY: {health.get('reason')} (no watchdog pings: systemd restarts the unit)"


def power_line(t: dict) -> str:
    rails = t.get("rails_w") or {}
    if not rails:
        return "absent (no INA3221 power monitor found)"
    total = "unknown" if t.get("total_w") is None else f"{t['total_w']:.2f} W"
    return total + " (" + ", ".join(f"{k} {'?' if v is None else f'{v:.2f}'}" for k, v in rails.items()) + ")"


def thermal_line(t: dict) -> str:
    if not t.get("hottest"):
        return "absent (no readable thermal zone)"
    others = ", ".join(f"{k} {v:.1f}" for k, v in t["temps_c"].items() if v is not None)
    return f"hottest {t['hottest']['zone']} {t['hottest']['c']:.1f} °C ({others})"


def offload_line(state: dict) -> str:
    if not state.get("enabled"):
        return "off"
    line = f"on: {state['endpoint']} model {state['model']}, key {state['key']}, breaker {state['breaker']}"
    if "requests" in state:
        line += (f"; {state['requests']} requests, {state['failed']} failed, {state['refused']} refused, "
                 f"{state.get('fallbacks_to_local', 0)} answered locally")
    return line
