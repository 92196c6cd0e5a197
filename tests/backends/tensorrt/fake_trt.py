"""A recording fake of the ``tensorrt``, ``pycuda.driver`` and cuda-python runtime surface.

It is strict where the real bindings are: every public attribute read or written on the
module or on one of its objects must be in the committed name list of the major version
being faked (``quantkit/backends/tensorrt/names/trt10.txt`` / ``trt11.txt``;
``pycuda.txt`` for pycuda), otherwise ``AttributeError`` is raised as the real pybind11 /
Boost.Python objects would. So code that passes against ``FakeGPU(11)`` uses no name that
TensorRT 11 lacks.

It is also behavioural enough to catch wiring mistakes:

* the ONNX parser turns every ONNX node into layers named after it, with the parser's
  ``[ONNX Layer: <node>]`` metadata (a Gemm becomes constant + matmul + bias layers);
* ``build_serialized_network`` drives the calibrator the way TensorRT does (cache first;
  batches only without a cache; each pointer must hold exactly the OPT shape) and returns
  a plan that ``Runtime.deserialize_cuda_engine`` understands;
* execution contexts compute with ONNX Runtime on the fake device memory their tensor
  addresses point to, on a fake stream whose work - copies, kernels, event records - only
  happens at ``stream.synchronize()``; the default stream (handle 0) is refused;
* cuda-python stream capture records that work into graphs that can be replayed.

Every call lands in :attr:`FakeGPU.calls` as ``("Class.method", args)`` (attribute writes as
``("Class.attr=", (value,))``).
"""

from __future__ import annotations

import itertools
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

from quantkit.backends.tensorrt.surface import load_names

VERSIONS = {10: "10.16.1.11", 11: "11.4.0.106"}
DTYPE_ALIASES = {"float32": "FLOAT", "float16": "HALF", "int8": "INT8", "int32": "INT32", "int64": "INT64",
                 "bool": "BOOL", "uint8": "UINT8"}
NUMPY_OF = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
            "BOOL": np.bool_, "UINT8": np.uint8}
ONNX_TO_TRT = {onnx.TensorProto.FLOAT: "FLOAT", onnx.TensorProto.FLOAT16: "HALF", onnx.TensorProto.INT8: "INT8",
               onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.BOOL: "BOOL",
               onnx.TensorProto.UINT8: "UINT8"}
LAYER_TYPES = {"Conv": "CONVOLUTION", "Relu": "ACTIVATION", "Sigmoid": "ACTIVATION", "Shape": "SHAPE",
               "Gather": "GATHER", "Concat": "CONCATENATION", "Reshape": "SHUFFLE", "Flatten": "SHUFFLE",
               "Softmax": "SOFTMAX", "Cast": "CAST", "QuantizeLinear": "QUANTIZE",
               "DequantizeLinear": "DEQUANTIZE", "Add": "ELEMENTWISE", "Mul": "ELEMENTWISE",
               "MatMul": "MATRIX_MULTIPLY", "Resize": "RESIZE"}


class FakeCudaError(RuntimeError):
    """What the fake pycuda raises (the real one raises pycuda.driver.Error subclasses)."""


@dataclass
class Options:
    """Knobs a test turns to provoke failures."""

    gpus: int = 1
    gpu_name: str = "NVIDIA Fake GPU"
    compute_capability: tuple[int, int] = (8, 9)
    build_returns_none: bool = False
    max_calibration_batches: int = 1000
    capture_fails: bool = False
    reject_timing_cache: bool = False


# ---------------------------------------------------------------------------- strict objects


class Strict:
    """Base of every fake object: public attributes must be in the real name list."""

    _cls = "?"

    def __init__(self, gpu: "FakeGPU"):
        object.__setattr__(self, "_gpu", gpu)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            gpu = object.__getattribute__(self, "_gpu")
            gpu.check(type(self)._cls, name, type(self)._surface)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            self._gpu.check(type(self)._cls, name, type(self)._surface)
            self._gpu.record(f"{type(self)._cls}.{name}=", value)
        object.__setattr__(self, name, value)

    _surface = "trt"


class EnumValue:
    """An enum member: equal only to itself; ``int()`` gives a stable made-up number."""

    def __init__(self, enum: str, member: str, number: int):
        self.enum, self.member, self.number = enum, member, number

    def __int__(self) -> int:
        return self.number

    def __repr__(self) -> str:
        return f"{self.enum}.{self.member}"


