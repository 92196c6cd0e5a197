"""The checker rejects each rule violation (one test per rule), starting from a valid model."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from quantkit.qdq.graph import producers
from quantkit.qdq.placement import TRT, quantizable_nodes, select_nodes
from quantkit.qdq.trt import write_trt_qdq
from quantkit.qdq.trt_check import check_trt_qdq


@pytest.fixture()
def good(residual):
    model, ranges = residual
    quantized = write_trt_qdq(model, ranges, select_nodes(quantizable_nodes(model), TRT))
    assert check_trt_qdq(quantized) == []
    return quantized


def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def _set_init(model, name, array):
    for index, init in enumerate(model.graph.initializer):
        if init.name == name:
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(array, name))
            return
    model.graph.initializer.append(numpy_helper.from_array(array, name))


def _activation_q(model, tensor="input"):
    return next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)


def _weight_dq(model, node_name):
    return producers(model)[_node(model, node_name).input[1]]


def _expect(model, text):
    problems = check_trt_qdq(model)
    assert any(text in p for p in problems), problems


def test_uint8_zero_point(good):
    q = _activation_q(good)
    _set_init(good, q.input[2], np.array(0, np.uint8))
    _expect(good, "UINT8")


def test_nonzero_zero_point(good):
    q = _activation_q(good)
    _set_init(good, q.input[2], np.array(3, np.int8))
    _expect(good, "zero point is not 0")


def test_missing_zero_point(good):
    q = _activation_q(good)
    del q.input[2]
    _expect(good, "zero point missing")


def test_scale_not_positive(good):
    q = _activation_q(good)
    _set_init(good, q.input[1], np.array(0.0, np.float32))
    _expect(good, "scale must be finite and > 0")


def test_per_channel_activation(good):
    q = _activation_q(good)
    dq = next(n for n in good.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    name = "per_channel_scale"
    _set_init(good, name, np.full(3, 0.01, np.float32))
    _set_init(good, "per_channel_zero", np.zeros(3, np.int8))
    for node in (q, dq):
        node.input[1], node.input[2] = name, "per_channel_zero"
        node.attribute.append(helper.make_attribute("axis", 1))
    _expect(good, "activation quantized per-channel")


def test_per_tensor_weight(good):
    dq = _weight_dq(good, "conv2")
    _set_init(good, dq.input[1], np.array(0.01, np.float32))
    _set_init(good, dq.input[2], np.array(0, np.int8))
    _expect(good, "per-tensor weight scale")


def test_weight_axis_not_output_channel(good):
    dq = _weight_dq(good, "conv2")  # w2 is [8, 8, 3, 3]: axis 1 is shape-valid but wrong
    next(a for a in dq.attribute if a.name == "axis").i = 1
    _expect(good, "not the output-channel axis 0")


def test_axis_not_written(good):
    dq = _weight_dq(good, "conv2")
    kept = [a for a in dq.attribute if a.name != "axis"]
    del dq.attribute[:]
    dq.attribute.extend(kept)
    _expect(good, "without an explicit axis")


def test_quantized_bias(good):
    conv = _node(good, "conv1")
    _set_init(good, "b1_int32", np.zeros(8, np.int32))
    _set_init(good, "b1_scale", np.full(8, 1e-4, np.float32))
    _set_init(good, "b1_zero", np.zeros(8, np.int32))
    dq = helper.make_node("DequantizeLinear", ["b1_int32", "b1_scale", "b1_zero"], ["b1_dq"], name="b1_dq", axis=0)
    good.graph.node.insert(0, dq)
    conv.input[2] = "b1_dq"
    _expect(good, "bias is quantized")


def test_output_q_on_weighted_op(good):
    fc = _node(good, "fc")
    _set_init(good, "z_scale", np.array(0.05, np.float32))
    _set_init(good, "z_zero", np.array(0, np.int8))
    q = helper.make_node("QuantizeLinear", [fc.output[0], "z_scale", "z_zero"], ["z_q"], name="z_q")
    dq = helper.make_node("DequantizeLinear", ["z_q", "z_scale", "z_zero"], ["z_dq"], name="z_dq")
    good.graph.node.extend([q, dq])
    _node(good, "head_sigmoid").input[0] = "z_dq"
    _expect(good, "no output Q")


def test_residual_add_with_one_float_input(good):
    add = _node(good, "add")
    dq = producers(good)[add.input[1]]
    add.input[1] = producers(good)[dq.input[0]].input[0]  # bypass the Q/DQ of the skip input
    _expect(good, "only one input of the residual Add")


def test_weight_quantized_but_activation_float(good):
    conv = _node(good, "conv2")
    dq = producers(good)[conv.input[0]]
    conv.input[0] = producers(good)[dq.input[0]].input[0]
    _expect(good, "only one of activation/weight is quantized")


def test_uint8_anywhere(good):
    good.graph.node.append(helper.make_node("Cast", ["logits"], ["logits_u8"], name="to_u8", to=onnx.TensorProto.UINT8))
    _expect(good, "casts to UINT8")
