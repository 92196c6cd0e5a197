"""TensorRT 10.x entropy calibration: our cache when it is valid, else batches from the data loader.

Two parts:

* :class:`CalibrationFeeder` holds all the logic and knows nothing about TensorRT, so it is
  tested on its own: it hands out our ``calib.cache`` (already checked), copies each batch -
  exactly the profile's OPT shape - into pycuda device buffers, saves what TensorRT writes,
  and records every exception, because TensorRT swallows exceptions raised in these
  callbacks and would otherwise carry on without calibration.
* :func:`make_entropy_calibrator` returns a thin ``trt.IInt8EntropyCalibrator2`` subclass that
  forwards TensorRT's callbacks to the feeder. The class can only exist once TensorRT is
  imported, hence the factory (one class per ``trt`` module).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from quantkit.artifacts import atomic_write_bytes
from quantkit.calib.cache import ALGORITHM_ENTROPY2, CacheFormatError, read_trt_cache
from quantkit.errors import DataError, ModelError


def load_valid_cache(path: Path | None, expected_version: int | None, console: Any) -> bytes | None:
    """Our calibration cache, if TensorRT will accept it; None (with a loud warning) otherwise.

    TensorRT silently ignores a cache whose header names another version or algorithm and
    recalibrates on the GPU, so the header is checked here: ``TRT-<expected_version>-
    EntropyCalibration2``.
    """
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        console.warn(f"{path}: calibration cache not found; TensorRT will calibrate on the GPU")
        return None
    data = path.read_bytes()
    try:
        cache = read_trt_cache(data)
    except (CacheFormatError, TypeError) as exc:
        console.warn(f"{path}: not a TensorRT calibration cache ({exc}); TensorRT will calibrate on the GPU")
        return None
    if cache.algorithm != ALGORITHM_ENTROPY2:
        console.warn(f"{path}: cache algorithm {cache.algorithm} is not {ALGORITHM_ENTROPY2}; "
                     "TensorRT will calibrate on the GPU")
        return None
    if expected_version is not None and cache.version != expected_version:
        console.warn(f"{path}: cache header {cache.header} does not match this TensorRT (expects "
                     f"TRT-{expected_version}-{ALGORITHM_ENTROPY2}); TensorRT would ignore it, so it calibrates "
                     f"on the GPU instead. Set calibration.trt_cache_version: {expected_version} and re-run "
                     "`quantkit calibrate` to reuse our scales")
        return None
    return data


class CalibrationFeeder:
    """What the calibrator does, without TensorRT.

    Args:
        cuda: ``pycuda.driver`` (device buffers and copies).
        batches: a callable returning a fresh iterator of ``{input name: array}`` batches, or None
            (then only the cache can calibrate).
        opt_shapes: input name -> the profile's OPT shape; every fed batch must have exactly it.
        cache: our validated cache bytes, or None.
        write_path: where to save the cache TensorRT writes after calibrating on the GPU.
        console: for progress and warnings.
    """

    def __init__(self, cuda: Any, batches: Callable[[], Iterator[Mapping[str, np.ndarray]]] | None,
                 opt_shapes: Mapping[str, tuple[int, ...]], cache: bytes | None, write_path: Path, console: Any):
        self.cuda = cuda
        self.batches = batches
        self.opt_shapes = {name: tuple(shape) for name, shape in opt_shapes.items()}
        self.cache = cache
        self.write_path = Path(write_path)
        self.console = console
        self.events: list[str] = []  # callback names in call order (for reports and tests)
        self.errors: list[tuple[str, BaseException]] = []
        self.fed = 0
        self.skipped = 0
        self.written: Path | None = None
        self._iterator: Iterator[Mapping[str, np.ndarray]] | None = None
        self._buffers: dict[str, Any] = {}

    @property
    def batch_size(self) -> int:
        """The OPT batch size (every fed batch has it)."""
        return next(iter(self.opt_shapes.values()))[0]

    def read_cache(self) -> bytes | None:
        self.events.append("read_calibration_cache")
        return self.cache

    def next_batch(self, names: Sequence[str]) -> list[int] | None:
        """Device pointers of the next batch in ``names`` order, or None when exhausted."""
        self.events.append("get_batch")
        if self.batches is None:
            return None
        if self._iterator is None:
            self._iterator = iter(self.batches())
        for batch in self._iterator:
            if self._is_short_remainder(batch):
                self.skipped += 1
                continue
            pointers = [self._upload(name, batch) for name in names]
            self.fed += 1
            return pointers
        if self.fed == 0:
            raise DataError("calibration data gave no batch of the profile's OPT shape "
                            f"{self.opt_shapes}; TensorRT cannot calibrate")
        return None

    def write_cache(self, data: bytes) -> None:
        self.events.append("write_calibration_cache")
        atomic_write_bytes(self.write_path, data)
        self.written = self.write_path

    def guarded(self, callback: str, action: Callable[[], Any], fallback: Any) -> Any:
        """Run a callback body; record (not raise) its exception, since TensorRT would swallow it."""
        try:
            return action()
        except BaseException as exc:  # noqa: BLE001 - everything must reach the build, even Ctrl-C
            self.errors.append((callback, exc))
            return fallback

    def raise_recorded(self) -> None:
        """Re-raise the first exception a callback recorded (call after the build returns)."""
        if not self.errors:
            return
        callback, exc = self.errors[0]
        if isinstance(exc, (KeyboardInterrupt, DataError, ModelError)):
            raise exc
        raise ModelError(f"calibrator {callback}() failed: {type(exc).__name__}: {exc}") from exc

    def free(self) -> None:
        """Release the device buffers."""
        for device_buffer in self._buffers.values():
            device_buffer.free()
        self._buffers.clear()

    # ------------------------------------------------------------------ internals

    def _is_short_remainder(self, batch: Mapping[str, np.ndarray]) -> bool:
        """A last batch smaller than OPT (the loader's remainder) is skipped; any other mismatch is an error."""
        for name, want in self.opt_shapes.items():
            if name not in batch:
                raise DataError(f"calibration batch lacks input {name!r} (has {sorted(batch)})")
            got = tuple(np.shape(batch[name]))
            if got == want:
                continue
            if len(got) == len(want) and got[1:] == want[1:] and got[0] < want[0]:
                return True
            raise DataError(f"calibration batch for {name!r} has shape {list(got)}; TensorRT calibrates at the "
                            f"profile's OPT shape {list(want)} exactly")
        return False

    def _upload(self, name: str, batch: Mapping[str, np.ndarray]) -> int:
        array = np.ascontiguousarray(batch[name])
        device_buffer = self._buffers.get(name)
        if device_buffer is None:
            device_buffer = self.cuda.mem_alloc(array.nbytes)
            self._buffers[name] = device_buffer
        self.cuda.memcpy_htod(device_buffer, array)
        return int(device_buffer)


@functools.lru_cache(maxsize=None)
def _calibrator_class(trt: Any) -> type:
    base = trt.IInt8EntropyCalibrator2

    class QuantkitEntropyCalibrator(base):
        """Forwards TensorRT's callbacks to a :class:`CalibrationFeeder`."""

        def __init__(self, feeder: CalibrationFeeder):
            # pybind11 trampoline classes need the base initialiser called explicitly
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.feeder = feeder

        def get_batch_size(self) -> int:
            return self.feeder.guarded("get_batch_size", lambda: self.feeder.batch_size, 1)

        def get_batch(self, names):
            return self.feeder.guarded("get_batch", lambda: self.feeder.next_batch(list(names)), None)

        def read_calibration_cache(self):
            return self.feeder.guarded("read_calibration_cache", self.feeder.read_cache, None)

        def write_calibration_cache(self, cache) -> None:
            # copy now: the buffer belongs to TensorRT and is gone after the call
            self.feeder.guarded("write_calibration_cache", lambda: self.feeder.write_cache(bytes(cache)), None)

    return QuantkitEntropyCalibrator


def make_entropy_calibrator(trt: Any, feeder: CalibrationFeeder) -> Any:
    """A ``trt.IInt8EntropyCalibrator2`` that forwards to ``feeder``."""
    return _calibrator_class(trt)(feeder)
