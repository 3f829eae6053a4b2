"""CUDA from Python for the TensorRT path, in a handful of calls: start the driver, the
primary context pushed and popped, pinned or mapped host memory, device memory, async
copies of exact byte counts, streams.

cuda-python (`cuda-bindings`, pip-installable, imports without a GPU) is the default;
pycuda, where it is installed (JetPack builds it against its CUDA), goes through the same
calls, and is also tried when cuda-python imports but cannot start the driver. Every failure — no driver, no device, out of memory — is a one-line CudaError
(an EngineError), so placement falls back to the next device instead of crashing.
"""
from __future__ import annotations

import ctypes
import importlib
import weakref
from dataclasses import dataclass

import numpy as np

from edgemm.backends.errors import CudaError, CudaMissing
from edgemm.errors import one_line

NO_CUDA = ("neither cuda-python nor pycuda is installed here: pip install 'edgemm[jetson,tensorrt]' "
           "on JetPack 6, 'edgemm[jetpack7,tensorrt]' on JetPack 7, else 'edgemm[tensorrt]'")


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # e.g. "Orin"
    compute_capability: str  # e.g. "8.7"
    integrated: bool  # shares DRAM with the CPU (Jetson)


class HostMemory:
    """Page-locked host memory as a uint8 array; `device_ptr` is its device address when mapped."""

    def __init__(self, array: np.ndarray, device_ptr: int | None, release):
        self.array, self.device_ptr = array, device_ptr
        self._release = weakref.finalize(self, release)
        self._release.atexit = False  # no CUDA calls while the interpreter shuts down


class DeviceMemory:
    """A device allocation; `ptr` is what TensorRT's set_tensor_address takes."""

    def __init__(self, ptr: int, release):
        self.ptr = ptr
        self._release = weakref.finalize(self, release)
        self._release.atexit = False


class Stream:
    def __init__(self, cuda: "Cuda", native, handle: int):
        self._cuda, self.native = cuda, native
        self.handle = handle  # the cudaStream_t as an int: what TensorRT takes

    def synchronize(self) -> None:
        self._cuda.synchronize(self)


class Cuda:
    """The calls the TensorRT backend makes; one subclass per Python binding."""
    name = "cuda"

    def device_count(self) -> int: raise NotImplementedError
    def device_info(self, ordinal: int = 0) -> DeviceInfo: raise NotImplementedError
    def primary_context(self, ordinal: int = 0): raise NotImplementedError  # has push() and pop()
    def stream(self) -> Stream: raise NotImplementedError
    def synchronize(self, stream: Stream) -> None: raise NotImplementedError
    def host_alloc(self, nbytes: int, mapped: bool) -> HostMemory: raise NotImplementedError
    def device_alloc(self, nbytes: int) -> DeviceMemory: raise NotImplementedError
    def copy_to_device(self, device_ptr: int, host: HostMemory, nbytes: int, stream: Stream) -> None:
        raise NotImplementedError
    def copy_to_host(self, host: HostMemory, device_ptr: int, nbytes: int, stream: Stream) -> None:
        raise NotImplementedError


class _PrimaryContext:
    def __init__(self, cuda: "CudaPython", context):
        self._cuda, self._context = cuda, context

    def push(self) -> None:
        self._cuda.call("cuCtxPushCurrent", self._context)

    def pop(self) -> None:
        self._cuda.call("cuCtxPopCurrent")


class CudaPython(Cuda):
    """cuda-python's driver API (`cuda.bindings.driver`): every call returns (CUresult, values…)."""

    def __init__(self, driver, version: str):
        self.driver, self.name = driver, f"cuda-python {version}"
        self.call("cuInit", 0)

    def call(self, function: str, *args):
        try:
            err, *values = getattr(self.driver, function)(*args)
        except Exception as e:  # a missing libcuda is raised, not returned
            raise CudaError(f"CUDA did not start ({function}): {one_line(str(e) or type(e).__name__)}") from None
        if err != self.driver.CUresult.CUDA_SUCCESS:
            described = self.driver.cuGetErrorString(err)
            text = described[1].decode() if described[0] == self.driver.CUresult.CUDA_SUCCESS else ""
            raise CudaError(f"CUDA {function} failed: {getattr(err, 'name', err)}" + (f" ({text})" if text else ""))
        return values[0] if len(values) == 1 else tuple(values)

    def device_count(self) -> int:
        return int(self.call("cuDeviceGetCount"))

    def _attribute(self, name: str, device) -> int:
        return int(self.call("cuDeviceGetAttribute", getattr(self.driver.CUdevice_attribute, name), device))

    def device_info(self, ordinal: int = 0) -> DeviceInfo:
        device = self.call("cuDeviceGet", ordinal)
        name = bytes(self.call("cuDeviceGetName", 256, device)).split(b"\0")[0].decode()
        major = self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR", device)
        minor = self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR", device)
        integrated = bool(self._attribute("CU_DEVICE_ATTRIBUTE_INTEGRATED", device))
        return DeviceInfo(name, f"{major}.{minor}", integrated)

    def primary_context(self, ordinal: int = 0) -> _PrimaryContext:
        device = self.call("cuDeviceGet", ordinal)
        return _PrimaryContext(self, self.call("cuDevicePrimaryCtxRetain", device))

    def stream(self) -> Stream:
        native = self.call("cuStreamCreate", 0)
        return Stream(self, native, int(native))

    def synchronize(self, stream: Stream) -> None:
        self.call("cuStreamSynchronize", stream.native)

    def host_alloc(self, nbytes: int, mapped: bool) -> HostMemory:
        flags = self.driver.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0
        ptr = int(self.call("cuMemHostAlloc", nbytes, flags))
        device_ptr = int(self.call("cuMemHostGetDevicePointer", ptr, 0)) if mapped else None
        array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return HostMemory(array, device_ptr, lambda: self.driver.cuMemFreeHost(ptr))

    def device_alloc(self, nbytes: int) -> DeviceMemory:
        ptr = int(self.call("cuMemAlloc", nbytes))
        return DeviceMemory(ptr, lambda: self.driver.cuMemFree(ptr))

    def copy_to_device(self, device_ptr: int, host: HostMemory, nbytes: int, stream: Stream) -> None:
        self.call("cuMemcpyHtoDAsync", device_ptr, host.array.ctypes.data, nbytes, stream.native)

    def copy_to_host(self, host: HostMemory, device_ptr: int, nbytes: int, stream: Stream) -> None:
        self.call("cuMemcpyDtoHAsync", host.array.ctypes.data, device_ptr, nbytes, stream.native)


