"""The ONNX Runtime CPU flavour (``model.int8.onnx``): what runs fastest in ORT on x86.

uint8 asymmetric activations, int8 symmetric per-channel weights, int32 biases, Q/DQ around
every quantized op so ORT fuses DQ -> op -> Q into QLinearConv / QGemm / QLinearMatMul /
QLinearAdd / QLinearMul / QLinearGlobalAveragePool. ORT's own quantizer places the pairs
(:mod:`quantkit.qdq.ortquant`); two small post-passes follow:

* :func:`lower_hardswish` -- ORT has no integer HardSwish, so DQ -> HardSwish -> Q would stay
  three float passes over the tensor. It becomes ``x * hardsigmoid(x)`` with the hard-sigmoid
  done as a 256-entry lookup table (a saturating requantization that ORT runs as
  QLinearLeakyRelu with alpha 1) and the product as QLinearMul: two uint8 passes.
* :func:`float_outputs` -- a Gemm/MatMul output that is a graph output or only read by float
  nodes keeps float precision: ORT fuses DQ -> Gemm/MatMul without an output Q just as well.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantkit.qdq import TensorRange, ortquant
from quantkit.qdq.graph import (DEQUANTIZE, QUANTIZE, consumers, float_inputs_for, producers, remove_unused,
                                shield_float_nodes)
from quantkit.qdq.placement import CPU, GraphInfo

# hard-sigmoid(x) = clip(x / 6 + 0.5, 0, 1). Quantizing x with scale 6/256 and zero point 128
# gives q = clamp(round(x * 256/6) + 128, 0, 255), and q / 256 = x / 6 + 0.5 wherever it is not
# clamped: the clamp *is* the clip. Exact 0 for x <= -3 and 0.5 at 0; at most 1/512 off in
# between, 1/256 low (0.996) for x >= 3.
_HSIG_IN_SCALE = 6.0 / 256.0
_HSIG_IN_ZERO = 128
_HSIG_OUT_SCALE = 1.0 / 256.0
_HSIG_OUT_ZERO = 0
_HSIG_NAMES = ("quantkit_hsig_in_scale", "quantkit_hsig_in_zero", "quantkit_hsig_out_scale", "quantkit_hsig_out_zero")


def write_cpu_qdq(model: onnx.ModelProto, ranges: Mapping[str, TensorRange], nodes: Sequence[str],
                  float_nodes: Iterable[str] = ()) -> onnx.ModelProto:
    """The CPU flavour of ``model``.

    Args:
        model: the FP32 model (not modified).
        ranges: calibrated ranges; every tensor ORT asks for must be present.
        nodes: the nodes to quantize (placement already applied: exclusions, automatic fallbacks).
        float_nodes: nodes kept in float on purpose; they read float tensors where that costs
            no fusion (see :func:`quantkit.qdq.graph.float_inputs_for`).

    Returns:
        The Q/DQ model.
    """
    float_nodes = list(float_nodes)
    bounds = {name: r.cpu_bounds() for name, r in ranges.items()}
    quantized = ortquant.quantize(model, nodes, bounds, CPU)
    float_inputs_for(quantized, float_nodes)
    shield_float_nodes(quantized, float_nodes, _channels(model))
    float_outputs(quantized, nodes)
    lower_hardswish(quantized, skip=float_nodes)
    remove_unused(quantized)
    return quantized


def _channels(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor -> static size of axis 1 (the channel axis of NCHW activations), where known."""
    info = GraphInfo(model)
    result = {}
    for node in info.nodes:
        for name in node.output:
            shape = info.shape(name)
            if shape and len(shape) >= 2 and isinstance(shape[1], int):
                result[name] = shape[1]
    for name in info.graph_inputs:
        shape = info.shape(name)
        if shape and len(shape) >= 2 and isinstance(shape[1], int):
            result[name] = shape[1]
    return result


