"""A fake `tensorrt` module: the classes, methods, properties and enums edgemm calls, with the
real bindings' names, parameter names and enum values (copied from 8.6.1, 10.3.0, 10.16 and
11.4; tests/test_trt_surface.py checks them against those wheels), and the differences
between releases that edgemm's paths depend on.

It builds and runs for real, in its own way: the parser reads the ONNX graph's inputs,
outputs and nodes; the builder checks the optimisation profiles as TensorRT does (every
dynamic input profiled, min <= opt <= max, static on a DLA) and writes a JSON "plan"; an
execution context runs the graph with onnxruntime on the bytes at the addresses it was
given (tests/support/fake_cuda.Memory), so an answer through the fake is an answer. Where TensorRT
logs, the fake logs to the ILogger it was given, as TensorRT does: errors when a build,
deserialisation or execution fails, warnings for layers that fall back from a DLA to the GPU.

Every public attribute read on the module, a class or an instance is recorded in `used`
as (class name, attribute) — ('', name) for the module — so the surface check knows what
each version's paths touched.
"""
from __future__ import annotations

import base64
import enum
import hashlib
import json
import os
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

used: set[tuple[str, str]] = set()
_SESSIONS: dict[str, ort.InferenceSession] = {}


def _record(owner, name: str) -> None:
    """`owner`: the class read, or "" for the module; a subclass edgemm defines (a calibrator)
    counts as the fake class it derives from."""
    if name.startswith("_"):
        return
    if not isinstance(owner, str):
        owner = next(c.__name__ for c in owner.__mro__ if c.__module__ == __name__)
    used.add((owner, name))


class _Recorded(type):
    """Records class-level reads: trt.Logger.WARNING, trt.IInt8EntropyCalibrator2.__init__ …"""

    def __getattribute__(cls, name):
        if not name.startswith("_"):
            _record(cls, name)
        return type.__getattribute__(cls, name)


class _Object(metaclass=_Recorded):
    def __getattribute__(self, name):
        if not name.startswith("_"):
            _record(type(self), name)
        return object.__getattribute__(self, name)


class _RecordedEnum(enum.EnumMeta):
    def __getattribute__(cls, name):
        if not name.startswith("_") and name in type.__getattribute__(cls, "_member_map_"):
            _record(type.__getattribute__(cls, "__name__"), name)
        return super().__getattribute__(name)


class _TrtEnum(enum.IntEnum, metaclass=_RecordedEnum):
    pass


def _enum(name: str, members: dict[str, int]):
    return _TrtEnum(name, members)


# ---- the module ---------------------------------------------------------------------------------

class FakeTensorRT(types.ModuleType):
    """One release's bindings; `num_DLA_cores` and the failure switches are for the tests."""

    def __init__(self, version: str = "10.3.0", memory=None, dla_cores: int = 2):
        super().__init__("tensorrt")
        major, minor = (int(p) for p in version.split(".")[:2])
        self.__version__ = version
        self._memory, self._dla_cores = memory, dla_cores
        self._runtime_fails = False  # trt.Runtime raises like CUDA that will not start
        self._execute_fails = False
        self._built: list[dict] = []  # every plan built, for the tests to read
        self._loaded: list["ICudaEngine"] = []  # every engine deserialised
        fake = self

        network_flags = ({"EXPLICIT_BATCH": 0, "EXPLICIT_PRECISION": 1} if major < 10 else
                         {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1} if major == 10 else {"STRONGLY_TYPED": 0})
        builder_flags = {"GPU_FALLBACK": 3, **({"FP16": 0, "INT8": 1} if major < 11 else {})}
        data_types = {"FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "UINT8": 5,
                      **({"INT64": 8} if major >= 10 else {})}
        parser_flags = {"NATIVE_INSTANCENORM": 0, **({"ADJUST_FOR_DLA": 4} if (major, minor) >= (10, 16) else {})}
        self.NetworkDefinitionCreationFlag = _enum("NetworkDefinitionCreationFlag", network_flags)
        self.BuilderFlag = _enum("BuilderFlag", builder_flags)
        self.DataType = _enum("DataType", data_types)
        self.OnnxParserFlag = _enum("OnnxParserFlag", parser_flags)
        self.TensorIOMode = _enum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
        self.DeviceType = _enum("DeviceType", {"GPU": 0, "DLA": 1})
        self.MemoryPoolType = _enum("MemoryPoolType", {"WORKSPACE": 0})
        severity = _enum("Severity", {"INTERNAL_ERROR": 0, "ERROR": 1, "WARNING": 2, "INFO": 3, "VERBOSE": 4})
        for cls in (ILogger, Logger, Runtime, Builder, OnnxParser, IBuilderConfig, INetworkDefinition, ILayer, ITensor,
                    IOptimizationProfile, ITimingCache, IHostMemory, ICudaEngine, IExecutionContext):
            setattr(self, cls.__name__, type(cls.__name__, (cls,), {"_trt": fake}))
        self._severity = severity  # for the fake's own logging: item access is not recorded as a use
        for level in severity:  # ILogger.WARNING … as the real bindings have them (Logger inherits them)
            setattr(self.ILogger, level.name, level)
            setattr(self.Logger, level.name, level)
        if major < 11:  # TensorRT 11 removed implicit quantisation and its calibrators
            self.IInt8EntropyCalibrator2 = type("IInt8EntropyCalibrator2", (IInt8EntropyCalibrator2,), {})

    def __getattribute__(self, name):
        if not name.startswith("_"):
            _record("", name)
        return super().__getattribute__(name)

    def nptype(self, trt_type):
        table = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "BOOL": np.bool_,
                 "UINT8": np.uint8, "INT64": np.int64}
        return table[trt_type.name]


