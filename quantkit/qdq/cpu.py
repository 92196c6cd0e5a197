"""The ONNX Runtime CPU flavour (``model.int8.onnx``): what runs fastest in ORT on x86.

uint8 asymmetric activations, int8 symmetric per-channel weights, int32 biases, Q/DQ around
every quantized op so ORT fuses DQ -> op -> Q into QLinearConv / QGemm / QLinearMatMul /
QLinearAdd / QLinearMul / QLinearGlobalAveragePool. ORT's own quantizer places the pairs
(:mod:`quantkit.qdq.ortquant`); small post-passes follow:

* :func:`lower_hardswish` -- ORT has no integer HardSwish, so DQ -> HardSwish -> Q would stay
  three float passes over the tensor. It becomes ``x * hardsigmoid(x)``: the hard-sigmoid is a
  *saturating requantization* of x (scale 6/256, zero point 128), which ORT runs as a QLinearAdd
  of x and a constant 0, and the product a QLinearMul: two uint8 passes.
* :func:`fold_hardsigmoid` -- the same requantization replaces ``DQ -> HardSigmoid -> Q`` after a
  quantized producer (the squeeze-excite gate): the producer writes the gate directly, three
  float kernels per gate are gone.
* :func:`float_outputs` -- a Gemm/MatMul output that is a graph output or only read by float
  nodes keeps float precision: ORT fuses DQ -> Gemm/MatMul without an output Q just as well.

Ranges: a tensor read only by quantized HardSwish nodes starts at -3 at the lowest
(:func:`hardswish_aware_bounds`): HardSwish is 0 below -3, so what lies there needs no grid.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantkit.qdq import TensorRange, ortquant
from quantkit.qdq.channels import pad_depthwise_channels
from quantkit.qdq.graph import (DEQUANTIZE, QUANTIZE, consumers, float_inputs_for, producers, remove_unused,
                                shield_float_nodes)
from quantkit.qdq.placement import CPU, GraphInfo

# hard-sigmoid(x) = clip(x / 6 + 0.5, 0, 1). Quantizing x with scale 6/256 and zero point 128
# gives q = clamp(round(x * 256/6) + 128, 0, 255), and q / 256 = x / 6 + 0.5 wherever it is not
# clamped: the clamp *is* the clip. Exact 0 for x <= -3 and 0.5 at 0; at most 1/512 off in
# between, 1/256 low (0.996) for x >= 3. For HardSigmoid(alpha, beta) the scale is 1/(256 alpha)
# and the zero point 256 beta.
_HSIG_OUT_SCALE = 1.0 / 256.0
_HSIG_OUT_ZERO = 0
_HSIG_OUT_NAMES = ("quantkit_hsig_out_scale", "quantkit_hsig_out_zero")
_HSWISH = (1.0 / 6.0, 0.5)  # HardSwish(x) = x * HardSigmoid(x; alpha=1/6, beta=0.5)
#: HardSwish is exactly 0 at and below this input, so a grid for its input need not reach further.
HARDSWISH_FLOOR = -3.0
# The constant 0 the requantizing Add adds (uint8 0 with scale 1 and zero point 0, dequantized once).
_ZERO_NAMES = ("quantkit_zero_u8", "quantkit_one", "quantkit_zero")


def write_cpu_qdq(model: onnx.ModelProto, ranges: Mapping[str, TensorRange], nodes: Sequence[str],
                  float_nodes: Iterable[str] = (), pad_channels: bool = True) -> onnx.ModelProto:
    """The CPU flavour of ``model``.

    Args:
        model: the FP32 model (not modified).
        ranges: calibrated ranges; every tensor ORT asks for must be present.
        nodes: the nodes to quantize (placement already applied: exclusions, automatic fallbacks).
        float_nodes: nodes kept in float on purpose; they read float tensors where that costs
            no fusion (see :func:`quantkit.qdq.graph.float_inputs_for`), and are never lowered or folded.
        pad_channels: pad depthwise channel counts to a multiple of 16 where that is exact
            (:mod:`quantkit.qdq.channels`); False keeps every tensor's FP32 shape (probes that compare
            intermediate tensors with FP32).

    Returns:
        The Q/DQ model.
    """
    float_nodes = list(float_nodes)
    if pad_channels:
        model, _ = pad_depthwise_channels(model)
    bounds = hardswish_aware_bounds(model, {name: r.cpu_bounds() for name, r in ranges.items()}, nodes)
    quantized = ortquant.quantize(model, nodes, bounds, CPU)
    float_inputs_for(quantized, float_nodes)
    shield_float_nodes(quantized, float_nodes, _channels(model))
    float_outputs(quantized, nodes)
    lower_hardswish(quantized, skip=float_nodes)
    fold_hardsigmoid(quantized, skip=float_nodes)
    remove_unused(quantized)
    return quantized


def hardswish_aware_bounds(model: onnx.ModelProto, bounds: Mapping[str, tuple[float, float]],
                           nodes: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Raise the low end of tensors read only by quantized HardSwish nodes to :data:`HARDSWISH_FLOOR`.

    HardSwish(x) = 0 for every x <= -3, so uint8 steps spent below -3 buy nothing: the lowered
    HardSwish (:func:`lower_hardswish`) of a value clamped to -3 is the same 0. On MobileNetV3 the
    depthwise outputs span about [-9, 9]; starting at -3 makes their step a third smaller.
    """
    quantized = set(nodes)
    readers = consumers(model)
    result = dict(bounds)
    for name, (low, high) in bounds.items():
        users = readers.get(name, [])
        if low < HARDSWISH_FLOOR < high and users and all(
                u.op_type == "HardSwish" and u.name in quantized for u in users):
            result[name] = (HARDSWISH_FLOOR, high)
    return result


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
    """Rewrite each ``DQ -> HardSwish -> Q`` as ``DQ -> [requantize: hard-sigmoid] -> Mul -> Q`` (in place).

    The hard-sigmoid is ``Add(x, 0) -> Q(6/256, 128) -> DQ(1/256, 0)``: ORT fuses the Add into a
    QLinearAdd with a constant, a vectorised pass (about 4x faster than the 256-entry lookup
    table ORT would build for QLinearLeakyRelu), and the product into QLinearMul.

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
        rewritten[node.name or node.output[0]] = _lowered(graph, node)
    if not rewritten:
        return 0
    new_nodes = []
    for node in graph.node:
        new_nodes.extend(rewritten.get(node.name or node.output[0], [node]) if node.op_type == "HardSwish"
                         else [node])
    del graph.node[:]
    graph.node.extend(new_nodes)
    _add_zero(graph)
    return len(rewritten)


def _lowered(graph: onnx.GraphProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    x, y = node.input[0], node.output[0]
    base = node.name or y
    scale, zero = _requant_constants(graph, *_HSWISH)
    out_scale, out_zero = _hsig_out_constants(graph)
    return [
        # adds 0: with DQ before and Q after, ORT fuses it into a QLinearAdd -- a pure requantization
        helper.make_node("Add", [x, _ZERO_NAMES[2]], [f"{base}/hsig_pre"], name=f"{base}/hsig_requant"),
        helper.make_node(QUANTIZE, [f"{base}/hsig_pre", scale, zero], [f"{base}/hsig_q"], name=f"{base}/hsig_q"),
        helper.make_node(DEQUANTIZE, [f"{base}/hsig_q", out_scale, out_zero], [f"{base}/hsig"],
                         name=f"{base}/hsig_dq"),
        helper.make_node("Mul", [x, f"{base}/hsig"], [y], name=f"{base}/mul"),
    ]


def fold_hardsigmoid(model: onnx.ModelProto, skip: Iterable[str] = ()) -> int:
    """Fold each ``Q -> DQ -> HardSigmoid -> Q -> DQ`` into ``Q(hard-sigmoid grid) -> DQ(1/256, 0)`` (in place).

    ORT has no integer HardSigmoid, so the squeeze-excite gate after a quantized Conv ran as three
    float kernels (DQ, HardSigmoid, Q). Quantizing the producer's output with scale 1/(256 alpha)
    and zero point 256 beta *is* HardSigmoid(alpha, beta) on the uint8 grid (the clamp to [0, 255]
    is the clip to [0, 1]), read back with scale 1/256: the fused producer (QLinearConv, QGemm ...)
    writes the gate itself. Only where the producer's Q feeds nothing but this HardSigmoid, the
    HardSigmoid's output only Q -> DQ pairs, 256 beta is a whole number in [0, 255] and alpha > 0;
    nodes in ``skip`` stay float. Returns how many were folded.
    """
    skip = set(skip)
    graph = model.graph
    produced_by = producers(model)
    read_by = consumers(model)
    outputs = {vi.name for vi in graph.output}
    folded = 0
    for node in [n for n in graph.node if n.op_type == "HardSigmoid" and n.domain in ("", "ai.onnx")]:
        alpha, beta = _attribute(node, "alpha", 0.2), _attribute(node, "beta", 0.5)
        if node.name in skip or alpha <= 0 or not _whole_in_uint8(256 * beta) or node.output[0] in outputs:
            continue
        dq = produced_by.get(node.input[0])
        q = produced_by.get(dq.input[0]) if dq is not None and dq.op_type == DEQUANTIZE else None
        if q is None or q.op_type != QUANTIZE or len(read_by.get(q.output[0], [])) != 1 \
                or len(read_by.get(dq.output[0], [])) != 1 or dq.output[0] in outputs:
            continue
        gate_qs = read_by.get(node.output[0], [])
        if len(gate_qs) != 1 or gate_qs[0].op_type != QUANTIZE or gate_qs[0].output[0] in outputs:
            continue
        gate_dqs = read_by.get(gate_qs[0].output[0], [])
        if not gate_dqs or any(user.op_type != DEQUANTIZE for user in gate_dqs):
            continue
        q.input[1], q.input[2] = _requant_constants(graph, alpha, beta)
        out_scale, out_zero = _hsig_out_constants(graph)
        # one DQ reads the gate back under the HardSigmoid's own output name, so the tensor keeps
        # its FP32 name (the sensitivity probe compares by name)
        gate = node.output[0]
        position = list(graph.node).index(node)
        graph.node.insert(position, helper.make_node(DEQUANTIZE, [q.output[0], out_scale, out_zero], [gate],
                                                     name=f"{node.name}/requantized"))
        for user in read_by.get(gate_qs[0].output[0], []):
            for reader in read_by.get(user.output[0], []):
                for index, name in enumerate(reader.input):
                    if name == user.output[0]:
                        reader.input[index] = gate
        for dead in [dq, node, gate_qs[0]] + gate_dqs:
            graph.node.remove(dead)
        folded += 1
    return folded


def _attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    return next((attr.f for attr in node.attribute if attr.name == name), default)


def _whole_in_uint8(value: float) -> bool:
    return abs(value - round(value)) < 1e-6 and 0 <= round(value) <= 255


def _requant_constants(graph: onnx.GraphProto, alpha: float, beta: float) -> tuple[str, str]:
    """(scale, zero point) initializers that turn a quantization into HardSigmoid(alpha, beta)."""
    zero = int(round(256 * beta))
    scale_name, zero_name = f"quantkit_hsig_scale_{alpha:.9g}", f"quantkit_hsig_zero_{zero}"
    _add_constant(graph, scale_name, np.array(1.0 / (256.0 * alpha), np.float32))
    _add_constant(graph, zero_name, np.array(zero, np.uint8))
    return scale_name, zero_name


def _hsig_out_constants(graph: onnx.GraphProto) -> tuple[str, str]:
    scale_name, zero_name = _HSIG_OUT_NAMES
    _add_constant(graph, scale_name, np.array(_HSIG_OUT_SCALE, np.float32))
    _add_constant(graph, zero_name, np.array(_HSIG_OUT_ZERO, np.uint8))
    return scale_name, zero_name


def _add_zero(graph: onnx.GraphProto) -> None:
    """The float 0 the requantizing Adds read, as the DQ of a uint8 constant (ORT's QDQ Add wants DQ inputs)."""
    zero_u8, one, zero = _ZERO_NAMES
    if any(node.output and node.output[0] == zero for node in graph.node):
        return
    _add_constant(graph, zero_u8, np.array(0, np.uint8))
    _add_constant(graph, one, np.array(1.0, np.float32))
    graph.node.insert(0, helper.make_node(DEQUANTIZE, [zero_u8, one, zero_u8], [zero], name=f"{zero}_dq"))


def _add_constant(graph: onnx.GraphProto, name: str, value: np.ndarray) -> None:
    if not any(init.name == name for init in graph.initializer):
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
