"""The Q/DQ rules TensorRT's ONNX parser and builder enforce, checked on an ONNX model.

Sources: the TensorRT ONNX importer (QuantizeLinear/DequantizeLinear) and ``IQuantizeLayer`` docs,
summarised in ``shared/docs/tensorrt-and-calibration.md`` section 4:

1. symmetric int8 only: every zero point is a constant int8 tensor of zeros; no UINT8 anywhere;
2. scales are constant, finite and > 0;
3. activations per-tensor;
4. weights per-channel on the output-channel axis (Conv 0, ConvTranspose 1, Gemm 0 if transB
   else 1, MatMul last), with ``axis`` always written (the parser assumes 0, ONNX's default is 1);
5. biases stay float;
6. no Q on the outputs of Conv/ConvTranspose/Gemm/MatMul unless the DQ feeds another quantized op;
7. residual Adds have both inputs quantized (so TensorRT fuses Conv + Add);
8. a weighted op has both its activation and its weight quantized, or neither.

Nodes listed as FP16 in the model metadata (:mod:`quantkit.qdq.trt`) are exempt from 7 and 8.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from quantkit.qdq.graph import DEQUANTIZE, QUANTIZE, consumers, constant_value, producers
from quantkit.qdq.placement import COMPUTE_OPS, GraphInfo, _is_residual_add
from quantkit.qdq.trt import fp16_nodes


def check_trt_qdq(model: onnx.ModelProto) -> list[str]:
    """Check a TensorRT-flavour Q/DQ model.

    Args:
        model: the model (e.g. ``model.qdq.onnx``).

    Returns:
        One message per problem, naming the node; empty when the model follows every rule.
    """
    checker = _Checker(model)
    return checker.run()


class _Checker:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.nodes = list(model.graph.node)
        self.produced_by = producers(model)
        self.read_by = consumers(model)
        self.initializers = {init.name: init for init in model.graph.initializer}
        self.fp16 = set(fp16_nodes(model))
        self.problems: list[str] = []

    def run(self) -> list[str]:
        self._no_uint8()
        for node in self.nodes:
            if node.op_type in (QUANTIZE, DEQUANTIZE):
                self._qdq_node(node)
            elif node.op_type in COMPUTE_OPS:
                self._weighted(node)
        self._residual_adds()
        return self.problems

    def _problem(self, message: str) -> None:
        self.problems.append(message)

    # ------------------------------------------------------------------ rule 1: no UINT8

    def _no_uint8(self) -> None:
        for init in self.model.graph.initializer:
            if init.data_type == TensorProto.UINT8:
                self._problem(f"initializer {init.name!r} is UINT8 (TensorRT takes signed int8 only)")
        for vi in list(self.model.graph.input) + list(self.model.graph.output) + list(self.model.graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == TensorProto.UINT8:
                self._problem(f"tensor {vi.name!r} is declared UINT8")
        for node in self.nodes:
            if node.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.UINT8 for a in node.attribute):
                self._problem(f"Cast {node.name!r} casts to UINT8")

    # ------------------------------------------------------------------ rules 1-4 on each Q/DQ

    def _qdq_node(self, node: onnx.NodeProto) -> None:
        what = f"{node.op_type} {node.name!r}"
        scale = self._constant(node, 1, "scale")
        if scale is not None:
            if scale.dtype.kind != "f" or not np.all(np.isfinite(scale)) or not np.all(scale > 0):
                self._problem(f"{what}: scale must be finite and > 0 (got min {float(np.min(scale)):g})")
        if len(node.input) < 3 or not node.input[2]:
            self._problem(f"{what}: zero point missing (ONNX then defaults to UINT8); write an int8 zero")
        else:
            zero = self._constant(node, 2, "zero point")
            if zero is not None:
                if zero.dtype != np.int8:
                    self._problem(f"{what}: zero point is {zero.dtype}, TensorRT needs int8")
                if np.any(zero != 0):
                    self._problem(f"{what}: zero point is not 0 (TensorRT quantization is symmetric)")
        if scale is None:
            return
        per_channel = scale.size > 1
        has_axis = any(a.name == "axis" for a in node.attribute)
        if per_channel and not has_axis:
            self._problem(f"{what}: per-channel scale without an explicit axis attribute "
                          "(TensorRT assumes 0, ONNX defaults to 1)")
        if self._is_weight_path(node):
            if node.op_type == DEQUANTIZE:
                self._weight_dq(node, scale, has_axis)
        elif per_channel:
            self._problem(f"{what}: activation quantized per-channel ({scale.size} scales); "
                          "TensorRT needs per-tensor activations")

    def _constant(self, node: onnx.NodeProto, index: int, role: str) -> np.ndarray | None:
        if len(node.input) <= index or not node.input[index]:
            return None
        value = constant_value(self.model, node.input[index])
        if value is None:
            self._problem(f"{node.op_type} {node.name!r}: {role} {node.input[index]!r} is not a constant")
        return value

    def _is_weight_path(self, node: onnx.NodeProto) -> bool:
        """A DQ of a constant (int8 weight), or a Q of a constant and its DQ."""
        source = node.input[0]
        if source in self.initializers:
            return True
        producer = self.produced_by.get(source)
        return node.op_type == DEQUANTIZE and producer is not None and producer.op_type == QUANTIZE \
            and producer.input[0] in self.initializers

    def _weight_dq(self, dq: onnx.NodeProto, scale: np.ndarray, has_axis: bool) -> None:
        for user in self.read_by.get(dq.output[0], []):
            if user.op_type not in COMPUTE_OPS or len(user.input) < 2 or user.input[1] != dq.output[0]:
                continue  # a quantized bias is reported by _weighted
            weight = self._weight_array(dq)
            if weight is None:
                continue
            expected = _output_channel_axis(user, weight.ndim)
            channels = weight.shape[expected]
            axis = _axis(dq, default=1)
            what = f"weight DQ {dq.name!r} of {user.op_type} {user.name!r}"
            if scale.size == 1 and channels > 1:
                self._problem(f"{what}: per-tensor weight scale; TensorRT wants per-channel on axis {expected}")
            elif scale.size > 1:
                if has_axis and axis % weight.ndim != expected:
                    self._problem(f"{what}: axis {axis} is not the output-channel axis {expected}")
                if scale.size != channels:
                    self._problem(f"{what}: {scale.size} scales for {channels} output channels")

    def _weight_array(self, dq: onnx.NodeProto) -> np.ndarray | None:
        source = dq.input[0]
        if source not in self.initializers:
            source = self.produced_by[source].input[0]
        return constant_value(self.model, source)

    # ------------------------------------------------------------------ rules 5, 6, 8 on weighted ops

    def _weighted(self, node: onnx.NodeProto) -> None:
        what = f"{node.op_type} {node.name!r}"
        if node.op_type != "MatMul" and len(node.input) > 2 and node.input[2]:
            bias_source = self.produced_by.get(node.input[2])
            if bias_source is not None and bias_source.op_type == DEQUANTIZE:
                self._problem(f"{what}: bias is quantized; TensorRT wants a float bias")
        for output in node.output:
            for reader in self.read_by.get(output, []):
                if reader.op_type == QUANTIZE and not self._feeds_quantized_op(reader):
                    self._problem(f"{what}: output {output!r} is quantized but no quantized op reads it "
                                  "(no output Q for TensorRT)")
        if node.name in self.fp16 or len(node.input) < 2 or not self._is_weight(node.input[1]):
            return  # FP16 nodes carry no Q/DQ; activation x activation MatMuls are fine either way
        quantized = [self._reads_dq(name) for name in node.input[:2]]
        if quantized[0] != quantized[1]:
            side = "weight" if quantized[0] else "activation"
            self._problem(f"{what}: only one of activation/weight is quantized ({side} is float)")

    def _is_weight(self, name: str) -> bool:
        if name in self.initializers:
            return True
        producer = self.produced_by.get(name)
        return producer is not None and producer.op_type == DEQUANTIZE and self._is_weight_path(producer)

    def _reads_dq(self, name: str) -> bool:
        producer = self.produced_by.get(name)
        return producer is not None and producer.op_type == DEQUANTIZE

    def _feeds_quantized_op(self, q: onnx.NodeProto) -> bool:
        """Every DQ after this Q feeds a Conv/Gemm/MatMul input or an Add whose inputs are both quantized."""
        readers = self.read_by.get(q.output[0], [])
        if not readers:
            return False
        for dq in readers:
            if dq.op_type != DEQUANTIZE:
                return False
            for user in self.read_by.get(dq.output[0], []):
                if user.op_type in COMPUTE_OPS:
                    continue
                if user.op_type == "Add" and all(self._reads_dq(name) for name in user.input):
                    continue
                return False
        return True

    # ------------------------------------------------------------------ rule 7

    def _residual_adds(self) -> None:
        info = GraphInfo(self.model)
        for node in self.nodes:
            if node.op_type != "Add" or node.name in self.fp16 or len(node.input) != 2:
                continue
            if any(info.is_constant(name) for name in node.input):
                continue
            quantized = [self._reads_dq(name) for name in node.input]
            if all(quantized):
                continue
            if any(quantized):
                self._problem(f"Add {node.name!r}: only one input of the residual Add is quantized")
                continue
            sources = [self._through_dq(name) for name in node.input]
            if _is_residual_add(node, info) and any(self._is_quantized_weighted(src) for src in sources):
                self._problem(f"Add {node.name!r}: residual Add after a quantized layer has float inputs "
                              "(quantize both so TensorRT fuses Conv + Add)")

    def _through_dq(self, name: str) -> onnx.NodeProto | None:
        return self.produced_by.get(name)

    def _is_quantized_weighted(self, node: onnx.NodeProto | None) -> bool:
        return node is not None and node.op_type in COMPUTE_OPS and self._reads_dq(node.input[0])


def _output_channel_axis(node: onnx.NodeProto, rank: int) -> int:
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return rank - 1  # MatMul: [..., K, N]


def _axis(node: onnx.NodeProto, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), default)