class ILogger(_Object):
    """The interface TensorRT logs through; a Python subclass overrides log() and, like any
    pybind11 subclass, must call ILogger.__init__ for the C++ half to exist."""

    def __init__(self):
        self._constructed = True

    def log(self, severity, msg):
        raise RuntimeError('Tried to call pure virtual function "ILogger::log"')


def _logger(logger) -> "ILogger":
    """What pybind11 does with a logger argument: refuse anything but a constructed ILogger."""
    if not isinstance(logger, ILogger):
        raise TypeError("__init__(): incompatible constructor arguments (a tensorrt.ILogger is expected)")
    if not object.__getattribute__(logger, "__dict__").get("_constructed"):
        raise TypeError(f"{type(logger).__name__}.__init__() must be called when overriding __init__")
    return logger


def _say(trt, logger, severity: str, msg: str) -> None:
    logger.log(trt._severity[severity], msg)


class Logger(ILogger):
    """TensorRT's own logger: it writes from C++ to file descriptor 2."""

    def __init__(self, min_severity=None):
        super().__init__()
        self.min_severity = min_severity

    def log(self, severity, msg):
        if self.min_severity is None or int(severity) <= int(self.min_severity):
            os.write(2, f"[TRT] {msg}\n".encode())


class IInt8EntropyCalibrator2(_Object):
    def __init__(self):
        pass

    def get_batch_size(self):
        return 1

    def get_batch(self, names):
        return None

    def read_calibration_cache(self):
        return None

    def write_calibration_cache(self, cache):
        pass


# ---- building ----------------------------------------------------------------------------------

_ONNX_TYPES = {1: "FLOAT", 10: "HALF", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 2: "UINT8"}


class ILayer(_Object):
    def __init__(self, name: str, op: str):
        self.name, self._op = name, op


class INetworkDefinition(_Object):
    def __init__(self, flags: int):
        self._flags = flags
        self._inputs: dict[str, dict] = {}
        self._outputs: dict[str, dict] = {}
        self._layers: list[ILayer] = []
        self._onnx: str | None = None

    @property
    def num_layers(self):
        return len(self._layers)

    def get_layer(self, index):
        return self._layers[index]

    @property
    def num_inputs(self):
        return len(self._inputs)

    @property
    def num_outputs(self):
        return len(self._outputs)

    def get_input(self, index):
        name = list(self._inputs)[index]
        return self._trt.ITensor(name, self._trt.DataType[self._inputs[name]["dtype"]])

    def get_output(self, index):
        name = list(self._outputs)[index]
        return self._trt.ITensor(name, self._trt.DataType[self._outputs[name]["dtype"]])


class ITensor(_Object):
    def __init__(self, name: str, dtype):
        self._name, self._dtype = name, dtype

    name = property(lambda self: self._name)
    dtype = property(lambda self: self._dtype)