class ClassRef:
    """``trt.X`` for a class or enum: attributes checked as ``X.attr``; callable when constructible."""

    def __init__(self, gpu: "FakeGPU", name: str, surface: str, factory: Callable | None = None,
                 members: dict[str, Any] | None = None):
        self._gpu, self._name, self._surface, self._factory = gpu, name, surface, factory
        self._members = members or {}

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        self._gpu.check(self._name, attr, self._surface)
        if attr in self._members:
            return self._members[attr]
        return self._gpu.enum_value(self._name, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._factory is None:
            raise TypeError(f"{self._name} cannot be constructed")
        self._gpu.record(f"{self._name}()", *args)
        return self._factory(*args, **kwargs)


class FakeModule(types.ModuleType):
    """A module whose public attributes are checked against a name list."""

    def __init__(self, name: str, gpu: "FakeGPU", surface: str, attrs: dict[str, Any]):
        super().__init__(name)
        object.__setattr__(self, "_gpu", gpu)
        object.__setattr__(self, "_surface", surface)
        object.__setattr__(self, "_attrs", attrs)

    def __getattribute__(self, name: str) -> Any:
        if name != "__version__" and name.startswith("_"):
            return super().__getattribute__(name)
        gpu = object.__getattribute__(self, "_gpu")
        surface = object.__getattribute__(self, "_surface")
        gpu.check(None, name, surface)
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        return ClassRef(gpu, name, surface)


# ---------------------------------------------------------------------------- TensorRT objects


class Logger(Strict):
    _cls = "Logger"

    def __init__(self, gpu, min_severity=None):
        super().__init__(gpu)
        object.__setattr__(self, "_severity", min_severity)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # TRT DataType member name
    is_network_input: bool = False
    is_network_output: bool = False


class Tensor(Strict):
    _cls = "ITensor"

    def __init__(self, gpu, info: TensorInfo):
        super().__init__(gpu)
        object.__setattr__(self, "_info", info)

    @property
    def name(self):
        return self._info.name

    @property
    def shape(self):
        return self._info.shape

    @property
    def dtype(self):
        return self._gpu.enum_value("DataType", self._info.dtype)

    @property
    def is_network_output(self):
        return self._info.is_network_output

    @property
    def is_network_input(self):
        return self._info.is_network_input

    @property
    def is_shape_tensor(self):
        return self._info.dtype in ("INT32", "INT64") and not self._info.is_network_input


class Layer(Strict):
    _cls = "ILayer"

    def __init__(self, gpu, name: str, layer_type: str, node: str, outputs: list[Tensor]):
        super().__init__(gpu)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_type", layer_type)
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_outputs", outputs)
        object.__setattr__(self, "_output_types", {})

    @property
    def name(self):
        return self._name

    @property
    def type(self):
        return self._gpu.enum_value("LayerType", self._type)

    @property
    def metadata(self):
        return f"[ONNX Layer: {self._node}]"

    @property
    def num_outputs(self):
        return len(self._outputs)

    def get_output(self, index):
        return self._outputs[index]

    def set_output_type(self, index, dtype):
        self._gpu.record("ILayer.set_output_type", self._name, index, dtype)
        self._output_types[index] = dtype


class Network(Strict):
    _cls = "INetworkDefinition"

    def __init__(self, gpu, flags: int):
        super().__init__(gpu)
        object.__setattr__(self, "_flags", flags)
        object.__setattr__(self, "_inputs", [])
        object.__setattr__(self, "_outputs", [])
        object.__setattr__(self, "_layers", [])
        object.__setattr__(self, "_onnx_path", None)

    @property
    def num_inputs(self):
        return len(self._inputs)

    def get_input(self, index):
        return self._inputs[index]

    @property
    def num_outputs(self):
        return len(self._outputs)

    def get_output(self, index):
        return self._outputs[index]

    @property
    def num_layers(self):
        return len(self._layers)

    def get_layer(self, index):
        return self._layers[index]


class ParserError(Strict):
    _cls = "ParserError"

    def __init__(self, gpu, node_name: str, operator: str, message: str):
        super().__init__(gpu)
        object.__setattr__(self, "_values", (node_name, operator, message))

    def desc(self):
        return self._values[2]

    def node(self):
        return 0

    def node_name(self):
        return self._values[0]

    def node_operator(self):
        return self._values[1]


class OnnxParser(Strict):
    """Parses with onnx: one or more layers per node, named and tagged like the real parser."""

    _cls = "OnnxParser"

    def __init__(self, gpu, network: Network, logger: Logger):
        super().__init__(gpu)
        object.__setattr__(self, "_network", network)
        object.__setattr__(self, "_errors", [])

    def parse(self, model, path=None):
        self._gpu.record("OnnxParser.parse", path)
        proto = onnx.load_from_string(bytes(model))
        unsupported = [n for n in proto.graph.node if n.op_type.startswith("Unsupported")]
        if unsupported:
            node = unsupported[0]
            self._errors.append(ParserError(self._gpu, node.name, node.op_type, "no importer registered"))
            return False
        self._gpu.parsed_models.append(proto)
        self._fill(proto, path)
        return True

    @property
    def num_errors(self):
        return len(self._errors)

    def get_error(self, index):
        return self._errors[index]

    def _fill(self, proto: onnx.ModelProto, path) -> None:
        gpu, network = self._gpu, self._network
        inferred = onnx.shape_inference.infer_shapes(proto)
        types = {i.name: i.data_type for i in inferred.graph.initializer}
        for info in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
            types[info.name] = info.type.tensor_type.elem_type
        outputs = {o.name for o in proto.graph.output}
        initializers = {i.name for i in proto.graph.initializer}
        for info in proto.graph.input:
            if info.name in initializers:
                continue
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in info.type.tensor_type.shape.dim)
            network._inputs.append(Tensor(gpu, TensorInfo(info.name, dims, ONNX_TO_TRT[types[info.name]],
                                                          is_network_input=True)))
        for node in proto.graph.node:
            if node.op_type == "Constant":
                continue  # the real parser makes no layer for Constant nodes
            tensors = [Tensor(gpu, TensorInfo(out, (), ONNX_TO_TRT.get(types.get(out, 1), "FLOAT"),
                                              is_network_output=out in outputs)) for out in node.output]
            kind = LAYER_TYPES.get(node.op_type, "UNARY")
            if node.op_type == "Gemm":  # weights constant + matmul + bias add, all tagged with the node
                weights = Tensor(gpu, TensorInfo(f"{node.name}_weights_out", (), "FLOAT"))
                product = Tensor(gpu, TensorInfo(f"{node.name}_mm_out", (), "FLOAT"))
                network._layers += [Layer(gpu, f"{node.name}_weights", "CONSTANT", node.name, [weights]),
                                    Layer(gpu, node.name, "MATRIX_MULTIPLY", node.name, [product]),
                                    Layer(gpu, f"{node.name}_bias", "ELEMENTWISE", node.name, tensors)]
            else:
                network._layers.append(Layer(gpu, node.name, kind, node.name, tensors))
        for out in proto.graph.output:
            network._outputs.append(Tensor(gpu, TensorInfo(out.name, (), ONNX_TO_TRT[types[out.name]],
                                                           is_network_output=True)))
        object.__setattr__(network, "_onnx_path", str(path) if path else None)
        object.__setattr__(network, "_onnx_bytes", proto.SerializeToString())


