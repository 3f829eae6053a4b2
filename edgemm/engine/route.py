"""Where one request's stages run (a `Route`) and which devices a stage may be given.

The engine reads a Route (each stage's device); the power policy (edgemm/power/policy.py)
decides it. Both live here, below the policy, so the engine never imports the policy.
"""
from __future__ import annotations

from dataclasses import dataclass

STAGES = ("vision_encoder", "embed_tokens", "decoder")


@dataclass(frozen=True)
class Route:
    """Where each stage of one request runs, and why: the policy's per-request choice
    (what PreparedRequest.route holds). Not edgemm.engine.placement.Placement, which records
    where a component was loaded."""
    stages: dict[str, str]  # stage → gpu | dla0 | dla1 | cpu | cloud
    reason: str
    conditions: frozenset[str] = frozenset()  # critical, hot, over_budget, slo_miss, slo_at_risk

    @property
    def cloud(self) -> bool:
        return all(device == "cloud" for device in self.stages.values())

    def to_dict(self) -> dict:
        return {"stages": dict(self.stages), "reason": self.reason, "conditions": sorted(self.conditions)}


def pick_device(candidates: list[str], mode: str, dla_cores: int | None) -> str:
    """The stage's device: DLA cores the module lacks are skipped; `mode` reorders what's left."""
    usable = [d for d in candidates if not d.startswith("dla") or int(d[3:]) < (dla_cores or 0)]
    if not usable:
        return "gpu"  # only DLA listed and none here: TensorRT's GPU fallback
    if mode == "efficient":
        return next((d for d in usable if d.startswith("dla")), usable[0])
    if mode == "fast":
        return "gpu" if "gpu" in usable else usable[0]
    return usable[0]


def reachable_devices(candidates: list[str]) -> list[str]:
    """Every device `pick_device` can give a stage with this list, in list order, on any
    module (0–2 DLA cores) in any mode: what is worth loading so the policy can move it."""
    picked = {pick_device(candidates, mode, cores) for mode in ("preferred", "efficient", "fast")
              for cores in (0, 1, 2)}
    return [d for d in candidates if d in picked]
