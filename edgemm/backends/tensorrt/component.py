"""TensorRT backend: prebuilt engine plans on the GPU or a DLA core, same Component interface
as onnxruntime (named numpy inputs → named numpy outputs), so nothing above knows which runs.

- TensorRT >= 8.6 named-tensor API: `num_io_tensors`, `get_tensor_name/mode/dtype`,
  `set_input_shape`, `set_tensor_address`, `execute_async_v3`.
- One execution context and one CUDA stream per engine: a DLA encoder and a GPU decoder,
  driven by different pipeline threads, run concurrently. A context, its stream and its
  buffers may be driven by one thread at a time: the pipeline calls each component from
  one stage thread only, and a component's run holds its own lock besides, so a second
  caller (a warm-up, a tool) waits instead of corrupting bindings mid-enqueue.
- `runtime.DLA_core` is set before a DLA plan is deserialised (the plan is bound to a core
  at load time); `deserialize_cuda_engine` returning None becomes a one-line EngineError.
- Buffers are allocated per tensor and reused; a larger shape grows one to the next power
  of two, so a KV cache that grows by one position per token reallocates log2(n) times in
  a request and not at all in the next one at that shape. On Jetson (integrated GPU, DRAM
  shared with the CPU) they are mapped pinned host memory: the engine reads and writes
  them in place, no copies. Discrete GPUs keep pinned host buffers plus device buffers,
  and async copies on the engine's stream move exactly each tensor's bytes.
- Every CUDA or TensorRT failure to start, deserialise or run is a one-line EngineError,
  so placement falls back to the next listed device.
- A DLA encoder has one static-shape plan per tier; the component picks the plan (and on
  the GPU decoder, the optimisation profile: prefill or single-token decode) whose shape
  ranges accept the feeds, and splits a batch larger than the plan takes into rows. A
  family-fed encoder's inputs (Qwen2-VL: flat patches and their grid) share no batch axis;
  its family's splitter (GraphInputs.split_encoder_feeds) cuts them into images instead,
  and the parts' features are concatenated back.
- Tensors are fed and read in the engine's declared dtype. A strongly typed DLA plan has FP16
  inputs and outputs where its ONNX graph has FP32 (the build converts them: the manifest's
  `fp16_io`); the component still takes and gives FP32 there, as the CPU path does, and
  converts on the way into and out of the buffers, which hold exactly the FP16 bytes.

tensorrt and CUDA (edgemm.backends.tensorrt.cuda: cuda-python, else pycuda) are imported when a backend
is made, never at edgemm import.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemm.backends.base import RunStats, TensorSpec
from edgemm.backends.tensorrt.manifest import EngineEntry, rebuild_command, select_engines
from edgemm.backends.errors import CudaError
from edgemm.backends.tensorrt.cuda import Cuda
from edgemm.backends.tensorrt.platform import (Platform, TrtLog, dla_core, import_cuda, import_tensorrt, probe,
                                     require_device, trt_log, trt_runtime)
from edgemm.errors import BackendError, EngineError

log = logging.getLogger("edgemm")
ENGINE_PRECISIONS = ("int8", "fp16")
Splitter = Callable[[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]


def capacity_for(nbytes: int) -> int:
    """A buffer's size for `nbytes`: the next power of two, at least 256 (never a null address)."""
    return max(256, 1 << max(0, nbytes - 1).bit_length())