class OptimizationProfile(Strict):
    _cls = "IOptimizationProfile"

    def __init__(self, gpu):
        super().__init__(gpu)
        object.__setattr__(self, "_shapes", {})

    def set_shape(self, input, min, opt, max):  # noqa: A002 - the real keyword names
        self._gpu.record("IOptimizationProfile.set_shape", input, tuple(min), tuple(opt), tuple(max))
        self._shapes[input] = (tuple(min), tuple(opt), tuple(max))


class HostMemory(bytes):
    """IHostMemory: a buffer (bytes here) with strictly checked attributes."""

    _cls = "IHostMemory"

    def __getattribute__(self, name):
        if not name.startswith("_") and name in ("nbytes", "dtype"):
            return len(self) if name == "nbytes" else None
        if not name.startswith("_"):
            raise AttributeError(f"'tensorrt.IHostMemory' object has no attribute '{name}'")
        return super().__getattribute__(name)


class TimingCache(Strict):
    _cls = "ITimingCache"

    def __init__(self, gpu, data: bytes):
        super().__init__(gpu)
        object.__setattr__(self, "_data", bytes(data))

    def serialize(self):
        return HostMemory(b"fake-timing-cache:" + self._data[-16:])


class BuilderConfig(Strict):
    _cls = "IBuilderConfig"

    def __init__(self, gpu):
        super().__init__(gpu)
        object.__setattr__(self, "_flags", [])
        object.__setattr__(self, "_profiles", [])
        object.__setattr__(self, "_calibration_profile", None)
        object.__setattr__(self, "_timing_cache", None)
        object.__setattr__(self, "_pools", {})

    def set_memory_pool_limit(self, pool, pool_size):
        self._gpu.record("IBuilderConfig.set_memory_pool_limit", pool, pool_size)
        self._pools[pool.member] = pool_size

    def set_flag(self, flag):
        self._gpu.record("IBuilderConfig.set_flag", flag)
        self._flags.append(flag.member)

    def add_optimization_profile(self, profile):
        self._gpu.record("IBuilderConfig.add_optimization_profile", profile)
        self._profiles.append(profile)
        return len(self._profiles) - 1

    def set_calibration_profile(self, profile):
        self._gpu.record("IBuilderConfig.set_calibration_profile", profile)
        object.__setattr__(self, "_calibration_profile", profile)
        return True

    def create_timing_cache(self, serialized_timing_cache):
        self._gpu.record("IBuilderConfig.create_timing_cache", bytes(serialized_timing_cache))
        return TimingCache(self._gpu, serialized_timing_cache)

    def set_timing_cache(self, cache, ignore_mismatch):
        self._gpu.record("IBuilderConfig.set_timing_cache", cache, ignore_mismatch)
        if self._gpu.options.reject_timing_cache and cache._data:
            return False
        object.__setattr__(self, "_timing_cache", cache)
        return True

    def get_timing_cache(self):
        return self._timing_cache


