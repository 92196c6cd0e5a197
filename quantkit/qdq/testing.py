"""Tiny models and a min/max calibration, for tests of the Q/DQ writers (no torch, no data files).

:func:`write_minmax_calibration` stands in for the calibration stage: it runs ONNX Runtime on
the given batches, records min/max of every tensor :func:`~quantkit.qdq.placement.calibration_targets`
asks for and writes a ``calib.json`` in the calibration stage's format (amax = max(|min|, |max|)).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _model(nodes, inputs, outputs, initializers, opset: int = OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def residual_cnn(seed: int = 0, opset: int = OPSET) -> onnx.ModelProto:
    """input[N,3,8,8] -> conv1 -> relu1 -> conv2 -> relu2 -> conv3 -> add(relu2) -> relu3 -> gap -> flatten
    -> fc (Gemm, transB) -> sigmoid -> logits[N,5]."""
    rng = np.random.default_rng(seed)
    c = 8
    inits = [
        _init("w1", rng.normal(0, 0.4, (c, 3, 3, 3))), _init("b1", rng.normal(0, 0.1, c)),
        _init("w2", rng.normal(0, 0.2, (c, c, 3, 3))), _init("b2", rng.normal(0, 0.1, c)),
        _init("w3", rng.normal(0, 0.2, (c, c, 3, 3))), _init("b3", rng.normal(0, 0.1, c)),
        _init("wf", rng.normal(0, 0.3, (5, c))), _init("bf", rng.normal(0, 0.1, 5)),
    ]
    pads = {"pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", **pads),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", **pads),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3", **pads),
        helper.make_node("Add", ["c3", "r2"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["z"], name="fc", transB=1),
        helper.make_node("Sigmoid", ["z"], ["logits"], name="head_sigmoid"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])], inits, opset)


def hardswish_cnn(seed: int = 0) -> onnx.ModelProto:
    """input[N,3,8,8] -> conv1 -> HardSwish -> conv2 (stride 2) -> HardSwish -> conv3 -> out (float conv output)."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.5, (8, 3, 3, 3))), _init("b1", rng.normal(0, 0.3, 8)),
        _init("w2", rng.normal(0, 0.3, (16, 8, 3, 3))), _init("b2", rng.normal(0, 0.3, 16)),
        _init("w3", rng.normal(0, 0.3, (4, 16, 1, 1))), _init("b3", rng.normal(0, 0.1, 4)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c1"], ["h1"], name="hswish1"),
        helper.make_node("Conv", ["h1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("HardSwish", ["c2"], ["h2"], name="hswish2"),
        helper.make_node("Conv", ["h2", "w3", "b3"], ["out"], name="conv3"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4, 4, 4])], inits)