class OnnxParser(_Object):
    def __init__(self, network, logger):
        self._network, self._errors, self._flags = network, [], set()
        self._logger = _logger(logger)

    def set_flag(self, flag):
        self._flags.add(flag.name)

    @property
    def num_errors(self):
        return len(self._errors)

    def get_error(self, index):
        return self._errors[index]

    def parse_from_file(self, model):
        path = Path(model)
        try:
            graph = onnx.load(str(path), load_external_data=False).graph
        except Exception as e:
            self._errors.append(f"ModelImporter: failed to parse {path.name}: {type(e).__name__}")
            return False
        major = int(self._trt.__version__.split(".")[0])
        initializers = {t.name for t in graph.initializer}

        def tensor(value) -> dict:
            kind = _ONNX_TYPES[value.type.tensor_type.elem_type]
            if kind == "INT64" and major < 10:
                kind = "INT32"  # TensorRT 8.6 has no INT64 I/O: the parser narrows it
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
            return {"dtype": kind, "shape": dims, "onnx_type": value.type.tensor_type.elem_type}
        network = self._network
        network._onnx = base64.b64encode(path.read_bytes()).decode()  # the plan carries its graph
        network._inputs = {i.name: tensor(i) for i in graph.input if i.name not in initializers}
        network._outputs = {o.name: tensor(o) for o in graph.output}
        network._layers = [ILayer(n.name or f"{n.op_type}_{k}", n.op_type) for k, n in enumerate(graph.node)]
        network._parser_flags = set(self._flags)
        return True


class IOptimizationProfile(_Object):
    def __init__(self):
        self._shapes: dict[str, tuple] = {}

    def set_shape(self, input, min, opt, max):
        self._shapes[input] = (list(min), list(opt), list(max))


class ITimingCache(_Object):
    def __init__(self, data: bytes):
        self._data = data

    def serialize(self):
        return self._data or b"fake timing cache"


class IHostMemory(bytes, metaclass=_Recorded):
    pass


class IBuilderConfig(_Object):
    def __init__(self):
        self._flags: set[str] = set()
        self._profiles: list[IOptimizationProfile] = []
        self._pools: dict[str, int] = {}
        self._device_type, self._dla_core, self._calibrator = None, -1, None
        self._calibration_profile = None
        self._timing = None

    # properties, so that the fake's own reads of them are not counted as edgemm's
    default_device_type = property(lambda self: self._device_type,
                                   lambda self, value: setattr(self, "_device_type", value))
    DLA_core = property(lambda self: self._dla_core, lambda self, value: setattr(self, "_dla_core", value))
    int8_calibrator = property(lambda self: self._calibrator, lambda self, value: setattr(self, "_calibrator", value))

    def set_memory_pool_limit(self, pool, pool_size):
        self._pools[pool.name] = pool_size

    def set_flag(self, flag):
        self._flags.add(flag.name)

    def add_optimization_profile(self, profile):
        self._profiles.append(profile)
        return len(self._profiles) - 1

    def set_calibration_profile(self, profile):
        self._calibration_profile = profile
        return True

    def create_timing_cache(self, serialized_timing_cache):
        return self._trt.ITimingCache(bytes(serialized_timing_cache))

    def set_timing_cache(self, cache, ignore_mismatch):
        self._timing = cache
        return True

    def get_timing_cache(self):
        return self._timing

    def can_run_on_DLA(self, layer):
        return layer._op != "Gather"  # not among the DLA's layers (Softmax and Shuffle run there on Orin)


