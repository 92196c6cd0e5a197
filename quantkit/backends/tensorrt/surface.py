"""The TensorRT and pycuda names this backend touches, and the rule that lets CI check them.

TensorRT cannot run here, so every name the backend uses is checked against the real
bindings instead (``names/trt10.txt``, ``names/trt11.txt``, ``names/pycuda.txt``, made by
``scripts/trt_names.py`` from the published wheels). The check
(``tests/backends/tensorrt/test_names.py``) reads the source with :mod:`ast`; for it to
see what is a TensorRT object, the backend follows one rule:

1. The ``tensorrt`` module is always bound to the name ``trt`` and ``pycuda.driver`` to
   ``cuda`` (both come from :mod:`.detect`); as attributes, ``self._trt`` / ``self._cuda``.
2. A TensorRT or pycuda object is held in a variable, parameter or attribute named after
   its role, as listed in :data:`TRT_ROLES` / :data:`CUDA_ROLES` (``builder``,
   ``network``, ``self._context`` ...; leading underscores are ignored). Nothing else in
   these modules uses those names.
3. Each module that touches TensorRT is listed in :data:`MODULE_MAJORS` with the major
   versions whose bindings it must run under.

The check then collects ``trt.X`` / ``trt.X.Y`` (as ``X`` / ``X.Y``), ``<role>.m`` (as
``Class.m``), ``cuda.X`` and ``<cuda role>.m``, plus the names probed with
``hasattr(trt..., "name")``, and asserts each one is in the list of every major the
module runs under (probes: in at least one). The recording fake in the tests reads the
same lists and raises ``AttributeError`` for anything else, so what the static check
cannot see (an object reached some other way) is still checked when the contract tests
run the code.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

NAMES_DIR = Path(__file__).resolve().parent / "names"

# variable / attribute name -> TensorRT class
TRT_ROLES: dict[str, str] = {
    "logger": "Logger",
    "builder": "Builder",
    "network": "INetworkDefinition",
    "config": "IBuilderConfig",
    "parser": "OnnxParser",
    "parser_error": "ParserError",
    "profile": "IOptimizationProfile",
    "timing_cache": "ITimingCache",
    "plan": "IHostMemory",
    "runtime": "Runtime",
    "engine": "ICudaEngine",
    "context": "IExecutionContext",
    "layer": "ILayer",
    "tensor": "ITensor",
}

# variable / attribute name -> pycuda.driver class
CUDA_ROLES: dict[str, str] = {
    "device": "Device",
    "cuda_context": "Context",
    "stream": "Stream",
    "device_buffer": "DeviceAllocation",
    "start_event": "Event",
    "end_event": "Event",
    "event": "Event",
}

# module (file stem under quantkit/backends/tensorrt) -> TensorRT majors it runs under
MODULE_MAJORS: dict[str, tuple[str, ...]] = {
    "detect": ("10", "11"),
    "network": ("10", "11"),
    "engine": ("10", "11"),
    "build_implicit": ("10",),
    "calibrator": ("10",),
    "build_explicit": ("10", "11"),
    "runner": ("10", "11"),
}


@lru_cache(maxsize=None)
def load_names(label: str) -> frozenset[str]:
    """The committed name list ``names/<label>.txt`` (``trt10``, ``trt11`` or ``pycuda``)."""
    path = NAMES_DIR / f"{label}.txt"
    lines = path.read_text(encoding="utf-8").splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))
