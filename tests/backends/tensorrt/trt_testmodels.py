"""Tiny ONNX models for the TensorRT backend tests, built with onnx.helper (deterministic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def conv_gemm_model(seed: int = 0, channels: int = 4, size: int = 8, classes: int = 5) -> onnx.ModelProto:
    """input [batch,1,size,size] -> Conv -> Relu -> Shape/Reshape (flatten) -> Gemm -> Softmax -> logits.

    Node names follow the exporter's style (``/conv/Conv``) so tests can name them. The
    Shape -> Gather -> Concat -> Reshape chain gives the int64 shape layers TensorRT must
    never be asked to run in FP16.
    """
    rng = np.random.default_rng(seed)
    flat = channels * size * size
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (channels, 1, 3, 3)).astype(np.float32), "conv.weight"),
        numpy_helper.from_array(rng.normal(0, 0.1, (channels,)).astype(np.float32), "conv.bias"),
        numpy_helper.from_array(rng.normal(0, 0.2, (classes, flat)).astype(np.float32), "fc.weight"),
        numpy_helper.from_array(rng.normal(0, 0.1, (classes,)).astype(np.float32), "fc.bias"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "minus_one"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["/conv/Conv_output_0"], name="/conv/Conv",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["/conv/Conv_output_0"], ["/relu/Relu_output_0"], name="/relu/Relu"),
        helper.make_node("Shape", ["/relu/Relu_output_0"], ["/Shape_output_0"], name="/Shape"),
        helper.make_node("Gather", ["/Shape_output_0", "zero"], ["/Gather_output_0"], name="/Gather", axis=0),
        helper.make_node("Concat", ["/Gather_output_0", "minus_one"], ["/Concat_output_0"], name="/Concat", axis=0),
        helper.make_node("Reshape", ["/relu/Relu_output_0", "/Concat_output_0"], ["/Reshape_output_0"],
                         name="/Reshape"),
        helper.make_node("Gemm", ["/Reshape_output_0", "fc.weight", "fc.bias"], ["/fc/Gemm_output_0"],
                         name="/fc/Gemm", transB=1),
        helper.make_node("Softmax", ["/fc/Gemm_output_0"], ["logits"], name="/Softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "conv_gemm",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="quantkit-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def run_ort(model: onnx.ModelProto | Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _quantize_weight(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 along ``axis``: (int8 values, float32 scales)."""
    moved = np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)
    scales = np.maximum(np.abs(moved).max(axis=1), 1e-8) / 127.0
    shape = [1] * weight.ndim
    shape[axis] = -1
    values = np.clip(np.round(weight / scales.reshape(shape)), -127, 127).astype(np.int8)
    return values, scales.astype(np.float32)


def conv_gemm_qdq_model(seed: int = 0) -> onnx.ModelProto:
    """:func:`conv_gemm_model` in TensorRT's Q/DQ flavour: symmetric int8, explicit axes, no output Q.

    Activations entering Conv and Gemm are quantized per tensor; Conv weights per output
    channel (axis 0), Gemm weights (transB=1) per row (axis 0); biases stay float.
    """
    base = conv_gemm_model(seed)
    graph = base.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    new_inits = [i for i in graph.initializer if i.name not in ("conv.weight", "fc.weight")]
    nodes = []

    def activation_qdq(tensor: str, scale: float) -> str:
        new_inits.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{tensor}_scale"),
                          numpy_helper.from_array(np.array(0, np.int8), f"{tensor}_zero_point")])
        nodes.append(helper.make_node("QuantizeLinear", [tensor, f"{tensor}_scale", f"{tensor}_zero_point"],
                                      [f"{tensor}_quantized"], name=f"{tensor}_QuantizeLinear", axis=1))
        nodes.append(helper.make_node("DequantizeLinear", [f"{tensor}_quantized", f"{tensor}_scale",
                                                           f"{tensor}_zero_point"],
                                      [f"{tensor}_dequantized"], name=f"{tensor}_DequantizeLinear", axis=1))
        return f"{tensor}_dequantized"

    def weight_dq(name: str, axis: int) -> str:
        values, scales = _quantize_weight(inits[name], axis)
        new_inits.extend([numpy_helper.from_array(values, f"{name}_quantized"),
                          numpy_helper.from_array(scales, f"{name}_scale"),
                          numpy_helper.from_array(np.zeros(scales.shape, np.int8), f"{name}_zero_point")])
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_quantized", f"{name}_scale",
                                                           f"{name}_zero_point"],
                                      [f"{name}_dequantized"], name=f"{name}_DequantizeLinear", axis=axis))
        return f"{name}_dequantized"

    for node in graph.node:
        if node.op_type == "Conv":
            node.input[0] = activation_qdq(node.input[0], 0.03)
            node.input[1] = weight_dq("conv.weight", 0)
        elif node.op_type == "Gemm":
            node.input[0] = activation_qdq(node.input[0], 0.02)
            node.input[1] = weight_dq("fc.weight", 0)
        nodes.append(node)
    new_graph = helper.make_graph(nodes, "conv_gemm_qdq", list(graph.input), list(graph.output),
                                  initializer=new_inits)
    model = helper.make_model(new_graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="quantkit-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