class Builder(Strict):
    _cls = "Builder"

    def __init__(self, gpu, logger):
        super().__init__(gpu)

    def create_network(self, flags=0):
        self._gpu.record("Builder.create_network", flags)
        return Network(self._gpu, flags)

    def create_builder_config(self):
        return BuilderConfig(self._gpu)

    def create_optimization_profile(self):
        return OptimizationProfile(self._gpu)

    def build_serialized_network(self, network, config):
        gpu = self._gpu
        gpu.record("Builder.build_serialized_network", network, config)
        calibrator = object.__getattribute__(config, "__dict__").get("int8_calibrator")
        if "INT8" in config._flags and calibrator is not None:
            gpu.run_calibration(calibrator, network, config)
        if gpu.options.build_returns_none:
            return None
        profiles = [p._shapes for p in config._profiles]
        plan = {
            "fake_trt_plan": gpu.major,
            "onnx": network._onnx_bytes.hex(),
            "inputs": [{"name": t.name, "dtype": t._info.dtype, "shape": list(t.shape),
                        "profiles": [[list(s) for s in p[t.name]] for p in profiles]} for t in network._inputs],
            "outputs": [{"name": t.name, "dtype": t._info.dtype} for t in network._outputs],
        }
        return HostMemory(json.dumps(plan).encode())


# ---------------------------------------------------------------------------- runtime objects


class Runtime(Strict):
    _cls = "Runtime"

    def __init__(self, gpu, logger):
        super().__init__(gpu)

    def deserialize_cuda_engine(self, serialized_engine):
        try:
            plan = json.loads(bytes(serialized_engine))
        except ValueError:
            return None
        if plan.get("fake_trt_plan") != self._gpu.major:
            return None
        return Engine(self._gpu, plan)


class Engine(Strict):
    _cls = "ICudaEngine"

    def __init__(self, gpu, plan: dict):
        super().__init__(gpu)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_io", [*plan["inputs"], *plan["outputs"]])
        object.__setattr__(self, "_session", None)

    @property
    def num_io_tensors(self):
        return len(self._io)

    @property
    def num_optimization_profiles(self):
        return max(1, len(self._plan["inputs"][0]["profiles"]))

    def get_tensor_name(self, index):
        return self._io[index]["name"]

    def _entry(self, name):
        return next(t for t in self._io if t["name"] == name)

    def get_tensor_mode(self, name):
        is_input = any(t["name"] == name for t in self._plan["inputs"])
        return self._gpu.enum_value("TensorIOMode", "INPUT" if is_input else "OUTPUT")

    def get_tensor_dtype(self, name):
        return self._gpu.enum_value("DataType", self._entry(name)["dtype"])

    def get_tensor_shape(self, name):
        return tuple(self._entry(name).get("shape", [-1]))

    def get_tensor_profile_shape(self, name, profile_index):
        return [tuple(s) for s in self._entry(name)["profiles"][profile_index]]

    def create_execution_context(self):
        self._gpu.record("ICudaEngine.create_execution_context")
        return ExecutionContext(self._gpu, self)

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        import onnxruntime as ort

        if self._session is None:
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(bytes.fromhex(self._plan["onnx"]), options,
                                           providers=["CPUExecutionProvider"])
            object.__setattr__(self, "_session", session)
        return self._session.run([t["name"] for t in self._plan["outputs"]], feed)


