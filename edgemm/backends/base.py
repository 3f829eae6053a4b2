"""The Backend protocol: load a graph on a device, run named inputs → named outputs.

Everything above the backends (generation, pipeline, daemon) speaks only this,
so ONNX Runtime on a laptop and TensorRT on a Jetson are interchangeable.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    shape: tuple  # ints for fixed axes, str (symbolic name) or None for dynamic ones


@dataclass
class RunStats:
    """Time spent inside the backend's raw run calls (for overhead accounting)."""
    calls: int = 0
    seconds: float = 0.0

    def add(self, started: float) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - started


class Component(Protocol):
    """One loaded graph (encoder, embedding or decoder) on one device."""
    name: str
    device: str  # cpu | gpu | dla0 | dla1
    precision: str  # fp32 | fp16 | int8
    provider: str  # what actually runs it, e.g. "CPUExecutionProvider"
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    stats: RunStats

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def release_memory(self) -> None:
        """Hand back memory held for inputs larger than usual (e.g. after a trial batch);
        may take effect at the next run."""


class Backend(Protocol):
    name: str

    def load(self, name: str, path: Path, precision: str) -> Component: ...


@dataclass
class LoadedComponents:
    vision_encoder: Component
    embed_tokens: Component
    decoder: Component
    extra: dict = field(default_factory=dict)

    def all(self) -> list[Component]:
        return [self.vision_encoder, self.embed_tokens, self.decoder]
