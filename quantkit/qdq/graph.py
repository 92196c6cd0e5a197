"""Small edits and questions on Q/DQ models shared by both flavours.

These run *after* ORT's quantizer; each is a few lines over producers/consumers, not a rewriter.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx
from onnx import numpy_helper

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output if out}


def consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    result: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name:
                result.setdefault(name, []).append(node)
    return result


def with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs the tensors ``names`` (for probing intermediate values)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {vi.name for vi in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
            existing.add(name)
    return probe


def constant_value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """The value of an initializer or Constant-node output, else None."""
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
    return None


def quantized_nodes(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes that read at least one input through a DequantizeLinear."""
    produced_by = producers(model)
    result = set()
    for node in model.graph.node:
        if node.op_type in (QUANTIZE, DEQUANTIZE):
            continue
        if any(name and name in produced_by and produced_by[name].op_type == DEQUANTIZE for name in node.input):
            result.add(node.name)
    return result


def float_inputs_for(model: onnx.ModelProto, node_names: Iterable[str], keep_fusion: bool = True) -> int:
    """Make the given (unquantized) nodes read float tensors instead of a shared DQ output.

    ORT's quantizer puts one Q -> DQ pair on a tensor and points *every* consumer at the DQ, so
    an excluded node next to a quantized one would still read fake-quantized values. Where the
    tensor's producer is itself float (or a graph input), the node is pointed back at the original
    tensor; where the producer is quantized, it keeps the DQ output -- pointing it at the raw output
    would break the producer's DQ -> op -> Q fusion. With ``keep_fusion=False`` (the TensorRT
    flavour: no output Q to fuse, and a Q/DQ read by a float node breaks its rules) every such
    input reads the float tensor.

    Returns:
        How many inputs were rewired. Edits ``model`` in place.
    """
    wanted = set(node_names)
    produced_by = producers(model)
    quantized = quantized_nodes(model)
    rewired = 0
    for node in model.graph.node:
        if node.name not in wanted:
            continue
        for index, name in enumerate(node.input):
            dq = produced_by.get(name)
            if dq is None or dq.op_type != DEQUANTIZE:
                continue
            q = produced_by.get(dq.input[0])
            if q is None or q.op_type != QUANTIZE:
                continue  # a weight DQ (int8 initializer): leave it to the owner of the weight
            source = q.input[0]
            source_producer = produced_by.get(source)
            if keep_fusion and source_producer is not None and source_producer.name in quantized:
                continue
            node.input[index] = source
            rewired += 1
    return rewired