def squeeze_excite_cnn(seed: int = 0) -> onnx.ModelProto:
    """input[N,3,8,8] -> conv1 -> HardSwish -> squeeze-excite (gap -> fc1 -> Relu -> fc2 -> HardSigmoid -> Mul)
    -> conv3 -> out: MobileNetV3's block in miniature."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.5, (8, 3, 3, 3))), _init("b1", rng.normal(0, 0.3, 8)),
        _init("wf1", rng.normal(0, 0.5, (4, 8, 1, 1))), _init("bf1", rng.normal(0, 0.2, 4)),
        _init("wf2", rng.normal(0, 0.8, (8, 4, 1, 1))), _init("bf2", rng.normal(0, 0.5, 8)),
        _init("w3", rng.normal(0, 0.3, (4, 8, 1, 1))), _init("b3", rng.normal(0, 0.1, 4)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c1"], ["h1"], name="hswish1"),
        helper.make_node("GlobalAveragePool", ["h1"], ["g"], name="se_gap"),
        helper.make_node("Conv", ["g", "wf1", "bf1"], ["f1"], name="se_fc1"),
        helper.make_node("Relu", ["f1"], ["r1"], name="se_relu"),
        helper.make_node("Conv", ["r1", "wf2", "bf2"], ["f2"], name="se_fc2"),
        helper.make_node("HardSigmoid", ["f2"], ["gate"], name="se_gate", alpha=1.0 / 6.0),
        helper.make_node("Mul", ["h1", "gate"], ["scaled"], name="se_mul"),
        helper.make_node("Conv", ["scaled", "w3", "b3"], ["out"], name="conv3"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4, 8, 8])], inits)


def depthwise_block(channels: int = 12, residual: bool = False, seed: int = 0) -> onnx.ModelProto:
    """input[N,8,8,8] -> expand 1x1 (8 -> channels) -> Relu -> depthwise 3x3 -> HardSwish -> squeeze-excite
    (gap -> fc1 -> Relu -> fc2 -> HardSigmoid -> Mul) -> project 1x1 (channels -> 8) [-> Add(input)] -> out:
    an inverted-residual block whose depthwise width is not a multiple of 16."""
    rng = np.random.default_rng(seed)
    c = channels
    inits = [
        _init("we", rng.normal(0, 0.4, (c, 8, 1, 1))), _init("be", rng.normal(0, 0.2, c)),
        _init("wd", rng.normal(0, 0.4, (c, 1, 3, 3))), _init("bd", rng.normal(0, 0.2, c)),
        _init("wf1", rng.normal(0, 0.5, (4, c, 1, 1))), _init("bf1", rng.normal(0, 0.2, 4)),
        _init("wf2", rng.normal(0, 0.8, (c, 4, 1, 1))), _init("bf2", rng.normal(0, 0.5, c)),
        _init("wp", rng.normal(0, 0.3, (8, c, 1, 1))), _init("bp", rng.normal(0, 0.1, 8)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "we", "be"], ["e"], name="expand"),
        helper.make_node("Relu", ["e"], ["er"], name="expand_relu"),
        helper.make_node("Conv", ["er", "wd", "bd"], ["d"], name="depthwise", group=c, pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["d"], ["dh"], name="dw_hswish"),
        helper.make_node("GlobalAveragePool", ["dh"], ["g"], name="se_gap"),
        helper.make_node("Conv", ["g", "wf1", "bf1"], ["f1"], name="se_fc1"),
        helper.make_node("Relu", ["f1"], ["r1"], name="se_relu"),
        helper.make_node("Conv", ["r1", "wf2", "bf2"], ["f2"], name="se_fc2"),
        helper.make_node("HardSigmoid", ["f2"], ["gate"], name="se_gate", alpha=1.0 / 6.0),
        helper.make_node("Mul", ["gate", "dh"], ["scaled"], name="se_mul"),
        helper.make_node("Conv", ["scaled", "wp", "bp"], ["p" if residual else "out"], name="project"),
    ]
    if residual:
        nodes.append(helper.make_node("Add", ["p", "input"], ["out"], name="add"))
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8, 8, 8])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 8, 8, 8])], inits)


def matmul_mlp(seed: int = 0) -> onnx.ModelProto:
    """x[N,6,16] -> MatMul(W1[16,32]) + b1 -> Relu -> MatMul(W2[32,8]) -> residual-free output y[N,6,8]."""
    rng = np.random.default_rng(seed)
    inits = [_init("W1", rng.normal(0, 0.3, (16, 32))), _init("b1", rng.normal(0, 0.1, 32)),
             _init("W2", rng.normal(0, 0.3, (32, 8)))]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"], name="mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="bias1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu"),
        helper.make_node("MatMul", ["r1", "W2"], ["y"], name="mm2"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6, 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6, 8])], inits)


def no_weights_model() -> onnx.ModelProto:
    """Relu -> Sigmoid: nothing with a weight."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["r"], ["y"], name="sigmoid")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [])


def random_feeds(model: onnx.ModelProto, batch: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float inputs for every graph input (symbolic dims become ``batch``)."""
    rng = np.random.default_rng(seed)
    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def minmax_ranges(model: onnx.ModelProto, batches: Iterable[Mapping[str, np.ndarray]],
                  names: Iterable[str] | None = None) -> dict[str, dict]:
    """Min/max of the given tensors (default: the calibration targets) over ``batches``, with ORT."""
    import onnxruntime as ort

    from quantkit.qdq.placement import calibration_targets

    names = list(names) if names is not None else calibration_targets(model)
    from quantkit.qdq.graph import with_outputs

    probe = with_outputs(model, names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    low = {name: np.inf for name in names}
    high = {name: -np.inf for name in names}
    for feeds in batches:
        for name, value in zip(names, session.run(names, dict(feeds))):
            low[name] = min(low[name], float(np.min(value)))
            high[name] = max(high[name], float(np.max(value)))
    result = {}
    for name in names:
        amax = max(abs(low[name]), abs(high[name]))
        result[name] = {"amax": amax, "scale": amax / 127, "min": low[name], "max": high[name],
                        "method": "minmax", "params": {}, "clipped_fraction": 0.0}
    return result


def write_minmax_calibration(model: onnx.ModelProto, batches: Iterable[Mapping[str, np.ndarray]],
                             path: str | Path) -> dict[str, dict]:
    """Write ``calib.json`` (``{"tensors": {...}}``) with min/max ranges; returns the tensors."""
    tensors = minmax_ranges(model, batches)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"tensors": tensors}, indent=1), encoding="utf-8")
    return tensors