class ExecutionContext(Strict):
    _cls = "IExecutionContext"

    def __init__(self, gpu, engine: Engine):
        super().__init__(gpu)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_profile", 0)
        object.__setattr__(self, "_shapes", {})
        object.__setattr__(self, "_addresses", {})

    def set_optimization_profile_async(self, profile_index, stream_handle):
        self._gpu.record("IExecutionContext.set_optimization_profile_async", self, profile_index, stream_handle)
        object.__setattr__(self, "_profile", profile_index)
        return True

    def set_input_shape(self, name, shape):
        shape = tuple(int(d) for d in shape)
        self._gpu.record("IExecutionContext.set_input_shape", self, name, shape)
        low, _opt, high = self._engine.get_tensor_profile_shape(name, self._profile)
        if len(shape) != len(low) or any(not a <= d <= b for d, a, b in zip(shape, low, high)):
            return False
        self._shapes[name] = shape
        return True

    def get_tensor_shape(self, name):
        if name in self._shapes:
            return self._shapes[name]
        feed = {t["name"]: np.zeros(self._shapes[t["name"]], NUMPY_OF[t["dtype"]])
                for t in self._engine._plan["inputs"]}
        outputs = self._engine._run(feed)
        names = [t["name"] for t in self._engine._plan["outputs"]]
        return tuple(outputs[names.index(name)].shape)

    def set_tensor_address(self, name, memory):
        self._gpu.record("IExecutionContext.set_tensor_address", self, name, int(memory))
        self._addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle):
        gpu = self._gpu
        gpu.record("IExecutionContext.execute_async_v3", self, stream_handle)
        stream = gpu.streams.get(stream_handle)
        if stream is None:  # 0 is the legacy default stream: never allowed here
            raise AssertionError(f"execute_async_v3 on the default or an unknown stream ({stream_handle})")
        missing = [t["name"] for t in self._engine._io if t["name"] not in self._addresses]
        if missing:
            raise AssertionError(f"execute_async_v3 with unbound tensors {missing}")
        shapes = dict(self._shapes)

        def compute():
            feed = {}
            for t in self._engine._plan["inputs"]:
                dtype = NUMPY_OF[t["dtype"]]
                feed[t["name"]] = gpu.memory_view(self._addresses[t["name"]], shapes[t["name"]], dtype).copy()
            outputs = self._engine._run(feed)
            for t, value in zip(self._engine._plan["outputs"], outputs):
                target = gpu.memory_view(self._addresses[t["name"]], value.shape, NUMPY_OF[t["dtype"]])
                target[...] = value

        stream._enqueue("execute", compute)
        return True


# ---------------------------------------------------------------------------- pycuda


class Device(Strict):
    _cls = "Device"
    _surface = "pycuda"

    def __init__(self, gpu, ordinal=0):
        super().__init__(gpu)
        if not gpu.initialised:
            raise FakeCudaError("cuInit has not been called")
        if ordinal >= gpu.options.gpus:
            raise FakeCudaError(f"invalid device ordinal {ordinal}")

    def name(self):
        return self._gpu.options.gpu_name

    def compute_capability(self):
        return self._gpu.options.compute_capability

    def retain_primary_context(self):
        self._gpu.record("Device.retain_primary_context")
        return CudaContext(self._gpu)


class CudaContext(Strict):
    _cls = "Context"
    _surface = "pycuda"

    def push(self):
        self._gpu.record("Context.push")
        self._gpu.context_stack.append(self)


class Stream(Strict):
    _cls = "Stream"
    _surface = "pycuda"

    def __init__(self, gpu, flags=0):
        super().__init__(gpu)
        object.__setattr__(self, "_handle", next(gpu.handles))
        object.__setattr__(self, "_queue", [])
        object.__setattr__(self, "_capture", None)
        gpu.streams[self._handle] = self

    @property
    def handle(self):
        return self._handle

    def _enqueue(self, kind: str, action: Callable[[], None]) -> None:
        if self._capture is not None:
            self._capture.append((kind, action))
        else:
            self._queue.append((kind, action))

    def synchronize(self):
        self._gpu.record("Stream.synchronize", self._handle)
        queue, self._queue[:] = list(self._queue), []
        for _kind, action in queue:
            action()