def remove_unused(model: onnx.ModelProto) -> None:
    """Drop nodes whose outputs nobody reads and initializers nobody uses (in place)."""
    graph = model.graph
    outputs = {vi.name for vi in graph.output} | _names_used_in_subgraphs(graph)
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        dead = [node for node in graph.node if node.output and not any(out in used for out in node.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in node.input} | outputs
    keep = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def _names_used_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Outer-scope names read inside If/Loop/Scan bodies (they look unused from the outside)."""
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            bodies = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for body in bodies:
                names |= {name for inner in body.node for name in inner.input}
                names |= _names_used_in_subgraphs(body)
    return names


def topological_sort(model: onnx.ModelProto) -> None:
    """Order the nodes so every input is produced before it is read (in place, stable).

    ORT's quantizer appends its Q/DQ nodes at the end; ORT does not mind, but the ONNX checker
    and TensorRT's parser need a sorted graph.
    """
    graph = model.graph
    available = {vi.name for vi in graph.input} | {init.name for init in graph.initializer} | {""}
    available |= _names_used_in_subgraphs(graph) - {out for node in graph.node for out in node.output}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        remaining = []
        progressed = False
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
                progressed = True
            else:
                remaining.append(node)
        if not progressed:  # a cycle or a dangling input: keep the rest as it was, let the checker tell
            ordered.extend(remaining)
            break
        pending = remaining
    del graph.node[:]
    graph.node.extend(ordered)


#: Float nodes of these types get a per-channel copy of a shared per-tensor DQ (see shield_float_nodes).
SHIELDED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
#: Ops ORT fuses with DQ/Q into per-tensor integer kernels (QLinearAdd, QLinearGlobalAveragePool, ...).
PER_TENSOR_QLINEAR_OPS = ("Add", "Mul", "GlobalAveragePool", "AveragePool", "LeakyRelu", "Sigmoid", "Softmax",
                          "Concat", "Where")


def shield_float_nodes(model: onnx.ModelProto, node_names: Iterable[str], channels: dict[str, int]) -> int:
    """Stop ONNX Runtime from quietly running float nodes in INT8 (CPU flavour; in place).

    At session time ORT fuses any ``DQ -> op -> Q`` it recognises, and its WeightBiasQuantization
    pass gives a Conv/Gemm that reads a per-tensor DQ per-tensor int8 weights -- even when that node
    was excluded on purpose. Both only match per-tensor DQs, so each float node that still reads a
    shared activation DQ (its producer is INT8) gets its own DQ with the same scale repeated per
    channel (axis 1): the same values, a pattern ORT leaves alone. Where the channel count is
    unknown or 1, the node is pointed at the float tensor instead (the producer then loses its
    output fusion).

    Only ops ORT would turn into integer kernels are touched. Conv/Gemm/MatMul get the per-channel
    DQ (ORT checks their activation DQ is per-tensor). ORT's per-tensor QLinear kernels for the
    other ops (:data:`PER_TENSOR_QLINEAR_OPS`) do *not* check when fusing and fail at session
    start on a per-channel scale, so those read the float tensor. Ops ORT never fuses (HardSwish,
    HardSigmoid, ...) or only drops exactly (Relu, MaxPool, Reshape, ...) keep the shared DQ.

    Args:
        model: the Q/DQ model.
        node_names: the nodes that must stay float.
        channels: tensor name (as in the FP32 model) -> size of axis 1.

    Returns:
        How many inputs were shielded or rewired.
    """
    wanted = set(node_names)
    produced_by = producers(model)
    changed = 0
    new_nodes: list[tuple[int, onnx.NodeProto]] = []
    for position, node in enumerate(model.graph.node):
        if node.name not in wanted or node.op_type not in SHIELDED_OPS + PER_TENSOR_QLINEAR_OPS:
            continue
        for index, name in enumerate(node.input):
            dq = produced_by.get(name)
            if dq is None or dq.op_type != DEQUANTIZE or len(dq.input) < 3:
                continue
            q = produced_by.get(dq.input[0])
            scale = constant_value(model, dq.input[1])
            zero = constant_value(model, dq.input[2])
            if q is None or q.op_type != QUANTIZE or scale is None or zero is None or scale.size != 1:
                continue
            count = channels.get(q.input[0], 0) if node.op_type in SHIELDED_OPS else 0
            changed += 1
            if count <= 1:
                node.input[index] = q.input[0]
                continue
            suffix = f"per_channel_{count}"
            scale_name, zero_name = f"{dq.input[1]}_{suffix}", f"{dq.input[2]}_{suffix}"
            existing = {init.name for init in model.graph.initializer}
            if scale_name not in existing:
                model.graph.initializer.append(numpy_helper.from_array(np.full(count, scale.item(), scale.dtype),
                                                                       scale_name))
            if zero_name not in existing:
                model.graph.initializer.append(numpy_helper.from_array(np.full(count, zero.item(), zero.dtype),
                                                                       zero_name))
            output = f"{node.name}/float_input_{index}"
            shield = onnx.helper.make_node(DEQUANTIZE, [dq.input[0], scale_name, zero_name], [output],
                                           name=f"{node.name}/float_input_{index}_dq", axis=1)
            new_nodes.append((position, shield))
            node.input[index] = output
    for offset, (position, shield) in enumerate(new_nodes):
        model.graph.node.insert(position + offset, shield)
    return changed
