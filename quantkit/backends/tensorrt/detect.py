"""Import TensorRT and pycuda on demand and find out, by feature detection, what they offer.

Paths are chosen only with ``hasattr`` on the installed module - never by comparing
version numbers or integer enum values (TensorRT 11 renumbered its enums):

* ``implicit`` (TensorRT 10.x): an ``IInt8EntropyCalibrator2`` to subclass, builder flags
  ``INT8``/``FP16``/``OBEY_PRECISION_CONSTRAINTS``, a calibration profile and per-layer
  precision. All removed in 11.x.
* ``explicit``: a strongly typed network built from a Q/DQ model. 10.x offers it through the
  ``STRONGLY_TYPED`` creation flag; in 11.x strong typing is the only mode.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from quantkit.errors import NotAvailableError

INSTALL_HINT = "TensorRT backend needs `pip install 'quantkit[tensorrt]'` and an NVIDIA GPU"
PATHS = ("implicit", "explicit")

# what each path needs: (owner expression, attribute) probed with hasattr
_IMPLICIT_NEEDS = (
    ("trt", "IInt8EntropyCalibrator2"),
    ("trt.BuilderFlag", "INT8"),
    ("trt.BuilderFlag", "FP16"),
    ("trt.BuilderFlag", "OBEY_PRECISION_CONSTRAINTS"),
    ("trt.IBuilderConfig", "int8_calibrator"),
    ("trt.IBuilderConfig", "set_calibration_profile"),
    ("trt.ILayer", "precision"),
    ("trt.ILayer", "set_output_type"),
)


def import_tensorrt() -> Any:
    """The ``tensorrt`` module.

    Raises:
        NotAvailableError: TensorRT is not installed or its libraries do not load.
    """
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:
        raise NotAvailableError(INSTALL_HINT, hint=f"import tensorrt: {exc}") from None
    return trt


def import_pycuda() -> Any:
    """``pycuda.driver`` (not ``pycuda.autoinit``: contexts are pushed and popped explicitly).

    Raises:
        NotAvailableError: pycuda is not installed or the CUDA driver does not load.
    """
    try:
        import pycuda.driver as cuda
    except (ImportError, OSError) as exc:
        raise NotAvailableError(INSTALL_HINT, hint=f"import pycuda.driver: {exc}") from None
    return cuda


def missing_for_path(trt: Any, path: str) -> list[str]:
    """What the installed TensorRT lacks for ``path`` (empty when the path is available)."""
    if path == "implicit":
        owners = {"trt": trt, "trt.BuilderFlag": trt.BuilderFlag, "trt.IBuilderConfig": trt.IBuilderConfig,
                  "trt.ILayer": trt.ILayer}
        return [f"{owner}.{name}" for owner, name in _IMPLICIT_NEEDS if not hasattr(owners[owner], name)]
    if path == "explicit":
        # 10.x: strong typing is opt-in through the creation flag; 11.x: weak typing is gone
        # (no FP16 builder flag), so every network is strongly typed.
        opt_in = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
        always = not hasattr(trt.BuilderFlag, "FP16")
        return [] if opt_in or always else ["trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED"]
    raise ValueError(f"unknown TensorRT build path {path!r}; expected one of {PATHS}")


def available_paths(trt: Any) -> list[str]:
    """The build paths the installed TensorRT supports, preferred first."""
    return [path for path in PATHS if not missing_for_path(trt, path)]


def choose_path(trt: Any, requested: str) -> str:
    """Resolve ``auto`` / check an explicit request.

    ``auto`` prefers ``implicit`` (calibrated INT8 with FP16 fallback, the 10.x way) and
    falls back to ``explicit`` where calibrators are gone (11.x).

    Raises:
        NotAvailableError: the installed TensorRT lacks the requested path.
    """
    version = getattr(trt, "__version__", "unknown")
    if requested == "auto":
        paths = available_paths(trt)
        if not paths:
            raise NotAvailableError(f"TensorRT {version} offers neither implicit INT8 calibration nor strongly "
                                    "typed networks; quantkit supports TensorRT 10.x and 11.x")
        return paths[0]
    missing = missing_for_path(trt, requested)
    if missing:
        others = [p for p in available_paths(trt) if p != requested]
        instead = f"; use path '{others[0]}' instead" if others else ""
        raise NotAvailableError(f"the {requested} build path needs {', '.join(missing)}, which TensorRT "
                                f"{version} does not have{instead}")
    return requested


def strongly_typed_flags(trt: Any) -> int:
    """``create_network`` flags for a strongly typed network.

    The flag is set where weak typing still exists (10.x: strong typing is opt-in); where
    it does not (11.x) every network is strongly typed and the flag is deprecated, so 0.
    """
    if hasattr(trt.BuilderFlag, "FP16") and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return 0


def trt_version(trt: Any) -> str:
    """The installed TensorRT version string (``10.16.1.11``)."""
    return str(getattr(trt, "__version__", "unknown"))


def cache_version_code(trt: Any) -> int | None:
    """The number TensorRT writes in calibration cache headers, or None when unknown.

    Used only to decide whether our ``calib.cache`` header matches what this TensorRT
    accepts (it silently ignores a mismatching cache), never to choose a code path.
    """
    from quantkit.calib.cache import trt_version_code

    parts = trt_version(trt).split(".")
    try:
        major, minor, patch = (int(p) for p in parts[:3])
        return trt_version_code(major, minor, patch)
    except ValueError:
        return None


@contextmanager
def primary_context(cuda: Any) -> Iterator[Any]:
    """Make device 0's primary context (the CUDA runtime's, which TensorRT uses) current.

    Yields the pycuda ``Device``; the context is popped on exit, also on errors.

    Raises:
        NotAvailableError: no CUDA driver or no GPU.
    """
    try:
        cuda.init()
        device = cuda.Device(0)
        cuda_context = device.retain_primary_context()
    except Exception as exc:  # noqa: BLE001 - pycuda raises its own error types
        raise NotAvailableError(INSTALL_HINT, hint=f"no usable CUDA device: {exc}") from None
    cuda_context.push()
    try:
        yield device
    finally:
        cuda.Context.pop()


def gpu_info(device: Any) -> dict[str, str]:
    """Name and compute capability (``"8.6"``) of a pycuda ``Device``."""
    major, minor = device.compute_capability()
    return {"name": str(device.name()), "compute_capability": f"{major}.{minor}"}
