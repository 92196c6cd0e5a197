import numpy as np
import onnx
import pytest

from quantkit.backends.onnxruntime.build import output_cosine
from quantkit.qdq import testing as tiny
from quantkit.qdq.graph import constant_value, producers
from quantkit.qdq.placement import TRT, quantizable_nodes, select_nodes
from quantkit.qdq.trt import fp16_nodes, write_trt_qdq
from quantkit.qdq.trt_check import check_trt_qdq


def _trt(model, ranges, exclude=()):
    return write_trt_qdq(model, ranges, select_nodes(quantizable_nodes(model), TRT, exclude), exclude)


def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


@pytest.fixture(scope="module")
def trt_residual(residual):
    model, ranges = residual
    return _trt(model, ranges)


def test_written_model_passes_the_checker_and_onnx_checker(trt_residual, mlp, hardswish):
    assert check_trt_qdq(trt_residual) == []
    onnx.checker.check_model(trt_residual)
    for model, ranges in (mlp, hardswish):
        assert check_trt_qdq(_trt(model, ranges)) == []


def test_symmetric_int8_scale_is_amax_over_127(trt_residual, residual):
    _, ranges = residual
    for node in trt_residual.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            zero = constant_value(trt_residual, node.input[2])
            assert zero.dtype == np.int8 and not zero.any()
    q = next(n for n in trt_residual.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "input")
    assert float(constant_value(trt_residual, q.input[1])) == pytest.approx(ranges["input"].amax / 127, rel=1e-6)


def test_qdq_only_on_inputs_of_weighted_ops_and_residual_add(trt_residual):
    produced_by = producers(trt_residual)
    quantized_activations = {produced_by[n.input[0]].input[0] for n in trt_residual.graph.node
                             if n.op_type == "DequantizeLinear" and n.input[0] in produced_by}
    # conv/gemm activation inputs (input, r1, r2, f) and both residual inputs (c3, r2) -- nothing else
    assert quantized_activations == {"input", "r1", "r2", "c3", "f"}
    assert _node(trt_residual, "conv3").output[0] == "c3"  # the Q on c3 belongs to the residual Add
    for name in ("relu1", "relu3", "gap", "head_sigmoid"):
        node = _node(trt_residual, name)
        assert all(produced_by.get(i) is None or produced_by[i].op_type != "DequantizeLinear" for i in node.input)


def test_weights_per_channel_with_axis_and_float_bias(trt_residual):
    produced_by = producers(trt_residual)
    for name in ("conv1", "conv2", "conv3", "fc"):
        node = _node(trt_residual, name)
        dq = produced_by[node.input[1]]
        assert dq.op_type == "DequantizeLinear" and any(a.name == "axis" for a in dq.attribute)
        assert constant_value(trt_residual, dq.input[1]).size > 1
        assert node.input[2] in {i.name for i in trt_residual.graph.initializer}  # float bias, no DQ
        assert constant_value(trt_residual, node.input[2]).dtype == np.float32


def test_excluded_nodes_are_marked_fp16_and_carry_no_qdq(residual):
    model, ranges = residual
    quantized = _trt(model, ranges, exclude=["conv2", "fc"])
    assert fp16_nodes(quantized) == ["conv2", "fc"]
    produced_by = producers(quantized)
    for name in ("conv2", "fc"):
        node = _node(quantized, name)
        assert all(produced_by.get(i) is None or produced_by[i].op_type != "DequantizeLinear" for i in node.input)
    assert check_trt_qdq(quantized) == []


def _conv_feeding_conv_and_add():
    """input -> conv1 -> c1; c1 -> conv2 -> c2; add(c1, c2) -> out: c1 has an INT8 reader and the add."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits = [tiny._init("w1", rng.normal(0, 0.4, (4, 3, 3, 3))), tiny._init("w2", rng.normal(0, 0.3, (4, 4, 3, 3)))]
    nodes = [helper.make_node("Conv", ["input", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c1", "c2"], ["out"], name="add")]
    return tiny._model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 6, 6])],
                       [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4, 6, 6])], inits)


def test_fp16_node_beside_a_quantized_reader_reads_the_float_tensor(tmp_path):
    """conv1's output feeds conv2 (INT8: Q/DQ) and the excluded add: the add must read the float tensor.

    The MobileNetV3 sensitivity set (an excluded residual Add whose other reader is an INT8 Conv)
    once produced a Q after a Conv that an FP16 node read, which TensorRT's rules forbid.
    """
    from quantkit.qdq import load_ranges

    model = _conv_feeding_conv_and_add()
    tiny.write_minmax_calibration(model, [tiny.random_feeds(model, 8, seed=1)], tmp_path / "calib.json")
    quantized = _trt(model, load_ranges(tmp_path / "calib.json"), exclude=["add"])
    produced_by = producers(quantized)
    assert _node(quantized, "add").input[0] == "c1"
    assert produced_by[_node(quantized, "conv2").input[0]].op_type == "DequantizeLinear"  # INT8 reader keeps it
    assert check_trt_qdq(quantized) == []


def test_trt_flavour_runs_in_onnxruntime_close_to_fp32(trt_residual, residual, mlp):
    model, _ = residual
    assert output_cosine(model, trt_residual, tiny.random_feeds(model, 8, seed=5)) > 0.999
    mlp_model, mlp_ranges = mlp
    assert output_cosine(mlp_model, _trt(mlp_model, mlp_ranges), tiny.random_feeds(mlp_model, 8, seed=5)) > 0.999
