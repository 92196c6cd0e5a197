"""ONNX Runtime CPU runner: one InferenceSession per artifact, threads set explicitly.

Graph optimisations are all on (``ORT_ENABLE_ALL``: constant folding, fusions and,
for QDQ models, the INT8 kernel selection that makes them fast). The intra-op
thread count is always set explicitly - by default to the number of physical
cores this process may use - because ONNX Runtime's own default counts logical
cores, and hyper-threads slow INT8 GEMMs down and make timings noisy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from quantkit.backends.base import Runner, TensorSpec
from quantkit.errors import ModelError

CPU_PROVIDER = "CPUExecutionProvider"

# ONNX type strings (NodeArg.type) -> numpy dtypes
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def physical_cores() -> int:
    """Physical cores this process may run on (at least 1).

    psutil when installed, else /proc/cpuinfo's (physical id, core id) pairs, else
    the logical count; never more than the CPUs in this process's affinity mask.
    """
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = None
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except ImportError:
        cores = _cpuinfo_physical_cores()
    return max(1, min(cores or allowed, allowed))


def _cpuinfo_physical_cores() -> int | None:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    pairs, physical = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            physical = value.strip()
        elif key == "core id":
            pairs.add((physical, value.strip()))
    return len(pairs) or None


class OrtRunner(Runner):
    """Runs an ONNX model (FP32 or QDQ INT8) with ONNX Runtime.

    Args:
        model_path: the ``.onnx`` file.
        threads: intra-op threads; None means :func:`physical_cores`.
        providers: execution providers in priority order (CPU only by default).
        name: label for messages; the file name by default.
    """

    def __init__(self, model_path: str | Path, threads: int | None = None, *,
                 providers: Sequence[str] = (CPU_PROVIDER,), name: str | None = None):
        super().__init__(name or Path(model_path).name)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.model_path = Path(model_path)
        self.threads = threads if threads is not None else physical_cores()
        self.requested_providers = list(providers)
        self._session = None
        self._inputs: list[TensorSpec] = []
        self._outputs: list[str] = []

    @property
    def providers(self) -> list[str]:
        return list(self._session.get_providers()) if self._session is not None else []

    def session_options(self):
        """The SessionOptions used (for the record: threads, optimisation level)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1  # sequential execution: a second pool would only compete
        options.log_severity_level = 3
        return options

    def _activate_impl(self) -> None:
        import onnxruntime as ort

        if not self.model_path.is_file():
            raise ModelError(f"{self.model_path}: model file not found")
        try:
            session = ort.InferenceSession(str(self.model_path), self.session_options(),
                                           providers=self.requested_providers)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"{self.model_path}: ONNX Runtime cannot load the model: {first}") from None
        self._inputs = [TensorSpec(arg.name, tuple(arg.shape), np.dtype(_ort_dtype(arg.type)))
                        for arg in session.get_inputs()]
        self._outputs = [arg.name for arg in session.get_outputs()]
        self._session = session

    def _infer_impl(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self._session.run(self._outputs, dict(feed))
        except Exception as exc:  # noqa: BLE001
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"{self.name}: inference failed: {first}") from None
        return dict(zip(self._outputs, values))

    def _deactivate_impl(self) -> None:
        self._session = None
        self._inputs, self._outputs = [], []

    def _input_specs_impl(self) -> list[TensorSpec]:
        return list(self._inputs)

    def _output_names_impl(self) -> list[str]:
        return list(self._outputs)


def _ort_dtype(type_string: str) -> Any:
    try:
        return _ORT_TYPES[type_string]
    except KeyError:
        raise ModelError(f"unsupported ONNX Runtime input type {type_string}") from None


class OnnxRuntimeBackend:
    """The ``onnxruntime`` entry of the backend table (CPU)."""

    name = "onnxruntime"

    def is_available(self) -> tuple[bool, str]:
        try:
            import onnxruntime as ort
        except ImportError:
            return False, "onnxruntime is not installed (pip install onnxruntime)"
        if CPU_PROVIDER not in ort.get_available_providers():
            return False, f"{CPU_PROVIDER} missing from {ort.get_available_providers()}"
        return True, ""

    def open_runner(self, artifact_path: str | Path, **options: Any) -> OrtRunner:
        """An inactive :class:`OrtRunner`; options: ``threads``, ``providers``, ``name``."""
        return OrtRunner(artifact_path, **options)


BACKEND = OnnxRuntimeBackend()