def lower_hardswish(model: onnx.ModelProto, skip: Iterable[str] = ()) -> int:
    """Rewrite each ``DQ -> HardSwish -> Q`` as ``DQ -> [LUT hard-sigmoid] -> Mul -> Q`` (in place).

    Only HardSwish nodes fully inside a quantized region (input from a DQ, output read by exactly
    one Q and not a graph output) and not in ``skip`` (kept in float on purpose) are touched.
    Returns how many were lowered.
    """
    skip = set(skip)
    graph = model.graph
    produced_by = producers(model)
    read_by = consumers(model)
    outputs = {vi.name for vi in graph.output}
    rewritten: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "HardSwish" or node.domain not in ("", "ai.onnx") or node.name in skip:
            continue
        source = produced_by.get(node.input[0])
        readers = read_by.get(node.output[0], [])
        if source is None or source.op_type != DEQUANTIZE or node.output[0] in outputs:
            continue
        if len(readers) != 1 or readers[0].op_type != QUANTIZE:
            continue
        rewritten[node.name or node.output[0]] = _lowered(node)
    if not rewritten:
        return 0
    new_nodes = []
    for node in graph.node:
        new_nodes.extend(rewritten.get(node.name or node.output[0], [node]) if node.op_type == "HardSwish"
                         else [node])
    del graph.node[:]
    graph.node.extend(new_nodes)
    _add_hsig_constants(graph)
    return len(rewritten)


def _lowered(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    x, y = node.input[0], node.output[0]
    base = node.name or y
    in_scale, in_zero, out_scale, out_zero = _HSIG_NAMES
    return [
        # identity on float: with DQ before and Q after, ORT fuses it into a QLinearLeakyRelu lookup table
        helper.make_node("LeakyRelu", [x], [f"{base}/hsig_pre"], name=f"{base}/hsig_lut", alpha=1.0),
        helper.make_node(QUANTIZE, [f"{base}/hsig_pre", in_scale, in_zero], [f"{base}/hsig_q"], name=f"{base}/hsig_q"),
        helper.make_node(DEQUANTIZE, [f"{base}/hsig_q", out_scale, out_zero], [f"{base}/hsig"],
                         name=f"{base}/hsig_dq"),
        helper.make_node("Mul", [x, f"{base}/hsig"], [y], name=f"{base}/mul"),
    ]


def _add_hsig_constants(graph: onnx.GraphProto) -> None:
    existing = {init.name for init in graph.initializer}
    values = (np.array(_HSIG_IN_SCALE, np.float32), np.array(_HSIG_IN_ZERO, np.uint8),
              np.array(_HSIG_OUT_SCALE, np.float32), np.array(_HSIG_OUT_ZERO, np.uint8))
    for name, value in zip(_HSIG_NAMES, values):
        if name not in existing:
            graph.initializer.append(numpy_helper.from_array(value, name))


def float_outputs(model: onnx.ModelProto, quantized: Iterable[str]) -> int:
    """Remove the Q -> DQ pair ORT puts after a Gemm/MatMul whose output no quantized node reads (in place).

    A graph output, or a tensor read only by float nodes (an excluded head), keeps float precision:
    ORT fuses DQ -> Gemm/MatMul without an output Q just as well (QGemm / MatMulIntegerToFloat
    with float output). Returns how many pairs were removed.
    """
    graph = model.graph
    quantized = set(quantized)
    produced_by = producers(model)
    read_by = consumers(model)
    outputs = {vi.name for vi in graph.output}
    done = 0
    for q in [node for node in graph.node if node.op_type == QUANTIZE]:
        source = produced_by.get(q.input[0])
        if source is None or source.op_type not in ("Gemm", "MatMul") or len(read_by.get(q.input[0], [])) != 1:
            continue
        dqs = read_by.get(q.output[0], [])
        if not dqs or any(dq.op_type != DEQUANTIZE for dq in dqs):
            continue
        readers = [user for dq in dqs for user in read_by.get(dq.output[0], [])]
        if any(user.name in quantized for user in readers):
            continue
        # the producer writes the tensor its readers (or the graph output) expect
        targets = {dq.output[0] for dq in dqs}
        target = next((name for name in targets if name in outputs), None) or q.input[0]
        source.output[list(source.output).index(q.input[0])] = target
        for user in readers:
            for index, name in enumerate(user.input):
                if name in targets:
                    user.input[index] = target
        graph.node.remove(q)
        for dq in dqs:
            graph.node.remove(dq)
        done += 1
    return done
