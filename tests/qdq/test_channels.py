"""Depthwise channel padding for ONNX Runtime's uint8 depthwise kernel (quantkit.qdq.channels)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from quantkit.backends.onnxruntime.build import optimized_op_histogram, output_cosine
from quantkit.qdq import testing as tiny
from quantkit.qdq.channels import pad_depthwise_channels
from quantkit.qdq.cpu import write_cpu_qdq
from quantkit.qdq.placement import CPU, quantizable_nodes, select_nodes


def _weight(model, name):
    return next(numpy_helper.to_array(i) for i in model.graph.initializer if i.name == name)


def _run(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_a_12_channel_block_is_padded_to_16_and_computes_the_same():
    model = tiny.depthwise_block(12)
    padded, report = pad_depthwise_channels(model)
    assert report == {"depthwise": (12, 16)}
    assert _weight(padded, "we").shape == (16, 8, 1, 1) and not _weight(padded, "we")[12:].any()
    assert _weight(padded, "wd").shape == (16, 1, 3, 3) and _weight(padded, "bd").shape == (16,)
    assert _weight(padded, "wf1").shape == (4, 16, 1, 1) and not _weight(padded, "wf1")[:, 12:].any()
    assert _weight(padded, "wf2").shape == (16, 4, 1, 1) and _weight(padded, "wp").shape == (8, 16, 1, 1)
    depthwise = next(n for n in padded.graph.node if n.name == "depthwise")
    assert next(a.i for a in depthwise.attribute if a.name == "group") == 16
    onnx.checker.check_model(padded)
    feeds = tiny.random_feeds(model, 4, seed=3)
    np.testing.assert_allclose(_run(padded, feeds), _run(model, feeds), atol=1e-5)
    assert _weight(model, "we").shape == (12, 8, 1, 1)  # the input model is left as it was


def test_the_cpu_flavour_is_padded_and_as_accurate_as_unpadded(tmp_path_factory):
    model = tiny.depthwise_block(12)
    path = tmp_path_factory.mktemp("dw") / "calib.json"
    tiny.write_minmax_calibration(model, [tiny.random_feeds(model, 4, seed) for seed in range(4)], path)
    from quantkit.qdq import load_ranges

    ranges = load_ranges(path)
    nodes = select_nodes(quantizable_nodes(model), CPU)
    padded = write_cpu_qdq(model, ranges, nodes)
    plain = write_cpu_qdq(model, ranges, nodes, pad_channels=False)
    grouped = next(n for n in padded.graph.node if n.name == "depthwise")
    assert next(a.i for a in grouped.attribute if a.name == "group") == 16
    assert optimized_op_histogram(padded).get("QLinearConv") == 5  # still fused
    feeds = tiny.random_feeds(model, 8, seed=5)
    assert output_cosine(plain, padded, feeds) > 0.99999  # the extra channels change nothing
    assert output_cosine(model, padded, feeds) > 0.998


def test_nothing_is_padded_when_already_a_multiple_of_16():
    model = tiny.depthwise_block(16)
    padded, report = pad_depthwise_channels(model)
    assert report == {} and padded is model


def test_a_residual_block_is_padded_inside_the_residual():
    """The skip Add reads the projection's output, outside the channel group: padding stays exact."""
    model = tiny.depthwise_block(12, residual=True)
    padded, report = pad_depthwise_channels(model)
    assert report == {"depthwise": (12, 16)}
    feeds = tiny.random_feeds(model, 4, seed=3)
    np.testing.assert_allclose(_run(padded, feeds), _run(model, feeds), atol=1e-5)


def test_a_group_reaching_a_graph_output_is_left_alone():
    model = tiny.depthwise_block(12)
    model.graph.output.append(onnx.helper.make_tensor_value_info("dh", onnx.TensorProto.FLOAT, None))
    assert pad_depthwise_channels(model)[1] == {}


def test_a_group_through_an_op_the_padding_does_not_know_is_left_alone():
    model = tiny.depthwise_block(12)
    mul = next(n for n in model.graph.node if n.name == "se_mul")
    mul.output[0] = "scaled_pre"
    model.graph.node.insert(list(model.graph.node).index(mul) + 1, onnx.helper.make_node(
        "Transpose", ["scaled_pre"], ["scaled"], name="mixer", perm=[0, 1, 3, 2]))
    onnx.checker.check_model(model)
    assert pad_depthwise_channels(onnx.shape_inference.infer_shapes(model))[1] == {}