class Event(Strict):
    _cls = "Event"
    _surface = "pycuda"

    def __init__(self, gpu, flags=0):
        super().__init__(gpu)
        object.__setattr__(self, "_time", None)

    def record(self, stream=None):
        if stream is None:
            raise AssertionError("event recorded on the default stream")
        gpu = self._gpu

        def mark():
            object.__setattr__(self, "_time", next(gpu.clock) * 0.25)

        stream._enqueue("event", mark)
        return self

    def time_till(self, event):
        if self._time is None or event._time is None:
            raise FakeCudaError("cuEventElapsedTime: event not reached (stream not synchronized?)")
        return event._time - self._time


class DeviceAllocation(Strict):
    _cls = "DeviceAllocation"
    _surface = "pycuda"

    def __init__(self, gpu, nbytes: int):
        super().__init__(gpu)
        object.__setattr__(self, "_address", next(gpu.addresses) * 1 << 20)
        object.__setattr__(self, "_memory", np.zeros(int(nbytes), np.uint8))
        object.__setattr__(self, "_freed", False)
        gpu.allocations[self._address] = self

    def __int__(self):
        return self._address

    __index__ = __int__

    def free(self):
        self._gpu.record("DeviceAllocation.free", self._address)
        object.__setattr__(self, "_freed", True)
        self._gpu.allocations.pop(self._address, None)


# ---------------------------------------------------------------------------- cuda-python runtime


class FakeCudart(types.SimpleNamespace):
    """The few ``cuda.bindings.runtime`` functions the graph helper uses, with its tuple returns."""

    def __init__(self, gpu: "FakeGPU"):
        success, invalid = EnumValue("cudaError_t", "cudaSuccess", 0), EnumValue("cudaError_t", "invalid", 1)
        super().__init__(
            cudaError_t=types.SimpleNamespace(cudaSuccess=success),
            cudaStreamCaptureMode=types.SimpleNamespace(cudaStreamCaptureModeThreadLocal="thread-local"),
        )
        self._gpu, self._invalid = gpu, invalid
        self.graphs_launched = 0

    def cudaStreamBeginCapture(self, stream, mode):
        self._gpu.record("cudaStreamBeginCapture", stream, mode)
        object.__setattr__(self._gpu.streams[int(stream)], "_capture", [])
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamEndCapture(self, stream):
        self._gpu.record("cudaStreamEndCapture", stream)
        target = self._gpu.streams[int(stream)]
        captured = target._capture
        object.__setattr__(target, "_capture", None)
        if self._gpu.options.capture_fails:
            return self._invalid, None
        return self.cudaError_t.cudaSuccess, ("graph", captured)

    def cudaGraphInstantiate(self, graph, flags):
        self._gpu.record("cudaGraphInstantiate", flags)
        return self.cudaError_t.cudaSuccess, ("exec", graph[1])

    def cudaGraphLaunch(self, graph_exec, stream):
        self._gpu.record("cudaGraphLaunch", stream)
        self.graphs_launched += 1
        for kind, action in graph_exec[1]:
            self._gpu.streams[int(stream)]._enqueue(kind, action)
        return (self.cudaError_t.cudaSuccess,)

    def cudaGraphDestroy(self, graph):
        self._gpu.record("cudaGraphDestroy")
        return (self.cudaError_t.cudaSuccess,)

    def cudaGraphExecDestroy(self, graph_exec):
        self._gpu.record("cudaGraphExecDestroy")
        return (self.cudaError_t.cudaSuccess,)


# ---------------------------------------------------------------------------- the fake machine


@dataclass
class CalibrationLog:
    batch_size: int | None = None
    cache_read: bytes | None = None
    batches: list[list[tuple[int, ...]]] = field(default_factory=list)
    written: bytes | None = None