class _Buffer:
    """One tensor's memory: mapped pinned host memory (zero-copy) or pinned host + device."""

    def __init__(self, cuda: Cuda, nbytes: int, zero_copy: bool):
        self.capacity = capacity_for(nbytes)
        self.zero_copy = zero_copy
        self.host = cuda.host_alloc(self.capacity, mapped=zero_copy)
        if zero_copy:
            self.device_ptr = self.host.device_ptr
        else:
            self.device = cuda.device_alloc(self.capacity)
            self.device_ptr = self.device.ptr

    def view(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.host.array[:nbytes].view(dtype).reshape(shape)


@dataclass
class _Profile:
    index: int
    ranges: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # input → (min shape, max shape)

    def accepts(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        for name, shape in shapes.items():
            low, high = self.ranges[name]
            if len(shape) != len(low) or any(s < a or s > b for s, a, b in zip(shape, low, high)):
                return False
        return True


class _Engine:
    """One deserialised plan: its context, stream, profiles and reusable buffers."""

    def __init__(self, trt, cuda: Cuda, engine, runtime, path: Path, zero_copy: bool, trt_logging: TrtLog,
                 fp16_io: tuple[str, ...] = ()):
        self.trt, self.cuda, self.engine, self.path = trt, cuda, engine, path
        self.trt_log = trt_logging
        self._runtime = runtime  # the engine must not outlive its runtime
        self.context = engine.create_execution_context()
        if self.context is None:
            raise EngineError(f"TensorRT could not create an execution context for {path} (out of memory?)")
        self.stream = cuda.stream()
        self.zero_copy = zero_copy
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}  # the engine's
        # what edgemm feeds and gets back: FP32 where the build gave the plan FP16 for the DLA's boundary
        # (EngineEntry.fp16_io), the engine's own dtype everywhere else (an _fp16 graph's FP16 stays FP16)
        self.host_dtypes = {n: np.dtype(np.float32) if n in fp16_io else d for n, d in self.dtypes.items()}
        self.profiles = [self._profile(i) for i in range(engine.num_optimization_profiles)]
        self.active_profile = 0
        self.buffers: dict[str, _Buffer] = {}

    def _profile(self, index: int) -> _Profile:
        ranges = {}
        for name in self.inputs:
            static = tuple(self.engine.get_tensor_shape(name))
            if all(d >= 0 for d in static):  # static plans (DLA) have no profile ranges to ask for
                ranges[name] = (static, static)
                continue
            low, _opt, high = self.engine.get_tensor_profile_shape(name, index)
            ranges[name] = (tuple(low), tuple(high))
        return _Profile(index, ranges)

    def spec(self, name: str) -> TensorSpec:
        shape = tuple(d if d >= 0 else None for d in self.engine.get_tensor_shape(name))
        return TensorSpec(name, self.host_dtypes[name], shape)

    def profile_for(self, shapes: dict[str, tuple[int, ...]]) -> _Profile | None:
        return next((p for p in self.profiles if p.accepts(shapes)), None)

    def _buffer(self, name: str, nbytes: int) -> _Buffer:
        buffer = self.buffers.get(name)
        if buffer is None or buffer.capacity < nbytes:
            nbytes = max(nbytes, 2 * buffer.capacity if buffer is not None else 0)  # grow by doubling at least
            try:
                buffer = _Buffer(self.cuda, nbytes, self.zero_copy)
            except CudaError as e:  # mapping refused: fall back to copies, say so once
                if not self.zero_copy:
                    raise
                log.warning("zero-copy buffers unavailable (%s); using device copies for %s", e, self.path.name)
                self.zero_copy = False
                buffer = _Buffer(self.cuda, nbytes, False)
            self.buffers[name] = buffer
        return buffer

    def run(self, feeds: dict[str, np.ndarray], profile: _Profile) -> dict[str, np.ndarray]:
        ctx, stream = self.context, self.stream
        if profile.index != self.active_profile:
            ctx.set_optimization_profile_async(profile.index, stream.handle)
            self.active_profile = profile.index
        for name in self.inputs:
            # in the engine's dtype: int64 ids → int32 on TRT 8.6, FP32 pixels → FP16 at a DLA's boundary
            value = np.ascontiguousarray(feeds[name], dtype=self.dtypes[name])
            if not ctx.set_input_shape(name, value.shape):
                raise BackendError(f"{self.path.name}: TensorRT refused shape {value.shape} for {name}")
            buffer = self._buffer(name, value.nbytes)
            np.copyto(buffer.view(value.shape, value.dtype), value)
            if not buffer.zero_copy:
                self.cuda.copy_to_device(buffer.device_ptr, buffer.host, value.nbytes, stream)
            ctx.set_tensor_address(name, buffer.device_ptr)
        shapes = {}
        for name in self.outputs:
            shapes[name] = tuple(ctx.get_tensor_shape(name))
            nbytes = int(np.prod(shapes[name], dtype=np.int64)) * self.dtypes[name].itemsize
            ctx.set_tensor_address(name, self._buffer(name, nbytes).device_ptr)
        self.trt_log.forget()
        if not ctx.execute_async_v3(stream.handle):
            reason = self.trt_log.last_error()
            raise EngineError(f"{self.path.name}: TensorRT execution failed"
                              + (f": {reason}" if reason else " (TensorRT logged no reason)"))
        for name in self.outputs:
            buffer = self.buffers[name]
            if not buffer.zero_copy:
                nbytes = int(np.prod(shapes[name], dtype=np.int64)) * self.dtypes[name].itemsize
                self.cuda.copy_to_host(buffer.host, buffer.device_ptr, nbytes, stream)
        stream.synchronize()
        # copies (the buffers are reused by the next call), in the dtype edgemm uses: FP16 → FP32 at a DLA's boundary
        return {name: self.buffers[name].view(shapes[name], self.dtypes[name]).astype(self.host_dtypes[name])
                for name in self.outputs}


class TrtComponent:
    """A component (encoder, embedding, decoder) backed by one or more plans on one device."""

    def __init__(self, name: str, device: str, precision: str, engines: list[_Engine], cuda_context,
                 trt_version: str, split_feeds: Splitter | None = None):
        """`split_feeds`: a family-fed encoder's feeds of several images → each image's (its
        GraphInputs.split_encoder_feeds), for plans that take one image per call."""
        self.name, self.device, self.precision = name, device, precision
        self.split_feeds = split_feeds
        self.provider = f"TensorRT {trt_version} {device.upper()}"
        self.engines = engines
        self._cuda_context = cuda_context
        first = engines[0]
        self.inputs = {n: first.spec(n) for n in first.inputs}
        self.outputs = {n: first.spec(n) for n in first.outputs}
        self.stats = RunStats()
        # binding shapes and addresses, enqueue and sync on the engines' contexts: one caller at a time
        self._lock = threading.Lock()

    def release_memory(self) -> None:
        """Nothing to hand back: an execution context's device memory is sized once, for the
        largest shapes of its optimisation profiles, when the engine is loaded."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            started = time.perf_counter()
            self._cuda_context.push()  # pipeline stages run in their own threads
            try:
                result = self._run(feeds)
            finally:
                self._cuda_context.pop()
            self.stats.add(started)  # RunStats is not thread-safe either
        return result

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shapes = {k: tuple(np.shape(v)) for k, v in feeds.items()}
        for engine in self.engines:
            profile = engine.profile_for(shapes)
            if profile is not None:
                return engine.run(feeds, profile)
        if self.split_feeds is not None:
            # a family-fed encoder (flattened patches and their grid have no common batch axis):
            # the family splits its feeds into images; a static plan (DLA) takes one per call
            parts = self.split_feeds(feeds)
            if len(parts) > 1:
                outputs = [self._run(part) for part in parts]
                return {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}
        # the rows of a batch, if every input has them
        batches = {shape[0] for shape in shapes.values() if shape}
        batch = batches.pop() if len(batches) == 1 else 0
        if batch > 1:  # static-batch plans (DLA): one row at a time, outputs stacked back
            rows = [self._run({k: v[i:i + 1] for k, v in feeds.items()}) for i in range(batch)]
            return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
        tiles = shapes.get("pixel_values", ())[1:2]
        if len(shapes.get("pixel_values", ())) == 5 and tiles[0] > 1:
            # a tiled encoder's one-tile plan (DLA): pixel_values [1,T,3,H,W] and its mask [1,T,H,W]
            # tile by tile; the graph puts the tiles in its output's first axis, so they stack there
            parts = [self._run({k: v[:, t:t + 1] for k, v in feeds.items()}) for t in range(tiles[0])]
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        raise BackendError(f"{self.name} on {self.device}: no engine accepts input shapes {shapes} "
                           f"(plans: {', '.join(e.path.name for e in self.engines)})")


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, platform: Platform, engines_dir: Path, model_dir: Path, model_name: str,
                 tiers: list[str]):
        self.trt = import_tensorrt()
        self.cuda = import_cuda()
        self.platform = platform
        self.engines_dir, self.model_dir, self.model_name, self.tiers = engines_dir, model_dir, model_name, tiers
        self.trt_log = trt_log(self.trt)
        # the primary context is the one TensorRT's runtime API calls use too
        self.cuda_context = self.cuda.primary_context(0)

    @classmethod
    def for_model(cls, manifest, engines_dir: Path) -> "TensorRTBackend":
        """For a loaded ModelManifest; probes the platform once."""
        return cls(probe(), Path(engines_dir), manifest.path, manifest.name, list(manifest.tiers))

    def load_component(self, name: str, device: str, precision: str,
                       split_feeds: Splitter | None = None) -> TrtComponent:
        """`name`'s plans for `device` from the engine manifest, checked, then deserialised.
        `split_feeds`: see TrtComponent."""
        if precision not in ENGINE_PRECISIONS:
            raise EngineError(f"{name} on {device}: TensorRT engines are int8 or fp16, model.precision is "
                              f"{precision} (set model.precision: int8 or fp16)")
        require_device(self.platform, device)
        plans = select_engines(self.engines_dir, self.model_dir, self.model_name, name, device, precision,
                               self.tiers, self.platform)
        engines = [self._deserialize(path, entry) for entry, path in plans]
        return TrtComponent(name, device, precision, engines, self.cuda_context, self.platform.tensorrt,
                            split_feeds)

    def load(self, name: str, path: Path, precision: str) -> TrtComponent:
        """The Backend protocol: one plan file on the GPU, without a manifest."""
        return TrtComponent(name, "gpu", precision, [self._deserialize(Path(path), None)], self.cuda_context,
                            self.platform.tensorrt)

    def _deserialize(self, path: Path, entry: EngineEntry | None) -> _Engine:
        core = dla_core(entry.device) if entry is not None else None
        self.cuda_context.push()
        try:
            runtime = trt_runtime(self.trt, self.trt_log)
            if core is not None:
                runtime.DLA_core = core  # before deserialising: the plan's DLA loadable binds to it
            self.trt_log.forget()
            try:
                engine = runtime.deserialize_cuda_engine(path.read_bytes())
            except (TypeError, RuntimeError):  # some releases raise where others return None
                engine = None
            if engine is None:
                again = (rebuild_command(self.model_dir, self.engines_dir, entry.component, entry.device,
                                         entry.precision, entry.tier) if entry else "tools/build_engines.py")
                reason = self.trt_log.last_error()
                raise EngineError(f"TensorRT {self.platform.tensorrt} could not deserialise {path}"
                                  + (f": {reason}" if reason else " (built by another TensorRT or for another "
                                                                  "device?)") + f"; rebuild with: {again}")
            return _Engine(self.trt, self.cuda, engine, runtime, path, self.platform.integrated, self.trt_log,
                           tuple(entry.fp16_io) if entry is not None else ())
        finally:
            self.cuda_context.pop()
