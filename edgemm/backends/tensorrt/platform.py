"""The platform engines are built for and checked against: TensorRT version, GPU, DLA cores.

A plan only deserialises on the TensorRT version and GPU architecture that built it, and
a DLA plan needs its DLA core, so every build records this and every load compares it.
tensorrt and CUDA (edgemm.backends.tensorrt.cuda) are imported here, lazily, only when a probe is asked for.

TensorRT's own messages (a layer falling back from the DLA, why a plan did not deserialise
or a run failed) go through `trt_log`: to the `edgemm` logger, since the stock trt.Logger
writes them from C++ to fd 2, which `infer`, `stream` and `serve` point at /dev/null
(edgemm.util.library_noise); and the last error is kept for the one-line EngineError.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from edgemm.backends.tensorrt.cuda import Cuda, load_cuda
from edgemm.errors import EngineError, one_line

log = logging.getLogger("edgemm")
DEVICES = ("gpu", "dla0", "dla1")
MISSING = ("TensorRT is not installed here (on a Jetson: JetPack's TensorRT Python bindings, "
           "then pip install 'edgemm[tensorrt]' for cuda-python)")


@dataclass(frozen=True)
class Platform:
    tensorrt: str  # e.g. "10.3.0"
    gpu: str  # device name, e.g. "Orin"
    compute_capability: str  # e.g. "8.7"
    integrated: bool  # the GPU shares DRAM with the CPU (Jetson): zero-copy buffers pay off
    dla_cores: int  # 2 on AGX Orin and Orin NX, 0 on Orin Nano, Thor and discrete GPUs


def dla_core(device: str) -> int | None:
    """'dla1' → 1; 'gpu' → None."""
    return int(device[3:]) if device.startswith("dla") else None


def require_device(platform: Platform, device: str) -> None:
    """Refuse a DLA core this module does not have, with the reason in one line."""
    core = dla_core(device)
    if core is None:
        return
    if platform.dla_cores == 0:
        raise EngineError(f"{device}: this module ({platform.gpu}) has no DLA cores "
                          "(Orin Nano and Thor have none; AGX Orin and Orin NX have two); use gpu")
    if core >= platform.dla_cores:
        raise EngineError(f"{device}: this module ({platform.gpu}) has {platform.dla_cores} DLA core(s), "
                          f"dla0..dla{platform.dla_cores - 1}")


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineError(MISSING) from None
    return trt


def import_cuda() -> Cuda:
    """The CUDA driver, started (cuda-python, else pycuda); a CudaError says why it would not."""
    return load_cuda()


class TrtLog:
    """TensorRT's log, as the `edgemm` logger's lines ("TensorRT: …"), from WARNING up; and the
    last error each thread got, for the EngineError of the call that failed on that thread.
    `ilogger` is what trt.Runtime, trt.Builder and trt.OnnxParser take."""

    def __init__(self, trt, least: int = logging.WARNING):
        levels = {int(trt.ILogger.INTERNAL_ERROR): logging.CRITICAL, int(trt.ILogger.ERROR): logging.ERROR,
                  int(trt.ILogger.WARNING): logging.WARNING, int(trt.ILogger.INFO): logging.INFO,
                  int(trt.ILogger.VERBOSE): logging.DEBUG}
        sink = self

        class EdgemmLogger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)  # pybind11: without it the C++ half does not exist

            def log(self, severity, msg):
                sink._record(levels.get(int(severity), logging.ERROR), msg)

        self.ilogger = EdgemmLogger()
        self._least = least
        self._errors = threading.local()  # the encode and decode threads run engines at once

    def _record(self, level: int, msg) -> None:
        text = one_line(str(msg))
        if level >= logging.ERROR:
            self._errors.last = text
        if level >= self._least:
            log.log(level, "TensorRT: %s", text)

    def forget(self) -> None:
        """Before a call whose failure should carry its own reason, not an older one."""
        self._errors.last = None

    def last_error(self) -> str | None:
        return getattr(self._errors, "last", None)


_LOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def trt_log(trt) -> TrtLog:
    """The process's one TrtLog for this tensorrt module: TensorRT keeps the first logger it is
    given as its global one, so every runtime and builder is given the same."""
    found = _LOGS.get(trt)
    if found is None:
        found = _LOGS[trt] = TrtLog(trt)
    return found


def trt_runtime(trt, trt_logging: TrtLog):
    """trt.Runtime with edgemm's logger; TensorRT reports a CUDA that will not start as a TypeError
    ('factory function returned nullptr'), which becomes a one-line EngineError here, with the
    reason TensorRT logged when it did."""
    trt_logging.forget()
    try:
        runtime = trt.Runtime(trt_logging.ilogger)
    except (TypeError, RuntimeError) as e:
        reason = trt_logging.last_error()
        raise EngineError(f"TensorRT {trt.__version__} could not start its runtime: " + (
            reason or f"{one_line(str(e))} (CUDA unusable?)")) from None
    if runtime is None:
        raise EngineError(f"TensorRT {trt.__version__} could not start its runtime: "
                          + (trt_logging.last_error() or "CUDA unusable?"))
    return runtime


def probe() -> Platform:
    """The running TensorRT, GPU 0 and its DLA cores."""
    trt = import_tensorrt()
    cuda = import_cuda()
    if cuda.device_count() == 0:
        raise EngineError("no CUDA device is visible (is this user in the 'video' and 'render' groups?)")
    device = cuda.device_info(0)
    runtime = trt_runtime(trt, trt_log(trt))
    return Platform(tensorrt=trt.__version__, gpu=device.name, compute_capability=device.compute_capability,
                    integrated=device.integrated, dla_cores=int(runtime.num_DLA_cores))


def version_tuple(version: str) -> tuple[int, ...]:
    """'10.3.0.30' → (10, 3, 0); non-numeric parts end the tuple."""
    parts = []
    for part in version.split(".")[:3]:
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)
