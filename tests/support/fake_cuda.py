"""A fake CUDA driver for the TensorRT tests: cuda-python's `cuda.bindings.driver` calls that
edgemm.backends.tensorrt.cuda makes (same names, argument order and (CUresult, value) returns), and
pycuda's driver module, over one memory of real process addresses.

"Device" memory is host memory here, so the fake TensorRT reads and writes it through
`Memory.view`, which refuses any access outside an allocation: a buffer too small, or a
copy of more bytes than the tensor has, fails the test instead of passing silently.
tests/test_tensorrt_fake.py checks these names against the installed cuda-bindings.
"""
from __future__ import annotations

import enum
import types
from collections import Counter

import numpy as np


class Memory:
    """Every allocation by its address; counts allocations and bytes copied."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self.allocations = Counter()  # "host" | "mapped" | "device" → calls
        self.copies: list[tuple[str, int]] = []  # (direction, bytes)

    def allocate(self, kind: str, nbytes: int) -> int:
        block = np.zeros(nbytes, np.uint8)
        self.blocks[block.ctypes.data] = block
        self.allocations[kind] += 1
        return block.ctypes.data

    def free(self, ptr: int) -> None:
        self.blocks.pop(ptr, None)

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        for base, block in self.blocks.items():
            if base <= ptr and ptr + nbytes <= base + block.nbytes:
                return block[ptr - base:ptr - base + nbytes]
        raise AssertionError(f"fake CUDA: {nbytes} bytes at {ptr:#x} are outside every allocation")

    def total(self) -> int:
        return sum(self.allocations.values())


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803  # the binding and the driver are of different CUDA majors


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CUstream(int):
    pass


class CUdeviceptr(int):
    pass


def cuda_python(memory: Memory, devices: int = 1, name: str = "Orin", integrated: bool = True,
                compute_capability: tuple[int, int] = (8, 7), fail: dict[str, CUresult] | None = None,
                raise_on_init: Exception | None = None) -> types.ModuleType:
    """A `cuda.bindings.driver` module: `fail` maps a function name to the CUresult it returns."""
    fail = fail or {}
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult, driver.CUdevice_attribute = CUresult, CUdevice_attribute
    driver.CU_MEMHOSTALLOC_DEVICEMAP = 2
    driver.context_stack = []
    mapped: set[int] = set()
    ok = CUresult.CUDA_SUCCESS

    def result(function: str, *values):
        return (fail[function], *([None] * len(values))) if function in fail else (ok, *values)

    def cuInit(Flags):
        if raise_on_init is not None:
            raise raise_on_init
        return result("cuInit")

    def cuDeviceGetCount():
        return result("cuDeviceGetCount", devices)

    def cuDeviceGet(ordinal):
        return result("cuDeviceGet", ordinal) if ordinal < devices else (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    def cuDeviceGetName(length, dev):
        return result("cuDeviceGetName", name.encode().ljust(length, b"\0"))

    def cuDeviceGetAttribute(attrib, dev):
        values = {CUdevice_attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED: int(integrated),
                  CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: compute_capability[0],
                  CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: compute_capability[1]}
        return result("cuDeviceGetAttribute", values[attrib])

    def cuDevicePrimaryCtxRetain(dev):
        return result("cuDevicePrimaryCtxRetain", f"primary context of device {dev}")

    def cuCtxPushCurrent(ctx):
        driver.context_stack.append(ctx)
        return result("cuCtxPushCurrent")

    def cuCtxPopCurrent():
        return result("cuCtxPopCurrent", driver.context_stack.pop())

    def cuMemHostAlloc(bytesize, Flags):
        if "cuMemHostAlloc" in fail:
            return result("cuMemHostAlloc", None)
        ptr = memory.allocate("mapped" if Flags & driver.CU_MEMHOSTALLOC_DEVICEMAP else "host", bytesize)
        if Flags & driver.CU_MEMHOSTALLOC_DEVICEMAP:
            mapped.add(ptr)
        return ok, ptr

    def cuMemHostGetDevicePointer(p, Flags):
        if p not in mapped:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return result("cuMemHostGetDevicePointer", CUdeviceptr(p))  # integrated: one address for both

    def cuMemAlloc(bytesize):
        if "cuMemAlloc" in fail:
            return result("cuMemAlloc", None)
        return ok, CUdeviceptr(memory.allocate("device", bytesize))

    def cuMemFreeHost(p):
        memory.free(p)
        return (ok,)

    def cuMemFree(dptr):
        memory.free(int(dptr))
        return (ok,)

    def cuMemcpyHtoDAsync(dstDevice, srcHost, ByteCount, hStream):
        memory.view(int(dstDevice), ByteCount)[:] = memory.view(srcHost, ByteCount)
        memory.copies.append(("htod", ByteCount))
        return result("cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync(dstHost, srcDevice, ByteCount, hStream):
        memory.view(dstHost, ByteCount)[:] = memory.view(int(srcDevice), ByteCount)
        memory.copies.append(("dtoh", ByteCount))
        return result("cuMemcpyDtoHAsync")

    def cuStreamCreate(Flags):
        return result("cuStreamCreate", CUstream(0x5000 + len(memory.copies)))

    def cuStreamSynchronize(hStream):
        return result("cuStreamSynchronize")

    def cuGetErrorString(error):
        return ok, error.name.replace("CUDA_ERROR_", "").replace("_", " ").lower().encode()

    for function in (cuInit, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceGetAttribute,
                     cuDevicePrimaryCtxRetain, cuCtxPushCurrent, cuCtxPopCurrent, cuMemHostAlloc,
                     cuMemHostGetDevicePointer, cuMemAlloc, cuMemFreeHost, cuMemFree, cuMemcpyHtoDAsync,
                     cuMemcpyDtoHAsync, cuStreamCreate, cuStreamSynchronize, cuGetErrorString):
        setattr(driver, function.__name__, function)
    return driver


def pycuda(memory: Memory, integrated: bool = True, devices: int = 1) -> types.ModuleType:
    """A `pycuda.driver` module: pagelocked arrays, DeviceAllocation, Stream, Device, Error."""
    driver = types.ModuleType("pycuda.driver")
    driver.context_stack = []

    class Error(Exception):
        pass

    class LogicError(Error):
        pass

    class _PagelockedBase:
        """What pycuda's mapped arrays have as .base; numpy keeps it as the base of np.asarray(it)."""

        def __init__(self, ptr, nbytes):
            self.ptr = ptr
            self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}

        def get_device_pointer(self):
            return self.ptr

    class DeviceAllocation:
        def __init__(self, ptr):
            self.ptr = ptr

        def __int__(self):
            return self.ptr

    class Stream:
        def __init__(self):
            self.handle = 0x6000

        def synchronize(self):
            pass

    class Context:
        def push(self):
            driver.context_stack.append(self)

        @staticmethod
        def pop():
            driver.context_stack.pop()

    class Device:
        def __init__(self, ordinal):
            if ordinal >= devices:
                raise LogicError("cuDeviceGet failed: invalid device ordinal")

        @staticmethod
        def count():
            return devices

        def name(self):
            return "Orin"

        def compute_capability(self):
            return (8, 7)

        def get_attribute(self, attribute):
            return int(integrated) if attribute == "INTEGRATED" else 0

        def retain_primary_context(self):
            return Context()

    def init():
        if devices == 0:
            raise RuntimeError("cuInit failed: no CUDA-capable device is detected")

    def pagelocked_empty(shape, dtype, order="C", mem_flags=0):
        ptr = memory.allocate("mapped" if mem_flags else "host", shape)
        if mem_flags:
            return np.asarray(_PagelockedBase(ptr, shape))
        return np.ndarray(shape, dtype, buffer=memory.view(ptr, shape))

    def mem_alloc(bytes):
        return DeviceAllocation(memory.allocate("device", bytes))

    def memcpy_htod_async(dest, src, stream=None):
        memory.view(int(dest), src.nbytes)[:] = src.view(np.uint8).reshape(-1)
        memory.copies.append(("htod", src.nbytes))

    def memcpy_dtoh_async(dest, src, stream=None):
        dest.view(np.uint8).reshape(-1)[:] = memory.view(int(src), dest.nbytes)
        memory.copies.append(("dtoh", dest.nbytes))

    driver.Error, driver.LogicError, driver.Stream, driver.Device = Error, LogicError, Stream, Device
    driver.init, driver.pagelocked_empty, driver.mem_alloc = init, pagelocked_empty, mem_alloc
    driver.memcpy_htod_async, driver.memcpy_dtoh_async = memcpy_htod_async, memcpy_dtoh_async
    driver.host_alloc_flags = types.SimpleNamespace(DEVICEMAP=2, PORTABLE=1)
    driver.device_attribute = types.SimpleNamespace(INTEGRATED="INTEGRATED")
    driver.VERSION_TEXT = "2024.1"
    return driver
