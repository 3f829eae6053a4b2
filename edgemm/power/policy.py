"""The placement policy: where each stage of a request runs, from telemetry and load.

    Telemetry (edgemm/power/telemetry.py) ───────────────┐
    queue depth, recent latency ─► Load ────────────┼─► PowerPolicy.decide ─► Route
    offload state (off | open | half_open | closed) ┘     (a device per stage + why)

The policy is a pure function of (telemetry, load, offload state, config, previous
placement); the previous placement is an input only for hysteresis. `Governor` is the
small stateful part the daemon keeps: the last placement, the recent latency, energy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from edgemm.config import Config, PlacementConfig, PowerConfig
from edgemm.engine.route import STAGES, Route, pick_device
from edgemm.power.telemetry import Sampler, Telemetry, round_or_none

SLO_RISK = 0.8  # the SLO is "at risk" from 80 % of it: move to the GPU before it is missed
LATENCY_WEIGHT = 0.2  # weight of the newest request in the latency average

@dataclass(frozen=True)
class Load:
    queue_depth: int = 0  # requests admitted locally and not finished
    latency_ms: float | None = None  # recent local request latency; None until one was measured

    @property
    def predicted_ms(self) -> float | None:
        """What a new request would take: everything ahead of it, then itself."""
        return None if self.latency_ms is None else (self.queue_depth + 1) * self.latency_ms


# condition → the offload.allow name that lets it go to the cloud, most urgent first
OFFLOAD_FOR = {"critical": "critical", "slo_miss": "slo", "hot": "hot", "over_budget": "budget"}
THERMAL = {"critical", "hot", "over_budget"}


@dataclass(frozen=True)
class PowerPolicy:
    power: PowerConfig = field(default_factory=PowerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    allow: tuple[str, ...] = ()  # offload.allow: conditions that may send a request to the cloud

    @classmethod
    def from_config(cls, cfg: Config) -> "PowerPolicy":
        return cls(cfg.power, cfg.placement, tuple(cfg.offload.allow))

    def decide(self, telemetry: Telemetry | None, load: Load, offload: str = "off",
               previous: Route | None = None) -> Route:
        """Where each stage runs and why. `offload`: off | open | half_open | closed (breaker state)."""
        found = self.conditions(telemetry, load, previous.conditions if previous else frozenset())
        wanted = [c for c in OFFLOAD_FOR if c in found and OFFLOAD_FOR[c] in self.allow]
        if wanted and offload in ("closed", "half_open"):
            return Route({stage: "cloud" for stage in STAGES}, f"{found[wanted[0]]} → cloud", frozenset(found))
        mode = "efficient" if THERMAL & found.keys() else "fast" if found else "preferred"
        dla = telemetry.dla_cores if telemetry else None
        stages = {stage: pick_device(getattr(self.placement, stage), mode, dla) for stage in STAGES}
        calm = "cool and idle" if telemetry and telemetry.hottest else "no thermal readings"
        why = "; ".join(found.values()) or calm
        if wanted:
            why += f"; offload {'is off' if offload == 'off' else 'breaker ' + offload}"
        why += " → " + {"efficient": "DLA first, to save power", "fast": "GPU first, for latency",
                        "preferred": "configured order"}[mode]
        if any(d.startswith("dla") for d in self.candidates()) and not dla:
            why += " (no DLA on this module)"
        return Route(stages, why, frozenset(found))

    def candidates(self) -> list[str]:
        return [d for stage in STAGES for d in getattr(self.placement, stage)]

    def conditions(self, telemetry: Telemetry | None, load: Load, before: frozenset[str]) -> dict[str, str]:
        """Active conditions → evidence. One that held before ends only past its hysteresis band."""
        cfg, found = self.power, {}
        hottest = telemetry.hottest if telemetry else None
        if hottest is not None:
            zone, c = hottest
            for name, limit in (("critical", cfg.critical_c), ("hot", cfg.throttle_c)):
                if holds(c, limit, limit - cfg.hysteresis_c, name in before):
                    found[name] = f"{name}: {zone} at {c:.1f} °C (threshold {limit:g} °C)"
        keep = 1 - cfg.hysteresis_pct / 100
        watts = telemetry.total_w if telemetry else None
        if cfg.budget_w is not None and watts is not None \
                and holds(watts, cfg.budget_w, cfg.budget_w * keep, "over_budget" in before, strict=True):
            found["over_budget"] = f"over budget: {watts:.1f} W (budget {cfg.budget_w:g} W)"
        predicted = load.predicted_ms
        if cfg.slo_ms is not None and predicted is not None:
            slo = cfg.slo_ms
            if holds(predicted, slo, slo * keep, "slo_miss" in before, strict=True):
                found["slo_miss"] = f"SLO would be missed: {predicted:.0f} ms predicted (SLO {slo:g} ms)"
            elif holds(predicted, slo * SLO_RISK, slo * SLO_RISK * keep, "slo_at_risk" in before):
                found["slo_at_risk"] = f"SLO at risk: {predicted:.0f} ms predicted (SLO {slo:g} ms)"
        return found


def holds(value: float, enter: float, leave: float, was: bool, strict: bool = False) -> bool:
    """A condition starts at `enter` (above it, if strict) and, once on, lasts until below `leave`."""
    started = value > enter if strict else value >= enter
    return started or (was and value >= leave)


# ---- the daemon's side: memory for hysteresis, latency and energy --------------------------------

class Governor:
    """Keeps what the pure policy needs from the past: the last placement and recent latency.

    Used from the daemon's event loop only. Energy per request is the board energy over the
    request's time (so concurrent requests each see the whole board: an upper bound).
    """

    def __init__(self, policy: PowerPolicy, sampler: Sampler | None):
        self.policy, self.sampler = policy, sampler
        self.last: Route | None = None
        self.latency_ms: float | None = None
        self.decisions: dict[str, int] = {}  # "cloud" / "local" → count
        self.energy_total_j = 0.0
        self.energy_requests = 0
        self.last_energy_j: float | None = None

    def decide(self, queue_depth: int, offload: str) -> Route:
        telemetry = self.sampler.latest() if self.sampler else None
        self.last = self.policy.decide(telemetry, Load(queue_depth, self.latency_ms), offload, self.last)
        kind = "cloud" if self.last.cloud else "local"
        self.decisions[kind] = self.decisions.get(kind, 0) + 1
        return self.last

    def observe(self, total_ms: float, local: bool = True) -> float | None:
        """One answered request that took `total_ms`, ending now: updates the latency (local
        requests only: the policy predicts local latency) and returns its energy in J, if known."""
        if local:
            self.latency_ms = total_ms if self.latency_ms is None else \
                (1 - LATENCY_WEIGHT) * self.latency_ms + LATENCY_WEIGHT * total_ms
        end = time.monotonic()
        energy = self.sampler.energy_j(end - total_ms / 1e3, end) if self.sampler else None
        if energy is not None:
            self.energy_total_j += energy
            self.energy_requests += 1
            self.last_energy_j = energy
        return energy

    def figures(self) -> dict:
        mean = self.energy_total_j / self.energy_requests if self.energy_requests else None
        return {"decisions": dict(self.decisions), "latency_ms": round_or_none(self.latency_ms, 1),
                "energy_j": {"last": round_or_none(self.last_energy_j), "mean": round_or_none(mean),
                             "total": round(self.energy_total_j, 3), "requests": self.energy_requests}}