class Builder(_Object):
    def __init__(self, logger):
        self._logger = _logger(logger)

    def _error(self, msg: str):
        """What TensorRT does where a build fails: log the reason, return None."""
        _say(self._trt, self._logger, "ERROR", f"IBuilder::buildSerializedNetwork: Error Code 4: {msg}")
        return None

    def create_network(self, flags=0):
        return self._trt.INetworkDefinition(flags)

    def create_builder_config(self):
        return self._trt.IBuilderConfig()

    def create_optimization_profile(self):
        return self._trt.IOptimizationProfile()

    def build_serialized_network(self, network, config):
        """None, like TensorRT, when the profiles do not cover the inputs; else a JSON plan."""
        trt = self._trt
        typed = "STRONGLY_TYPED" in trt.NetworkDefinitionCreationFlag.__members__ and \
            network._flags & (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        if typed and config._flags & {"FP16", "INT8"}:
            return self._error("precision flags are not allowed on a strongly typed network")
        on_dla = config._device_type is not None and config._device_type.name == "DLA"
        if on_dla and config._dla_core < 0:
            return self._error("the default device is the DLA, but no DLA core is set")
        if on_dla and "INT8" in config._flags and not _has_qdq(network) and config._calibrator is None:
            return self._error("INT8 on the DLA needs scales: no Q/DQ nodes and no calibrator")
        profiles = []
        for profile in config._profiles:
            for name, spec in network._inputs.items():
                if name not in profile._shapes:
                    if any(d < 0 for d in spec["shape"]):
                        return self._error(f"Network has dynamic or shape inputs, but no optimization profile "
                                           f"has been defined for {name}.")
                    continue
                low, opt, high = profile._shapes[name]
                if not (len(low) == len(opt) == len(high) == len(spec["shape"])):
                    return self._error(f"{name}: the profile's dimensions do not match the input's rank")
                if any(not (a <= b <= c) for a, b, c in zip(low, opt, high)):
                    return self._error(f"{name}: the profile's dimensions are not min <= opt <= max")
                if any(d >= 0 and not (a == b == c == d) for d, a, b, c in zip(spec["shape"], low, opt, high)):
                    return self._error(f"{name}: the profile's dimensions differ from the input's static ones")
                if on_dla and low != high:
                    return self._error(f"{name}: DLA only supports static shapes: min, opt and max must be equal")
            profiles.append({n: list(s) for n, s in profile._shapes.items()})
        if not profiles and any(d < 0 for s in network._inputs.values() for d in s["shape"]):
            return self._error("Network has dynamic or shape inputs, but no optimization profile has been defined.")
        if on_dla:
            for layer in network._layers:
                if layer._op == "Gather":  # what can_run_on_DLA refuses; with GPU_FALLBACK, TensorRT says so
                    _say(trt, self._logger, "WARNING", f"Layer '{layer.name}' ({layer._op.upper()}): Unsupported "
                                                       "on DLA. Switching this layer's device type to GPU.")
        if on_dla:  # a static plan: the profile's shapes are the tensors' shapes
            inputs = {n: {**s, "shape": profiles[0][n][0] if n in profiles[0] else s["shape"]}
                      for n, s in network._inputs.items()}
        else:
            inputs = network._inputs
        plan = {"version": trt.__version__, "onnx": network._onnx, "inputs": inputs, "outputs": network._outputs,
                "profiles": profiles, "dla_core": config._dla_core if on_dla else None,
                "flags": sorted(config._flags), "strongly_typed": bool(typed),
                "parser_flags": sorted(network._parser_flags),
                "calibration_cache": (config._calibrator.read_calibration_cache().decode("latin-1")
                                      if config._calibrator is not None else None)}
        trt._built.append(plan)
        return trt.IHostMemory(json.dumps(plan).encode())


def _has_qdq(network) -> bool:
    return any(layer._op in ("QuantizeLinear", "DequantizeLinear") for layer in network._layers)


# ---- running -----------------------------------------------------------------------------------

class Runtime(_Object):
    def __init__(self, logger):
        self._logger = _logger(logger)
        if self._trt._runtime_fails:
            _say(self._trt, logger, "ERROR", "6: CUDA initialization failure with error: 35. Please check your "
                                             "CUDA installation.")
            raise TypeError("pybind11::init(): factory function returned nullptr")
        self._dla_core = -1

    DLA_core = property(lambda self: self._dla_core, lambda self, value: setattr(self, "_dla_core", value))

    @property
    def num_DLA_cores(self):
        return self._trt._dla_cores

    def deserialize_cuda_engine(self, serialized_engine):
        """None, like TensorRT, for another release's plan, or a DLA plan without its core."""
        trt = self._trt
        try:
            plan = json.loads(bytes(serialized_engine))
        except ValueError:
            return self._error("Serialization (Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag "
                               "does not match)")
        if plan["version"] != trt.__version__:
            return self._error(f"Serialization (Serialization assertion stdVersionRead == kSERIALIZATION_VERSION "
                               f"failed.Version tag does not match. Note: Current Version: {trt.__version__}, "
                               f"Serialized Engine Version: {plan['version']})")
        if plan["dla_core"] is not None and self._dla_core >= trt._dla_cores:
            return self._error(f"Internal Error (DLA core {self._dla_core} is not available: "
                               f"the device has {trt._dla_cores})")
        engine = self._trt.ICudaEngine(plan, self._dla_core, self._logger)
        self._trt._loaded.append(engine)
        return engine

    def _error(self, msg: str):
        _say(self._trt, self._logger, "ERROR", f"IRuntime::deserializeCudaEngine: Error Code 1: {msg}")
        return None


class ICudaEngine(_Object):
    def __init__(self, plan: dict, dla_core: int, logger):
        self._plan, self._dla_core_at_load, self._logger = plan, dla_core, logger
        self._names = list(plan["inputs"]) + list(plan["outputs"])
        self._fail_context = False

    @property
    def num_io_tensors(self):
        return len(self._names)

    @property
    def num_optimization_profiles(self):
        return max(1, len(self._plan["profiles"]))

    def get_tensor_name(self, index):
        return self._names[index]

    def _spec(self, name):
        return self._plan["inputs"].get(name) or self._plan["outputs"][name]

    def get_tensor_mode(self, name):
        return self._trt.TensorIOMode.INPUT if name in self._plan["inputs"] else self._trt.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return self._trt.DataType[self._spec(name)["dtype"]]

    def get_tensor_shape(self, name):
        return list(self._spec(name)["shape"])

    def get_tensor_profile_shape(self, name, profile_index):
        return [list(s) for s in self._plan["profiles"][profile_index][name]]

    def create_execution_context(self):
        return None if self._fail_context else self._trt.IExecutionContext(self)


class IExecutionContext(_Object):
    def __init__(self, engine: ICudaEngine):
        self._engine, self._profile = engine, 0
        self._shapes: dict[str, tuple] = {}
        self._addresses: dict[str, int] = {}
        self._results: dict[str, np.ndarray] | None = None
        self._runs = 0

    def set_optimization_profile_async(self, profile_index, stream_handle):
        self._profile = profile_index
        return True

    def set_input_shape(self, name, shape):
        shape = tuple(shape)
        plan = self._engine._plan
        static = plan["inputs"][name]["shape"]
        if plan["profiles"] and name in plan["profiles"][self._profile]:
            low, _, high = plan["profiles"][self._profile][name]
        else:
            low = high = static
        if len(shape) != len(low) or any(s < a or s > b for s, a, b in zip(shape, low, high)):
            return False
        self._shapes[name], self._results = shape, None
        return True

    def set_tensor_address(self, name, memory):
        self._addresses[name] = int(memory)
        self._results = None
        return True

    def get_tensor_shape(self, name):
        if name in self._engine._plan["inputs"]:
            return list(self._shapes[name])
        return list(self._compute()[name].shape)

    def _compute(self) -> dict[str, np.ndarray]:
        """The graph run on the input bytes at their addresses (output shapes need it in the fake)."""
        if self._results is None:
            plan, memory = self._engine._plan, self._engine._trt._memory
            feeds = {}
            for name, spec in plan["inputs"].items():
                dtype = np.dtype(self._engine._trt.nptype(self._engine._trt.DataType[spec["dtype"]]))
                shape = self._shapes[name]
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                value = memory.view(self._addresses[name], nbytes).view(dtype).reshape(shape)
                feeds[name] = value.astype(onnx.helper.tensor_dtype_to_np_dtype(spec["onnx_type"]))
            key = hashlib.sha256(plan["onnx"].encode()).hexdigest()
            session = _SESSIONS.get(key)
            if session is None:
                options = ort.SessionOptions()
                options.intra_op_num_threads = 1
                session = _SESSIONS[key] = ort.InferenceSession(base64.b64decode(plan["onnx"]), options,
                                                                providers=["CPUExecutionProvider"])
            names = list(plan["outputs"])
            self._results = dict(zip(names, session.run(names, feeds)))
        return self._results

    def execute_async_v3(self, stream_handle):
        trt = self._engine._trt
        if trt._execute_fails:
            _say(trt, self._engine._logger, "ERROR", "IExecutionContext::enqueueV3: Error Code 1: Cuda Runtime "
                                                     "(an illegal memory access was encountered)")
            return False
        results = self._compute()
        for name, value in results.items():
            dtype = np.dtype(trt.nptype(trt.DataType[self._engine._plan["outputs"][name]["dtype"]]))
            out = np.ascontiguousarray(value, dtype=dtype)
            trt._memory.view(self._addresses[name], out.nbytes)[:] = out.view(np.uint8).reshape(-1)
        self._runs += 1
        self._results = None
        return True
