"""ONNX Runtime backend: CPU by default, CUDA / TensorRT execution providers when asked for.

Providers are tried in the configured order; the one that actually runs a graph is
read back from the session and reported, so "I asked for CUDA" never silently
means "it ran on the CPU".
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgemm.backends.base import RunStats, TensorSpec
from edgemm.backends.errors import ProviderUnavailable
from edgemm.errors import BackendError, ModelError

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
DEVICE_OF = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "gpu",
             "TensorrtExecutionProvider": "gpu"}
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
              "tensor(uint8)": np.uint8, "tensor(int8)": np.int8, "tensor(double)": np.float64}


def _specs(args) -> dict[str, TensorSpec]:
    return {a.name: TensorSpec(a.name, np.dtype(ORT_DTYPES.get(a.type, np.float32)), tuple(a.shape))
            for a in args}


class OrtComponent:
    def __init__(self, name: str, session: ort.InferenceSession, precision: str):
        self.name = name
        self.session = session
        self.precision = precision
        self.provider = session.get_providers()[0]
        self.device = DEVICE_OF.get(self.provider, "cpu")
        self.inputs = _specs(session.get_inputs())
        self.outputs = _specs(session.get_outputs())
        self._output_names = list(self.outputs)
        self.stats = RunStats()
        # when set, the next run hands the arena's free memory back after it (release_memory)
        self.shrink_next = False
        self._shrink = ort.RunOptions()
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage",
                                          "cpu:0" if self.device == "cpu" else "cpu:0;gpu:0")

    def release_memory(self) -> None:
        """onnxruntime's arena keeps what its largest run needed: the next run shrinks it."""
        self.shrink_next = True

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        options, self.shrink_next = (self._shrink if self.shrink_next else None), False
        values = self.session.run(self._output_names, feeds, options)
        self.stats.add(started)
        return dict(zip(self._output_names, values))


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, providers: list[str] | None = None, intra_op_threads: int = 0, spin: bool = True):
        providers = providers or ["cpu"]
        unknown = [p for p in providers if p not in PROVIDERS]
        if unknown:
            raise BackendError(f"unknown onnxruntime provider(s) {unknown} (known: {', '.join(PROVIDERS)})")
        available = set(ort.get_available_providers())
        wanted = [PROVIDERS[p] for p in providers]
        self.providers = [p for p in wanted if p in available]
        self.missing = [p for p in wanted if p not in available]
        if not self.providers:
            raise ProviderUnavailable(f"none of backend.providers {providers} is available in this "
                                      f"onnxruntime build (available: {', '.join(sorted(available))})")
        self.intra_op_threads = intra_op_threads
        self.spin = spin  # False: idle intra-op threads sleep instead of spinning (stages share the cores)

    def load(self, name: str, path: Path, precision: str) -> OrtComponent:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        if not self.spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(str(path), options, providers=self.providers)
        except Exception as e:  # onnxruntime raises its own exception types, all alike to us
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"cannot load {name} from {path}: {first}") from None
        return OrtComponent(name, session, precision)
