"""The one place that drives ONNX Runtime's ``QDQQuantizer`` with our precomputed ranges.

Both flavours are ORT's own Q/DQ insertion (per-op rules in ``onnxruntime.quantization.operators``,
bias quantization, per-channel weights) fed with an explicit node list from
:mod:`quantkit.qdq.placement` and the ranges from ``calib.json`` -- no calibration runs here.
ORT's free-form ``extra_options`` keys are confined to :data:`FLAVOUR_SETTINGS`, so a typo in
one of them is caught by a test, not silently ignored.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np
import onnx

from quantkit.errors import ModelError
from quantkit.qdq.graph import topological_sort
from quantkit.qdq.placement import COMPUTE_OPS, CPU, TRT


@dataclass(frozen=True)
class FlavourSettings:
    """How ORT's quantizer is configured for one flavour.

    Attributes:
        activation_type: ``uint8`` (CPU: the fast U8S8 path on x86) or ``int8`` (TensorRT).
        symmetric_activations: zero point 0 and range ±amax (TensorRT) or asymmetric (CPU).
        extra_options: ORT ``extra_options`` keys, spelled once here.
    """

    activation_type: str
    symmetric_activations: bool
    extra_options: Mapping[str, object] = field(default_factory=dict)


FLAVOUR_SETTINGS: dict[str, FlavourSettings] = {
    CPU: FlavourSettings(
        activation_type="uint8",
        symmetric_activations=False,
        extra_options={
            "ActivationSymmetric": False,
            "WeightSymmetric": True,
            # MatMul weights [.., K, N]: the output channel is the last axis (ORT's default, 1, is
            # only right for 2-D weights).
            "QDQOpTypePerChannelSupportToAxis": {"MatMul": -1},
        },
    ),
    TRT: FlavourSettings(
        activation_type="int8",
        symmetric_activations=True,
        extra_options={
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            # TensorRT: no Q on the outputs of weighted ops (it fuses what follows itself) ...
            "OpTypesToExcludeOutputQuantization": list(COMPUTE_OPS) + ["Add"],
            # ... biases stay float ...
            "QuantizeBias": False,
            # ... and a tensor feeding several quantized nodes gets one Q/DQ pair per consumer.
            "DedicatedQDQPair": True,
            "QDQOpTypePerChannelSupportToAxis": {"MatMul": -1},
        },
    ),
}

#: The ``extra_options`` keys this module relies on (checked against ORT's docs by a test).
KNOWN_EXTRA_OPTIONS = frozenset({
    "ActivationSymmetric", "WeightSymmetric", "QDQOpTypePerChannelSupportToAxis",
    "OpTypesToExcludeOutputQuantization", "QuantizeBias", "DedicatedQDQPair",
})


def quantize(model: onnx.ModelProto, nodes: Sequence[str], ranges: Mapping[str, tuple[float, float]],
             flavour: str) -> onnx.ModelProto:
    """Insert Q/DQ around ``nodes`` with ORT's QDQ quantizer.

    Args:
        model: the FP32 model (not modified).
        nodes: the node names to quantize (from :func:`quantkit.qdq.placement.select_nodes`).
        ranges: tensor name -> (low, high) for every tensor that needs one
            (:func:`tensors_needing_ranges`); already flavour-specific (asymmetric or ±amax).
        flavour: ``cpu`` or ``trt``.

    Returns:
        A new model with Q/DQ nodes, int8 per-channel weights and (CPU) int32 biases.

    Raises:
        ModelError: ORT's quantizer refused the model.
    """
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    quantizer = _make_quantizer(model, nodes, flavour, TensorsData(CalibrationMethod.MinMax, {
        name: TensorData(lowest=np.float32(low), highest=np.float32(high)) for name, (low, high) in ranges.items()
    }))
    try:
        with _quiet_ort_logging():
            quantized = quantizer.quantize_model()
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        raise ModelError(f"ONNX Runtime's Q/DQ quantizer failed on this model ({flavour} flavour): {exc}") from None
    topological_sort(quantized)
    return quantized


def tensors_needing_ranges(model: onnx.ModelProto, nodes: Sequence[str], flavour: str) -> list[str]:
    """The activation tensors ORT's quantizer will ask a range for when it quantizes ``nodes``.

    A dry run of ORT's own per-op rules (the marking pass of ``QDQQuantizer.quantize_model``),
    so the answer is exactly what :func:`quantize` needs -- including the ReLU outputs whose range
    ORT gives to the producer when it folds the ReLU away. Tensors that share their input's scale
    (MaxPool, Reshape ...) need no range and are not listed.

    Returns:
        Tensor names (unordered beyond ORT's marking order).
    """
    from onnxruntime.quantization.registry import CreateQDQQuantizer

    try:
        quantizer = _make_quantizer(model, nodes, flavour, None)
        with _quiet_ort_logging():
            for node in quantizer.model.nodes():
                if quantizer.should_quantize_node(node):
                    CreateQDQQuantizer(quantizer, node).quantize()
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        raise ModelError(f"ONNX Runtime's Q/DQ quantizer cannot plan this model ({flavour} flavour): {exc}") from None
    initializers = {init.name for init in quantizer.model.initializer()}
    return [name for name, info in quantizer.tensors_to_quantize.items()
            if name not in initializers and not info.is_shared]


def _make_quantizer(model: onnx.ModelProto, nodes: Sequence[str], flavour: str, tensors_range):
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    settings = FLAVOUR_SETTINGS[flavour]
    by_name = {node.name: node for node in model.graph.node}
    op_types = sorted({by_name[name].op_type for name in nodes})
    activation = QuantType.QUInt8 if settings.activation_type == "uint8" else QuantType.QInt8
    with _quiet_ort_logging():
        return QDQQuantizer(
            copy.deepcopy(model),
            True,  # per_channel
            False,  # reduce_range: only for CPUs without VNNI
            QuantType.QInt8,  # weights
            activation,
            tensors_range,
            list(nodes),  # nodes_to_quantize: exactly our placement
            [],  # nodes_to_exclude: already applied by the placement
            op_types,
            copy.deepcopy(dict(settings.extra_options)),
        )


@contextlib.contextmanager
def _quiet_ort_logging() -> Iterator[None]:
    """ORT's quantizer logs through the root logger (shape-inference hints, pre-processing advice)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
