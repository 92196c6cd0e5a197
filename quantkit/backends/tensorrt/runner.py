"""TensorRT runner: pycuda streams, pinned buffers, CUDA-event timing, optional CUDA graphs.

One *worker* per stream: its own execution context (with its own optimization profile when
the engine has enough, else a shared one - TensorRT 10+ shares profiles between contexts),
its own non-default stream, and for every I/O tensor a pinned host buffer and a device
buffer sized for the profile's MAX shape. One inference on a worker is::

    H2D copies -> execute_async_v3 (or a CUDA graph launch) -> D2H copies -> stream.synchronize()

with CUDA events around each phase. Timings follow trtexec (TensorRT's
``samples/common/sampleReporting.cpp``): *H2D latency*, *GPU compute time* and *D2H
latency* from the events, *latency* = their sum, *enqueue time* = host time spent in the
enqueue call. ``infer`` reports the latency through the runner contract; all of them are in
:meth:`TrtRunner.last_timings`. :meth:`TrtRunner.infer_concurrent` spreads batches over the
workers so streams overlap (throughput = items / wall time).

The device's primary context (the CUDA runtime's, which TensorRT uses) is pushed in
``activate`` and popped in ``deactivate`` - also when activation fails halfway.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from quantkit.backends.base import Runner, TensorSpec
from quantkit.backends.tensorrt import detect
from quantkit.backends.tensorrt.cudagraph import CudaGraph, GraphCaptureError, load_cudart
from quantkit.errors import ModelError, NotAvailableError


@dataclass
class _Binding:
    """One I/O tensor of one worker."""

    name: str
    is_input: bool
    dtype: np.dtype
    host: np.ndarray  # flat, pinned, MAX-shape capacity
    device_buffer: Any
    min_shape: tuple[int, ...]
    max_shape: tuple[int, ...]


@dataclass
class _Worker:
    """An execution context with its stream, buffers, events and captured graphs."""

    index: int
    context: Any
    stream: Any
    profile_index: int
    bindings: dict[str, _Binding]
    events: dict[str, Any]
    graphs: dict[tuple, CudaGraph] = field(default_factory=dict)
    enqueue_seconds: float = 0.0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


class TrtRunner(Runner):
    """Runs a TensorRT engine file.

    Args:
        engine_path: the ``.engine`` plan.
        streams: workers (stream + execution context each) for :meth:`infer_concurrent`.
        cuda_graph: replay each input shape's enqueue as a CUDA graph (cuda-python); falls
            back to plain enqueue, with a warning, when cuda-python is missing or capture fails.
        name: label for messages; the file name by default.
        check_portability: refuse an engine whose manifest (``<engine>.json``) names another
            TensorRT version or GPU (default on).
        console: where warnings go (``quantkit.ui.Console``); None prints nothing.
    """

    def __init__(self, engine_path: str | Path, streams: int = 1, cuda_graph: bool = False, *,
                 name: str | None = None, check_portability: bool = True, console: Any = None):
        super().__init__(name or Path(engine_path).name)
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.engine_path = Path(engine_path)
        self.streams = streams
        self.cuda_graph = cuda_graph
        self.check_portability = check_portability
        self.console = console
        self._trt: Any = None
        self._cuda: Any = None
        self._cudart: Any = None
        self._pushed = False
        self._runtime: Any = None
        self._engine: Any = None
        self._workers: list[_Worker] = []
        self._inputs: list[TensorSpec] = []
        self._outputs: list[str] = []
        self._timings: dict[str, float] = {}
        self._graphs_failed = False

    @property
    def providers(self) -> list[str]:
        return ["TensorRT"] if self.is_active else []

    # ------------------------------------------------------------------ lifecycle

    def _activate_impl(self) -> None:
        if not self.engine_path.is_file():
            raise ModelError(f"{self.engine_path}: engine file not found")
        trt = detect.import_tensorrt()
        cuda = detect.import_pycuda()
        self._trt, self._cuda = trt, cuda
        try:
            cuda.init()
            device = cuda.Device(0)
            cuda_context = device.retain_primary_context()
        except Exception as exc:  # noqa: BLE001 - pycuda raises its own error types
            raise NotAvailableError(detect.INSTALL_HINT, hint=f"no usable CUDA device: {exc}") from None
        cuda_context.push()
        self._pushed = True
        try:
            self._check_engine(trt, device)
            self._load(trt, cuda)
        except BaseException:
            self._release()
            raise

    def _check_engine(self, trt: Any, device: Any) -> None:
        from quantkit.backends.tensorrt.engine import (check_engine_file, check_engine_portability,
                                                       current_platform, read_engine_manifest)

        manifest = read_engine_manifest(self.engine_path)
        if manifest is None or not self.check_portability:
            return
        check_engine_file(self.engine_path, manifest)
        check_engine_portability(manifest, current_platform(trt, device), self.engine_path.name)

    def _load(self, trt: Any, cuda: Any) -> None:
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if engine is None:
            raise ModelError(f"{self.engine_path}: TensorRT cannot deserialize this engine (built with another "
                             "TensorRT version or for another GPU?)")
        self._runtime, self._engine = runtime, engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in inputs]
        self._inputs = [TensorSpec(n, tuple(None if d < 0 else int(d) for d in engine.get_tensor_shape(n)),
                                   _numpy_dtype(trt, engine.get_tensor_dtype(n), n)) for n in inputs]
        if self.cuda_graph:
            self._cudart = load_cudart()
            if self._cudart is None:
                self._warn("CUDA graphs need cuda-python (pip install cuda-python); running without them")
        for index in range(self.streams):
            self._workers.append(self._make_worker(trt, cuda, engine, index))

    def _make_worker(self, trt: Any, cuda: Any, engine: Any, index: int) -> _Worker:
        stream = cuda.Stream()
        context = engine.create_execution_context()
        if context is None:
            raise ModelError(f"{self.name}: TensorRT could not create execution context {index} (out of memory?)")
        profile_index = index % engine.num_optimization_profiles
        if not context.set_optimization_profile_async(profile_index, stream.handle):
            raise ModelError(f"{self.name}: cannot select optimization profile {profile_index}")
        stream.synchronize()
        ranges = {}
        for spec in self._inputs:
            low, _opt, high = engine.get_tensor_profile_shape(spec.name, profile_index)
            ranges[spec.name] = (tuple(int(d) for d in low), tuple(int(d) for d in high))
            context.set_input_shape(spec.name, ranges[spec.name][1])
        bindings = {}
        for spec in self._inputs:
            low, high = ranges[spec.name]
            bindings[spec.name] = self._bind(cuda, context, spec.name, True, spec.dtype, low, high)
        for name in self._outputs:
            # with every input at its MAX shape, the output shapes are their maxima
            high = tuple(int(d) for d in context.get_tensor_shape(name))
            if any(d < 0 for d in high):
                raise ModelError(f"{self.name}: output {name!r} has a data-dependent shape {list(high)}; "
                                 "not supported")
            dtype = _numpy_dtype(trt, engine.get_tensor_dtype(name), name)
            bindings[name] = self._bind(cuda, context, name, False, dtype, high, high)
        events = {phase: cuda.Event() for phase in ("h2d_start", "compute_start", "compute_end", "d2h_end")}
        return _Worker(index, context, stream, profile_index, bindings, events)

    @staticmethod
    def _bind(cuda: Any, context: Any, name: str, is_input: bool, dtype: np.dtype,
              low: tuple[int, ...], high: tuple[int, ...]) -> _Binding:
        count = max(1, math.prod(high))
        host = cuda.pagelocked_empty(count, dtype)
        device_buffer = cuda.mem_alloc(count * dtype.itemsize)
        if not context.set_tensor_address(name, int(device_buffer)):
            raise ModelError(f"cannot bind tensor {name!r}")
        return _Binding(name, is_input, dtype, host, device_buffer, low, high)

    def _deactivate_impl(self) -> None:
        self._release()

    def _release(self) -> None:
        """Free graphs, buffers, contexts and the engine, then pop the CUDA context (always)."""
        try:
            for worker in self._workers:
                for graph in worker.graphs.values():
                    graph.destroy()
                worker.graphs.clear()
                for binding in worker.bindings.values():
                    binding.device_buffer.free()
                worker.bindings.clear()
                worker.context = None
        finally:
            self._workers = []
            self._engine = None
            self._runtime = None
            self._inputs, self._outputs = [], []
            if self._pushed:
                self._pushed = False
                self._cuda.Context.pop()

    # ------------------------------------------------------------------ metadata

    def _input_specs_impl(self) -> list[TensorSpec]:
        return list(self._inputs)

    def _output_names_impl(self) -> list[str]:
        return list(self._outputs)

    def last_timings(self) -> dict[str, float]:
        """Milliseconds of the last ``infer``: h2d, compute, d2h, latency (their sum), enqueue."""
        self._require_active("last_timings()")
        return dict(self._timings)

    # ------------------------------------------------------------------ inference

    def _infer_impl(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        worker = self._workers[0]
        self._enqueue(worker, feed)
        worker.stream.synchronize()
        self._timings = self._read_timings(worker)
        self._report_inference_time(self._timings["latency_ms"] / 1000.0)
        return self._outputs_of(worker, copy=False)

    def infer_concurrent(self, feeds: Sequence[Mapping[str, np.ndarray]]) -> tuple[list[dict[str, np.ndarray]],
                                                                                    list[dict[str, float]]]:
        """Run several feeds, spread over the workers so their streams overlap.

        Feeds go out in waves of one per worker; each wave is enqueued on all streams before
        any is synchronized.

        Returns:
            (outputs per feed, copied; timings per feed in ms, as :meth:`last_timings`).
        """
        self._require_active("infer_concurrent()")
        results: list[dict[str, np.ndarray]] = []
        timings: list[dict[str, float]] = []
        for start in range(0, len(feeds), len(self._workers)):
            wave = list(zip(self._workers, feeds[start:start + len(self._workers)]))
            for worker, feed in wave:
                self._enqueue(worker, feed)
            for worker, _feed in wave:
                worker.stream.synchronize()
                results.append(self._outputs_of(worker, copy=True))
                timings.append(self._read_timings(worker))
        if timings:
            self._timings = timings[-1]
        return results, timings

    def _enqueue(self, worker: _Worker, feed: Mapping[str, np.ndarray]) -> None:
        cuda, context, stream = self._cuda, worker.context, worker.stream
        for spec in self._inputs:
            binding = worker.bindings[spec.name]
            array = np.ascontiguousarray(feed[spec.name], dtype=binding.dtype)
            _check_in_profile(self.name, binding, array.shape)
            if not context.set_input_shape(spec.name, array.shape):
                raise ModelError(f"{self.name}: TensorRT rejected shape {list(array.shape)} for {spec.name!r}")
            np.copyto(binding.host[:array.size].reshape(array.shape), array)
            worker.shapes[spec.name] = tuple(array.shape)
        _record(worker.events["h2d_start"], stream)
        for spec in self._inputs:
            binding = worker.bindings[spec.name]
            count = math.prod(worker.shapes[spec.name])
            cuda.memcpy_htod_async(binding.device_buffer, binding.host[:count], stream)
        _record(worker.events["compute_start"], stream)
        self._execute(worker)
        _record(worker.events["compute_end"], stream)
        for name in self._outputs:
            binding = worker.bindings[name]
            shape = tuple(int(d) for d in context.get_tensor_shape(name))
            worker.shapes[name] = shape
            cuda.memcpy_dtoh_async(binding.host[:math.prod(shape)], binding.device_buffer, stream)
        _record(worker.events["d2h_end"], stream)

    def _execute(self, worker: _Worker) -> None:
        """execute_async_v3, or a CUDA graph of it for this input shape (captured on first use)."""
        context, stream = worker.context, worker.stream
        key = tuple(worker.shapes[spec.name] for spec in self._inputs)
        use_graphs = self.cuda_graph and self._cudart is not None and not self._graphs_failed
        graph = worker.graphs.get(key) if use_graphs else None
        started = time.perf_counter()
        if graph is not None:
            graph.launch(stream.handle)
            worker.enqueue_seconds = time.perf_counter() - started
            return
        if not context.execute_async_v3(stream.handle):
            raise ModelError(f"{self.name}: TensorRT execute_async_v3 failed (see the TensorRT log)")
        worker.enqueue_seconds = time.perf_counter() - started
        if use_graphs:
            # the plain enqueue above ran this shape once (TensorRT wants that before capture);
            # capturing only records work, so the results of this call are unaffected
            try:
                worker.graphs[key] = CudaGraph.capture(self._cudart, stream.handle,
                                                       lambda: context.execute_async_v3(stream.handle))
            except GraphCaptureError as exc:
                self._graphs_failed = True
                self._warn(f"CUDA graph capture failed ({exc}); running without graphs")

    def _read_timings(self, worker: _Worker) -> dict[str, float]:
        events = worker.events
        h2d = _elapsed_ms(events["h2d_start"], events["compute_start"])
        compute = _elapsed_ms(events["compute_start"], events["compute_end"])
        d2h = _elapsed_ms(events["compute_end"], events["d2h_end"])
        return {"h2d_ms": h2d, "compute_ms": compute, "d2h_ms": d2h, "latency_ms": h2d + compute + d2h,
                "enqueue_ms": worker.enqueue_seconds * 1000.0}

    def _outputs_of(self, worker: _Worker, copy: bool) -> dict[str, np.ndarray]:
        outputs = {}
        for name in self._outputs:
            shape = worker.shapes[name]
            view = worker.bindings[name].host[:math.prod(shape)].reshape(shape)
            outputs[name] = view.copy() if copy else view
        return outputs

    def _warn(self, message: str) -> None:
        if self.console is not None:
            self.console.warn(f"{self.name}: {message}")


def _record(event: Any, stream: Any) -> None:
    event.record(stream)


def _elapsed_ms(start_event: Any, end_event: Any) -> float:
    return float(start_event.time_till(end_event))


def _numpy_dtype(trt: Any, data_type: Any, name: str) -> np.dtype:
    try:
        return np.dtype(trt.nptype(data_type))
    except TypeError:
        raise ModelError(f"tensor {name!r} has TensorRT type {data_type}, which has no numpy equivalent") from None


def _check_in_profile(where: str, binding: _Binding, shape: tuple[int, ...]) -> None:
    if len(shape) != len(binding.max_shape) or any(
            not low <= dim <= high for dim, low, high in zip(shape, binding.min_shape, binding.max_shape)):
        raise ModelError(f"{where}: input {binding.name!r} shape {list(shape)} is outside the engine's optimization "
                         f"profile (min {list(binding.min_shape)}, max {list(binding.max_shape)}); rebuild with a "
                         "wider build.profile")


class TensorRTBackend:
    """The ``tensorrt`` entry of the backend table."""

    name = "tensorrt"

    def is_available(self) -> tuple[bool, str]:
        try:
            detect.import_tensorrt()
            cuda = detect.import_pycuda()
            cuda.init()
            if cuda.Device.count() < 1:
                return False, "no NVIDIA GPU found"
        except NotAvailableError as exc:
            return False, str(exc)
        except Exception as exc:  # noqa: BLE001 - pycuda's driver errors
            return False, f"CUDA driver unusable: {exc}"
        return True, ""

    def open_runner(self, artifact_path: str | Path, **options: Any) -> TrtRunner:
        """An inactive :class:`TrtRunner`; options: ``streams``, ``cuda_graph``, ``name``, ``console``.

        ``threads`` (meant for CPU backends) is accepted and ignored.
        """
        options.pop("threads", None)
        return TrtRunner(artifact_path, **options)


BACKEND = TensorRTBackend()
