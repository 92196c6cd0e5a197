"""The explicit FP16 conversion (Casts + FP16 initializers), checked on CPU with ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.tensorrt.trt_testmodels import OPSET, conv_gemm_model, conv_gemm_qdq_model, run_ort
from quantkit.backends.tensorrt.fp16 import convert_file, convert_nodes_to_fp16
from quantkit.errors import ConfigError


def _x(batch: int = 6, seed: int = 3) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).normal(size=(batch, 1, 8, 8)).astype(np.float32)}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {i.name: i.data_type for i in inferred.graph.initializer}
    for info in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        types[info.name] = info.type.tensor_type.elem_type
    return types


@pytest.mark.parametrize("nodes", [["/conv/Conv"], ["/fc/Gemm"], ["/conv/Conv", "/relu/Relu", "/fc/Gemm",
                                                                     "/Softmax"]])
def test_converted_model_is_valid_and_close_to_fp32(nodes):
    model = conv_gemm_model()
    converted, report = convert_nodes_to_fp16(model, nodes)
    onnx.checker.check_model(converted, full_check=True)
    assert report.nodes == nodes
    reference = run_ort(model, _x())[0]
    result = run_ort(converted, _x())[0]
    assert result.dtype == np.float32 and result.shape == reference.shape  # graph I/O types are kept
    assert _cosine(reference, result) > 0.999
    np.testing.assert_allclose(result, reference, atol=5e-3)


def test_only_the_listed_nodes_change_precision():
    model = conv_gemm_model()
    converted, _ = convert_nodes_to_fp16(model, ["/conv/Conv", "/fc/Gemm"])
    types = _types(converted)
    by_name = {node.name: node for node in converted.graph.node}
    for name in ("/conv/Conv", "/fc/Gemm"):
        node = by_name[name]
        float_inputs = [t for t in node.input if t]
        assert all(types[t] == TensorProto.FLOAT16 for t in float_inputs), name
        assert types[node.output[0]] == TensorProto.FLOAT16
    original = {node.name: node for node in model.graph.node}
    for name, node in original.items():
        if name in ("/conv/Conv", "/fc/Gemm"):
            continue
        assert list(by_name[name].input) == list(node.input) and list(by_name[name].output) == list(node.output)
        assert all(types[t] != TensorProto.FLOAT16 for t in [*node.input, *node.output] if t)
    added = [n for n in converted.graph.node if n.name not in original]
    assert sorted(n.op_type for n in added) == ["Cast"] * 4
    assert len(converted.graph.node) == len(model.graph.node) + 4


def test_chained_fp16_nodes_share_tensors_without_cast_pairs():
    converted, report = convert_nodes_to_fp16(conv_gemm_model(), ["/conv/Conv", "/relu/Relu"])
    relu = next(n for n in converted.graph.node if n.name == "/relu/Relu")
    assert relu.input[0] == "/conv/Conv_output_0__fp16"  # straight from the FP16 conv
    assert (report.casts_to_fp16, report.casts_to_fp32) == (1, 1)
    # conv's float32 output has no FP32 consumer left, so no cast back was added for it
    assert not any(n.output == ["/conv/Conv_output_0"] for n in converted.graph.node)


def test_initializers_become_fp16_and_unused_fp32_copies_go():
    converted, report = convert_nodes_to_fp16(conv_gemm_model(), ["/conv/Conv"])
    inits = {i.name: i for i in converted.graph.initializer}
    assert inits["conv.weight__fp16"].data_type == TensorProto.FLOAT16
    assert "conv.weight" not in inits and "conv.bias" not in inits
    assert inits["fc.weight"].data_type == TensorProto.FLOAT
    assert sorted(report.initializers) == ["conv.bias", "conv.weight"]


def test_values_beyond_fp16_range_are_clipped_and_reported():
    model = conv_gemm_model()
    for init in model.graph.initializer:
        if init.name == "fc.bias":
            init.CopyFrom(numpy_helper.from_array(np.array([1e6, -1e6, 0, 1, 2], np.float32), "fc.bias"))
    converted, report = convert_nodes_to_fp16(model, ["/fc/Gemm"])
    assert report.clipped == {"fc.bias": 2}
    bias = numpy_helper.to_array(next(i for i in converted.graph.initializer if i.name == "fc.bias__fp16"))
    assert np.isfinite(bias).all() and bias.max() == np.float16(65504)


def test_qdq_model_with_an_fp16_node_still_runs():
    model = conv_gemm_qdq_model()
    converted, report = convert_nodes_to_fp16(model, ["/fc/Gemm"])
    onnx.checker.check_model(converted, full_check=True)
    gemm = next(n for n in converted.graph.node if n.name == "/fc/Gemm")
    assert gemm.input[1] == "fc.weight_dequantized__fp16"  # the DQ output is cast, the int8 weight stays
    assert _cosine(run_ort(model, _x())[0], run_ort(converted, _x())[0]) > 0.999


def test_schema_decides_which_inputs_change():
    """Resize's scales are always float32 (not its type parameter): they must stay float32."""
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize", mode="nearest")]
    graph = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    converted, report = convert_nodes_to_fp16(model, ["resize"])
    resize = next(n for n in converted.graph.node if n.name == "resize")
    assert list(resize.input) == ["x__fp16", "", "scales"]
    assert report.initializers == []
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    np.testing.assert_array_equal(run_ort(converted, {"x": x})[0], run_ort(model, {"x": x})[0])


def test_unknown_node_suggests_close_names():
    with pytest.raises(ConfigError, match=r"'/conv/Cnv' is not a top-level node.*did you mean '/conv/Conv'"):
        convert_nodes_to_fp16(conv_gemm_model(), ["/conv/Cnv"])


@pytest.mark.parametrize("node, message", [("/Shape", "no float32 output"),
                                           ("fc.weight_DequantizeLinear", "quantization")])
def test_nodes_that_cannot_be_converted_are_refused(node, message):
    with pytest.raises(ConfigError, match=message):
        convert_nodes_to_fp16(conv_gemm_qdq_model(), [node])


def test_empty_list_is_a_plain_copy(tmp_path):
    model = conv_gemm_model()
    converted, report = convert_nodes_to_fp16(model, [])
    assert converted == model and converted is not model and report.nodes == []
    source = tmp_path / "in.onnx"
    onnx.save(model, str(source))
    convert_file(source, tmp_path / "out.onnx", ["/conv/Conv"])
    onnx.checker.check_model(str(tmp_path / "out.onnx"))
