"""TensorRT backend: build an INT8 engine (10.x implicit or explicit Q/DQ) and run it with pycuda.

Modules (nothing here imports TensorRT or pycuda at import time; each function that
needs them imports them through :mod:`.detect`):

* :mod:`.engine` -- :func:`build_engine_trt`, the entry point ``quantkit build-engine`` calls,
  the engine manifest and :func:`check_engine_portability`.
* :mod:`.detect` -- feature detection: which build paths the installed TensorRT has.
* :mod:`.build_implicit` -- TensorRT 10.x implicit INT8: INT8/FP16 flags, entropy calibrator,
  per-layer FP16 constraints.
* :mod:`.build_explicit` -- strongly typed build of the Q/DQ model (TensorRT 11.x; also 10.x).
* :mod:`.calibrator` -- the ``IInt8EntropyCalibrator2`` adapter and the batch feeder behind it.
* :mod:`.network` -- build steps both paths share (parse, profiles, timing cache, layer names).
* :mod:`.fp16` -- explicit FP16 conversion of chosen ONNX nodes (pure ONNX, runs on CPU).
* :mod:`.runner` -- :class:`~.runner.TrtRunner` (pycuda, streams, CUDA-event timing, CUDA graphs).
* :mod:`.surface` -- the registry of TensorRT/pycuda names the backend touches, read by the
  name check and the recording fake in ``tests/backends/tensorrt``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_engine_trt", "check_engine_portability", "TrtRunner"]

_LAZY = {
    "build_engine_trt": "quantkit.backends.tensorrt.engine",
    "check_engine_portability": "quantkit.backends.tensorrt.engine",
    "TrtRunner": "quantkit.backends.tensorrt.runner",
}


def __getattr__(name: str) -> Any:
    # the submodules only import numpy/onnx at import time, but keep `import quantkit.backends.tensorrt` free
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
