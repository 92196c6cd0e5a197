"""Backend-independent calibration math (pure numpy).

* :mod:`quantkit.calib.histogram` -- streaming per-tensor statistics (:class:`TensorStats`).
* :mod:`quantkit.calib.methods` -- range methods (entropy, minmax, percentile, mse) -> amax.
* :mod:`quantkit.calib.cache` -- the TensorRT calibration cache text format.

Nothing here imports torch, onnx or TensorRT, so the math can be tested and reused by every backend.
"""
