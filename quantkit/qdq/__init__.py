"""Q/DQ models from our calibration: placement, the CPU flavour, the TensorRT flavour and its checker.

* :mod:`quantkit.qdq.placement` -- which nodes each flavour quantizes, which tensors need a range,
  how ``--exclude`` patterns resolve.
* :mod:`quantkit.qdq.ortquant` -- the one place that drives ONNX Runtime's ``QDQQuantizer``.
* :mod:`quantkit.qdq.cpu` -- the ONNX Runtime CPU flavour (uint8 activations, int8 per-channel weights).
* :mod:`quantkit.qdq.trt` -- the TensorRT-11 flavour (symmetric int8, no output Q).
* :mod:`quantkit.qdq.trt_check` -- :func:`check_trt_qdq`, the rules TensorRT's ONNX parser enforces.

This module itself only knows calibration ranges, so importing it is cheap (no onnx).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import MissingArtifactError, StaleArtifactError


@dataclass(frozen=True)
class TensorRange:
    """The calibrated range of one tensor.

    Attributes:
        amax: the clipping threshold the calibration method chose (>= 0).
        min: the smallest value seen during calibration.
        max: the largest value seen during calibration.
        clipped_fraction: the fraction of calibration values beyond ``amax`` (0 when unknown).
    """

    amax: float
    min: float
    max: float
    clipped_fraction: float = 0.0

    def cpu_bounds(self) -> tuple[float, float]:
        """Asymmetric range for uint8 activations: the observed range clipped to ±amax, always holding 0.

        Zero must be exactly representable (padding, ReLU), and clipping to amax keeps what the
        calibration method decided to clip (outliers) out of the uint8 grid.
        """
        low = min(max(self.min, -self.amax), 0.0)
        high = max(min(self.max, self.amax), 0.0)
        return low, high

    def trt_bounds(self) -> tuple[float, float]:
        """Symmetric range for int8 activations (scale = amax / 127, zero point 0)."""
        return -self.amax, self.amax

    @property
    def observed_amax(self) -> float:
        return max(abs(self.min), abs(self.max))


#: A calibrated amax that clips more than this fraction of the calibration values is not clipping
#: outliers: the method failed on that tensor (entropy on a tensor with no mass near zero, such as
#: a squeeze-excite gate in [0.1, 0.9], can put amax below the smallest value and clip everything).
MAX_CLIPPED_FRACTION = 0.01


def widen_overclipped(ranges: dict[str, TensorRange], limit: float = MAX_CLIPPED_FRACTION
                      ) -> tuple[dict[str, TensorRange], dict[str, TensorRange]]:
    """Replace ranges that clip more than ``limit`` of the values by the observed min/max.

    Returns:
        (the ranges to build with, name -> the original range for every tensor that was widened).
    """
    widened = {name: r for name, r in ranges.items() if r.clipped_fraction > limit}
    fixed = dict(ranges)
    for name, r in widened.items():
        fixed[name] = TensorRange(r.observed_amax, r.min, r.max, 0.0)
    return fixed, widened


def load_ranges(calib_json: str | Path) -> dict[str, TensorRange]:
    """Read the per-tensor ranges of a ``calib.json`` written by the calibration stage.

    Args:
        calib_json: the file; its ``tensors`` maps a tensor name to at least ``amax``, ``min`` and ``max``.

    Returns:
        Tensor name -> :class:`TensorRange`, in file order.

    Raises:
        MissingArtifactError: the file does not exist.
        StaleArtifactError: the file is not a readable calibration result (bad JSON, missing or
            non-finite fields, negative amax).
    """
    path = Path(calib_json)
    if not path.exists():
        raise MissingArtifactError(f"calibration not found: {path} does not exist",
                                   hint="run 'quantkit calibrate CONFIG' first")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        tensors = raw["tensors"]
        if not isinstance(tensors, dict):
            raise TypeError("'tensors' is not an object")
        ranges = {name: _parse_range(name, entry) for name, entry in tensors.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StaleArtifactError(f"{path}: not a readable calibration result ({exc})",
                                 hint="re-run 'quantkit calibrate CONFIG'") from None
    return ranges


def _parse_range(name: str, entry: dict) -> TensorRange:
    values = {key: float(entry[key]) for key in ("amax", "min", "max")}
    values["clipped_fraction"] = float(entry.get("clipped_fraction", 0.0))
    bad = [key for key, value in values.items() if not math.isfinite(value)]
    if bad:
        raise ValueError(f"tensor {name!r}: non-finite {', '.join(bad)}")
    if values["amax"] < 0:
        raise ValueError(f"tensor {name!r}: negative amax {values['amax']}")
    if values["min"] > values["max"]:
        raise ValueError(f"tensor {name!r}: min {values['min']} > max {values['max']}")
    return TensorRange(**values)
