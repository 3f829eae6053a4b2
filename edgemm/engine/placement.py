"""Placement: put each component on the first device of its list that loads.

`placement.vision_encoder: [dla0, gpu, cpu]` means: try the DLA engine, then the GPU
engine, then onnxruntime. A device that fails (no TensorRT here, no engine, an engine
built for another TensorRT, no DLA core …) is recorded with its one-line reason, so
`Runtime.placements` and the logs say why the encoder ended up where it did.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from edgemm.backends.base import Component
from edgemm.errors import EdgemmError, EngineError

log = logging.getLogger("edgemm")

# (component, device) → a loaded component; raises EdgemmError when that device can't take it
Loader = Callable[[str, str], Component]


@dataclass
class Placement:
    component: str
    device: str  # the placement entry that loaded: gpu | dla0 | dla1 | cpu
    backend: str  # tensorrt | onnxruntime (what the loader produced)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (device, why it did not load), in order
    standby: list[str] = field(default_factory=list)  # also loaded there, for the power policy to move it to

    def to_dict(self) -> dict:
        return {"device": self.device, "backend": self.backend, "standby": list(self.standby),
                "skipped": [{"device": d, "reason": why} for d, why in self.skipped]}


def place(component: str, devices: list[str], load: Loader) -> tuple[Component, Placement]:
    """Load `component` on the first of `devices` that works.

    With one device, its own error is raised unchanged (the single-device default keeps
    its familiar messages); with several, one line lists every device and its reason.
    """
    skipped: list[tuple[str, str]] = []
    for device in devices:
        try:
            loaded = load(component, device)
        except EdgemmError as e:
            if len(devices) == 1:
                raise
            skipped.append((device, str(e)))
            log.warning("%s: not on %s: %s", component, device, e)
            continue
        backend = "onnxruntime" if device == "cpu" else "tensorrt"
        return loaded, Placement(component, device, backend, skipped)
    reasons = "; ".join(f"{device}: {why}" for device, why in skipped)
    raise EngineError(f"{component}: none of placement.{component} {devices} could load it ({reasons})")
