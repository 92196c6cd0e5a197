"""The TensorRT-11 flavour (``model.qdq.onnx``): explicit quantization as TensorRT's ONNX parser wants it.

Symmetric int8 everywhere (scale = amax / 127, zero point 0), per-tensor activations,
per-channel weights on the output-channel axis with ``axis`` written, float biases, Q/DQ only on
the inputs of Conv/ConvTranspose/Gemm/MatMul and residual Adds -- never on their outputs.
ORT's quantizer writes it (:mod:`quantkit.qdq.ortquant`), :func:`quantkit.qdq.trt_check.check_trt_qdq`
verifies it, and it still runs in ONNX Runtime (unfused, so slowly) for accuracy checks.

Excluded nodes carry no Q/DQ and are *marked for FP16*: their names are listed, as a JSON array,
in the model's ``metadata_props`` under :data:`FP16_METADATA_KEY` (and in ``build.json``). A custom
node attribute would make the model invalid ONNX; the TensorRT build turns the list into Casts.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping, Sequence

import onnx

from quantkit.qdq import TensorRange, ortquant
from quantkit.qdq.graph import float_inputs_for, remove_unused
from quantkit.qdq.placement import TRT

FP16_METADATA_KEY = "quantkit.fp16_nodes"


def write_trt_qdq(model: onnx.ModelProto, ranges: Mapping[str, TensorRange], nodes: Sequence[str],
                  fp16_nodes: Iterable[str] = ()) -> onnx.ModelProto:
    """The TensorRT flavour of ``model``.

    Args:
        model: the FP32 model (not modified).
        ranges: calibrated ranges; only ``amax`` is used.
        nodes: the nodes to quantize (placement already applied).
        fp16_nodes: excluded nodes, to be built in FP16 by TensorRT.

    Returns:
        The Q/DQ model with the FP16 list in its metadata.
    """
    bounds = {name: r.trt_bounds() for name, r in ranges.items()}
    quantized = ortquant.quantize(model, nodes, bounds, TRT)
    fp16 = list(dict.fromkeys(fp16_nodes))
    float_inputs_for(quantized, fp16, keep_fusion=False)
    remove_unused(quantized)
    set_fp16_nodes(quantized, fp16)
    return quantized


def set_fp16_nodes(model: onnx.ModelProto, names: Sequence[str]) -> None:
    """Record the nodes TensorRT should build in FP16 (replaces an earlier list)."""
    kept = [prop for prop in model.metadata_props if prop.key != FP16_METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    entry = model.metadata_props.add()
    entry.key = FP16_METADATA_KEY
    entry.value = json.dumps(list(names))


def fp16_nodes(model: onnx.ModelProto) -> list[str]:
    """The FP16 list written by :func:`set_fp16_nodes` (empty when absent)."""
    for prop in model.metadata_props:
        if prop.key == FP16_METADATA_KEY:
            return list(json.loads(prop.value))
    return []