class PyCuda(Cuda):
    """pycuda's driver module, without pycuda.autoinit: edgemm manages the context."""

    def __init__(self, driver, version: str):
        self.driver, self.name = driver, f"pycuda {version}"
        self.call(driver.init)

    @staticmethod
    def call(function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as e:  # pycuda raises its own Error classes, or RuntimeError when no device is visible
            raise CudaError(f"CUDA (pycuda) {getattr(function, '__name__', 'call')} failed: "
                            f"{one_line(str(e) or type(e).__name__)}") from None

    def device_count(self) -> int:
        return int(self.call(self.driver.Device.count))

    def device_info(self, ordinal: int = 0) -> DeviceInfo:
        device = self.call(self.driver.Device, ordinal)
        major, minor = self.call(device.compute_capability)
        integrated = self.call(device.get_attribute, self.driver.device_attribute.INTEGRATED)
        return DeviceInfo(self.call(device.name), f"{major}.{minor}", bool(integrated))

    def primary_context(self, ordinal: int = 0):
        device = self.call(self.driver.Device, ordinal)
        return self.call(device.retain_primary_context)

    def stream(self) -> Stream:
        native = self.call(self.driver.Stream)
        return Stream(self, native, int(native.handle))

    def synchronize(self, stream: Stream) -> None:
        self.call(stream.native.synchronize)

    def host_alloc(self, nbytes: int, mapped: bool) -> HostMemory:
        if mapped:
            array = self.call(self.driver.pagelocked_empty, nbytes, np.uint8,
                              mem_flags=self.driver.host_alloc_flags.DEVICEMAP)
            return HostMemory(array, int(self.call(array.base.get_device_pointer)), lambda: None)
        array = self.call(self.driver.pagelocked_empty, nbytes, np.uint8)
        return HostMemory(array, None, lambda: None)  # pycuda frees it with the array

    def device_alloc(self, nbytes: int) -> DeviceMemory:
        allocation = self.call(self.driver.mem_alloc, nbytes)
        memory = DeviceMemory(int(allocation), lambda: None)
        memory.allocation = allocation  # pycuda frees it when this goes
        return memory

    def copy_to_device(self, device_ptr: int, host: HostMemory, nbytes: int, stream: Stream) -> None:
        self.call(self.driver.memcpy_htod_async, device_ptr, host.array[:nbytes], stream.native)

    def copy_to_host(self, host: HostMemory, device_ptr: int, nbytes: int, stream: Stream) -> None:
        self.call(self.driver.memcpy_dtoh_async, host.array[:nbytes], device_ptr, stream.native)


def load_cuda() -> Cuda:
    """The driver started through cuda-python, else pycuda; CudaError when neither can start it.

    A cuda-python that imports may still not start the driver (a cuda-bindings of another CUDA
    major than the driver's, say), while a pycuda built against the local CUDA would: so its
    failure falls through to pycuda, and only when both fail is it an error, naming both."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        first = None
    else:
        version = _version("cuda.bindings")
        try:
            return CudaPython(driver, version)
        except CudaError as e:
            first = f"cuda-python {version}: {e}"
    try:
        driver = importlib.import_module("pycuda.driver")
    except ImportError:
        if first is None:
            raise CudaMissing(NO_CUDA) from None
        raise CudaError(f"{first}; pycuda: not installed") from None
    try:
        return PyCuda(driver, _version("pycuda"))
    except CudaError as e:
        if first is None:
            raise
        raise CudaError(f"{first}; pycuda: {e}") from None


def installed_bindings() -> list[str]:
    """The bindings that import here, in the order load_cuda tries them: ['cuda-python 12.9.0', …]."""
    found = []
    for name, driver, package in (("cuda-python", "cuda.bindings.driver", "cuda.bindings"),
                                  ("pycuda", "pycuda.driver", "pycuda")):
        try:
            importlib.import_module(driver)
        except ImportError:
            continue
        found.append(f"{name} {_version(package)}")
    return found


def _version(package: str) -> str:
    try:
        return str(importlib.import_module(package).__version__)
    except (ImportError, AttributeError):
        return "?"