class FakeGPU:
    """One fake machine: TensorRT ``major`` bindings, pycuda, cuda-python, a GPU and its memory.

    Use :meth:`install` (through monkeypatch) to make ``import tensorrt`` / ``pycuda.driver``
    return the fakes.
    """

    def __init__(self, major: int, options: Options | None = None):
        self.major = major
        self.version = VERSIONS[major]
        self.options = options or Options()
        self.names = {"trt": load_names(f"trt{major}"), "pycuda": load_names("pycuda")}
        self.calls: list[tuple[str, tuple]] = []
        self.attribute_errors: list[str] = []
        self.context_stack: list[CudaContext] = []
        self.initialised = False
        self.streams: dict[int, Stream] = {}
        self.allocations: dict[int, DeviceAllocation] = {}
        self.pagelocked: list[np.ndarray] = []
        self.parsed_models: list[onnx.ModelProto] = []
        self.calibration = CalibrationLog()
        self.handles = itertools.count(0x7F00)
        self.addresses = itertools.count(1)
        self.clock = itertools.count(1)
        self._enum_numbers: dict[tuple[str, str], EnumValue] = {}
        self.trt = self._make_trt()
        self.cuda = self._make_pycuda()
        self.cudart = FakeCudart(self)

    # -------------------------------------------------------------- strictness and records

    def check(self, cls: str | None, name: str, surface: str = "trt") -> None:
        qualified = name if cls is None else f"{cls}.{name}"
        if qualified not in self.names[surface]:
            self.attribute_errors.append(qualified)
            label = "tensorrt" if surface == "trt" else "pycuda.driver"
            owner = label if cls is None else f"{label}.{cls}"
            raise AttributeError(f"{owner!r} has no attribute {name!r} "
                                 f"(not in the {surface} {self.version if surface == 'trt' else ''} bindings)")

    def record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def called(self, name: str) -> list[tuple]:
        """Arguments of every call to ``name`` (e.g. ``"IBuilderConfig.set_flag"``)."""
        return [args for call, args in self.calls if call == name]

    def order(self, *names: str) -> list[str]:
        """The sequence of calls among ``names``."""
        return [call for call, _ in self.calls if call in names]

    def enum_value(self, enum: str, member: str) -> EnumValue:
        member = DTYPE_ALIASES.get(member, member) if enum == "DataType" else member
        key = (enum, member)
        if key not in self._enum_numbers:
            members = sorted(n.split(".", 1)[1] for n in self.names["trt"] if n.startswith(enum + ".")
                             and n.count(".") == 1)
            number = members.index(member) if member in members else len(members)
            self._enum_numbers[key] = EnumValue(enum, member, number)
        return self._enum_numbers[key]

    def flag_bit(self, member: str) -> int:
        return 1 << int(self.enum_value("NetworkDefinitionCreationFlag", member))

    # -------------------------------------------------------------- device memory

    def memory_view(self, address: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        allocation = self.allocations[address]
        count = int(np.prod(shape)) if shape else 1
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > allocation._memory.size:
            raise AssertionError(f"device buffer of {allocation._memory.size} bytes too small for {shape} {dtype}")
        return allocation._memory[:nbytes].view(dtype).reshape(shape)

    # -------------------------------------------------------------- calibration as TensorRT does it

    def run_calibration(self, calibrator: Any, network: Network, config: BuilderConfig) -> None:
        log = self.calibration
        log.batch_size = calibrator.get_batch_size()
        cache = calibrator.read_calibration_cache()
        log.cache_read = bytes(cache) if cache else None
        if log.cache_read:
            return
        profile = config._calibration_profile
        names = [t.name for t in network._inputs]
        for _ in range(self.options.max_calibration_batches):
            pointers = calibrator.get_batch(names)
            if not pointers:
                break
            if len(pointers) != len(names):
                raise AssertionError(f"get_batch returned {len(pointers)} pointers for {len(names)} inputs")
            shapes = []
            for name, pointer in zip(names, pointers):
                opt = profile._shapes[name][1]
                dtype = NUMPY_OF[next(t for t in network._inputs if t.name == name)._info.dtype]
                allocation = self.allocations[int(pointer)]
                if allocation._memory.size != int(np.prod(opt)) * np.dtype(dtype).itemsize:
                    raise AssertionError(f"calibration buffer for {name} is not exactly the OPT shape {opt}")
                shapes.append(opt)
            log.batches.append(shapes)
        log.written = f"TRT-{self.version.replace('.', '')[:6]}-EntropyCalibration2\ninput: 3c010204\n".encode()
        calibrator.write_calibration_cache(memoryview(log.written))

    # -------------------------------------------------------------- modules

    def _make_trt(self) -> FakeModule:
        attrs: dict[str, Any] = {
            "__version__": self.version,
            "Logger": ClassRef(self, "Logger", "trt", lambda severity=None: Logger(self, severity)),
            "Builder": ClassRef(self, "Builder", "trt", lambda logger: Builder(self, logger)),
            "OnnxParser": ClassRef(self, "OnnxParser", "trt", lambda network, logger: OnnxParser(self, network, logger)),
            "Runtime": ClassRef(self, "Runtime", "trt", lambda logger: Runtime(self, logger)),
            "nptype": lambda data_type: NUMPY_OF[data_type.member],
        }
        for alias in DTYPE_ALIASES:
            attrs[alias] = self.enum_value("DataType", alias)
        if "IInt8EntropyCalibrator2" in self.names["trt"]:
            attrs["IInt8EntropyCalibrator2"] = _calibrator_base(self)
        return FakeModule("tensorrt", self, "trt", attrs)

    def _make_pycuda(self) -> FakeModule:
        gpu = self

        def init(flags=0):
            gpu.record("init")
            if gpu.options.gpus < 1:
                raise FakeCudaError("cuInit failed: no CUDA-capable device is detected")
            gpu.initialised = True

        def pop():
            gpu.record("Context.pop")
            if not gpu.context_stack:
                raise FakeCudaError("cannot pop: context stack is empty")
            gpu.context_stack.pop()

        def pagelocked_empty(shape, dtype, order="C", mem_flags=0):
            gpu.record("pagelocked_empty", shape, np.dtype(dtype))
            array = np.zeros(shape, dtype)
            gpu.pagelocked.append(array)
            return array

        def mem_alloc(nbytes):
            gpu.record("mem_alloc", int(nbytes))
            return DeviceAllocation(gpu, nbytes)

        def target_of(pointer) -> np.ndarray:
            return gpu.allocations[int(pointer)]._memory

        def memcpy_htod(dest, src):
            data = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
            target_of(dest)[:data.size] = data

        def memcpy_htod_async(dest, src, stream=None):
            gpu.record("memcpy_htod_async", int(dest), np.shape(src), stream)
            if stream is None:
                raise AssertionError("memcpy_htod_async on the default stream")
            stream._enqueue("h2d", lambda: memcpy_htod(dest, src))

        def memcpy_dtoh_async(dest, src, stream=None):
            gpu.record("memcpy_dtoh_async", int(src), np.shape(dest), stream)
            if stream is None:
                raise AssertionError("memcpy_dtoh_async on the default stream")

            def copy():
                flat = dest.reshape(-1).view(np.uint8)
                flat[...] = target_of(src)[:flat.size]

            stream._enqueue("d2h", copy)

        device_ref = ClassRef(self, "Device", "pycuda", lambda ordinal=0: Device(self, ordinal),
                              members={"count": lambda: self.options.gpus if self.initialised else 0})
        attrs = {
            "init": init,
            "Device": device_ref,
            "Context": ClassRef(self, "Context", "pycuda", members={"pop": pop}),
            "Stream": ClassRef(self, "Stream", "pycuda", lambda flags=0: Stream(self, flags)),
            "Event": ClassRef(self, "Event", "pycuda", lambda flags=0: Event(self, flags)),
            "pagelocked_empty": pagelocked_empty,
            "mem_alloc": mem_alloc,
            "memcpy_htod": memcpy_htod,
            "memcpy_htod_async": memcpy_htod_async,
            "memcpy_dtoh_async": memcpy_dtoh_async,
            "Error": FakeCudaError,
        }
        return FakeModule("pycuda.driver", self, "pycuda", attrs)

    def install(self, monkeypatch) -> "FakeGPU":
        """Make ``import tensorrt``, ``import pycuda.driver`` and the CUDA-graph helper use this fake."""
        package = types.ModuleType("pycuda")
        package.driver = self.cuda  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "tensorrt", self.trt)
        monkeypatch.setitem(sys.modules, "pycuda", package)
        monkeypatch.setitem(sys.modules, "pycuda.driver", self.cuda)
        import importlib

        runner_module = importlib.import_module("quantkit.backends.tensorrt.runner")
        monkeypatch.setattr(runner_module, "load_cudart", lambda: self.cudart)
        return self


def _calibrator_base(gpu: FakeGPU) -> type:
    """A Python class standing in for the pybind11 trampoline ``trt.IInt8EntropyCalibrator2``.

    Like the real one it insists that subclasses call ``IInt8EntropyCalibrator2.__init__``
    explicitly (pybind11 otherwise fails when TensorRT first calls back).
    """

    class IInt8EntropyCalibrator2:
        def __init__(self):
            self.__initialised = True
            gpu.record("IInt8EntropyCalibrator2.__init__")

        def __getattribute__(self, name):
            if name in ("get_batch", "get_batch_size", "read_calibration_cache", "write_calibration_cache"):
                try:
                    object.__getattribute__(self, "_IInt8EntropyCalibrator2__initialised")
                except AttributeError:
                    raise TypeError("IInt8EntropyCalibrator2.__init__() must be called when overriding "
                                    "__init__") from None
            return object.__getattribute__(self, name)

    return IInt8EntropyCalibrator2


def fake_engine_file(path: Path, plan: bytes) -> Path:
    path.write_bytes(plan)
    return path
