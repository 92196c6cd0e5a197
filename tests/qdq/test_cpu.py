import numpy as np
import onnx
import pytest
from onnx import TensorProto

from quantkit.backends.onnxruntime.build import optimized_op_histogram, output_cosine
from quantkit.qdq import testing as tiny
from quantkit.qdq.cpu import write_cpu_qdq
from quantkit.qdq.graph import constant_value, producers
from quantkit.qdq.placement import CPU, quantizable_nodes, select_nodes


def _cpu(model, ranges, exclude=()):
    nodes = select_nodes(quantizable_nodes(model), CPU, exclude)
    return write_cpu_qdq(model, ranges, nodes, exclude)


def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def _input_producer(model, node_name, index):
    return producers(model).get(_node(model, node_name).input[index])


@pytest.fixture(scope="module")
def cpu_residual(residual):
    model, ranges = residual
    return _cpu(model, ranges)


def test_activations_are_uint8_asymmetric_from_calibration(cpu_residual, residual):
    _, ranges = residual
    q_input = next(n for n in cpu_residual.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "input")
    scale, zero = constant_value(cpu_residual, q_input.input[1]), constant_value(cpu_residual, q_input.input[2])
    low, high = ranges["input"].cpu_bounds()
    assert zero.dtype == np.uint8 and scale.size == 1
    assert scale == pytest.approx((high - low) / 255, rel=1e-5)
    assert int(zero) == round(-low / float(scale))


def test_weights_are_int8_per_channel_on_output_axis(cpu_residual):
    for node_name, channels in (("conv1", 8), ("conv2", 8), ("fc", 5)):
        dq = _input_producer(cpu_residual, node_name, 1)
        assert dq.op_type == "DequantizeLinear"
        weight, scale, zero = (constant_value(cpu_residual, name) for name in dq.input)
        assert weight.dtype == np.int8 and zero.dtype == np.int8 and not zero.any()
        assert scale.shape == (channels,)
        assert next(a.i for a in dq.attribute if a.name == "axis") == 0


def test_bias_is_int32_for_fusion(cpu_residual):
    dq = _input_producer(cpu_residual, "conv1", 2)
    assert dq.op_type == "DequantizeLinear" and constant_value(cpu_residual, dq.input[0]).dtype == np.int32


def test_optimized_graph_fuses_into_qlinear_ops(cpu_residual):
    ops = optimized_op_histogram(cpu_residual)
    assert ops.get("QLinearConv") == 3
    assert ops.get("QLinearAdd") == 1
    assert ops.get("QLinearGlobalAveragePool") == 1
    assert ops.get("QGemm") == 1
    assert "Conv" not in ops and "Gemm" not in ops


def test_matmul_fuses_and_graph_output_stays_float(mlp):
    model, ranges = mlp
    quantized = _cpu(model, ranges)
    assert _node(quantized, "mm2").output[0] == "y"  # no Q/DQ on the graph output
    ops = optimized_op_histogram(quantized)
    assert ops.get("MatMulIntegerToFloat", 0) + ops.get("QLinearMatMul", 0) == 2
    dq = _input_producer(quantized, "mm1", 1)
    assert next(a.i for a in dq.attribute if a.name == "axis") == 1  # [K, N]: N is the output channel


def test_excluded_nodes_carry_no_qdq(residual):
    model, ranges = residual
    quantized = _cpu(model, ranges, exclude=["conv1", "head_sigmoid"])
    produced_by = producers(quantized)
    conv1 = _node(quantized, "conv1")
    assert conv1.input[0] == "input" and conv1.input[1] == "w1" and conv1.input[2] == "b1"
    assert constant_value(quantized, "w1").dtype == np.float32
    assert all(user.op_type != "QuantizeLinear" for user in quantized.graph.node if conv1.output[0] in user.input)
    sigmoid = _node(quantized, "head_sigmoid")
    assert produced_by[sigmoid.input[0]].op_type == "Gemm"  # float Gemm output straight into the float head
    assert sigmoid.output[0] == "logits"
    assert "QLinearSigmoid" not in optimized_op_histogram(quantized)


def test_excluded_conv_after_an_int8_producer_stays_float_in_onnxruntime(residual):
    """ORT would otherwise quantize its weights per-tensor (WeightBiasQuantization) and fuse it."""
    model, ranges = residual
    quantized = _cpu(model, ranges, exclude=["conv2"])
    assert _node(quantized, "conv2").input[1] == "w2"
    ops = optimized_op_histogram(quantized)
    assert ops.get("QLinearConv") == 2  # conv1 and conv3; conv2 runs in float
    assert ops.get("Conv", 0) + ops.get("FusedConv", 0) == 1
    assert output_cosine(model, quantized, tiny.random_feeds(model, 8, seed=2)) > 0.999


@pytest.mark.parametrize("fixture, excluded, float_op", [
    # no integer kernel: must not be lowered (ORT runs it as HardSigmoid * x)
    ("hardswish", "hswish1", "HardSigmoid"),
    ("squeeze_excite", "se_gate", "HardSigmoid"),  # not folded into se_fc2's requantization
    ("residual", "gap", "GlobalAveragePool"),  # ORT's per-tensor QLinearGlobalAveragePool must not take it
    ("residual", "add", "FusedConv"),  # ORT fuses the float Add into conv3, which then runs in float
])
def test_excluded_non_conv_after_an_int8_producer_runs_in_float(request, fixture, excluded, float_op):
    """These used to make ORT refuse the model (a per-channel DQ fused into a per-tensor QLinear kernel)."""
    model, ranges = request.getfixturevalue(fixture)
    quantized = _cpu(model, ranges, exclude=[excluded])
    ops = optimized_op_histogram(quantized)  # builds an ORT session: fails if ORT refuses the model
    excluded_op = _node(model, excluded).op_type
    assert ops.get(float_op, 0) >= 1 and "QLinear" + excluded_op not in ops
    if excluded_op == "HardSwish":
        assert _hsig_requants(quantized) == 1  # only hswish2 was lowered
    assert output_cosine(model, quantized, tiny.random_feeds(model, 8, seed=4)) > 0.998


def test_cpu_flavour_close_to_fp32(cpu_residual, residual):
    model, _ = residual
    assert output_cosine(model, cpu_residual, tiny.random_feeds(model, 8, seed=7)) > 0.999


def _hsig_requants(quantized) -> int:
    """How many hard-sigmoid requantizations (Add of the constant 0) the lowering wrote."""
    return sum(1 for n in quantized.graph.node if n.op_type == "Add" and n.name.endswith("/hsig_requant"))


def test_hardswish_becomes_requantization_and_mul(hardswish):
    model, ranges = hardswish
    quantized = _cpu(model, ranges)
    ops = [n.op_type for n in quantized.graph.node]
    assert "HardSwish" not in ops and _hsig_requants(quantized) == 2
    fused = optimized_op_histogram(quantized)
    # 2 hard-sigmoid requantizations (QLinearAdd with a constant) and 2 products; nothing float left
    assert fused.get("QLinearAdd") == 2 and fused.get("QLinearMul") == 2 and fused.get("QLinearConv") == 3
    assert "QLinearLeakyRelu" not in fused and "HardSwish" not in fused and "HardSigmoid" not in fused
    assert output_cosine(model, quantized, tiny.random_feeds(model, 8, seed=3)) > 0.998


def test_hardswish_requantization_matches_hardsigmoid_on_the_grid():
    # q = clamp(round(x * 256/6) + 128, 0, 255); q / 256 must be hard-sigmoid within one step
    x = np.linspace(-8, 8, 2001, dtype=np.float32)
    q = np.clip(np.round(x / (6 / 256)) + 128, 0, 255)
    assert np.max(np.abs(q / 256 - np.clip(x / 6 + 0.5, 0, 1))) <= 1 / 256 + 1e-6
    assert np.all(q[x <= -3] == 0)


def test_hardswish_input_grid_starts_at_minus_three(hardswish):
    """HardSwish is 0 below -3: the Q of a tensor only HardSwish reads does not spend steps there."""
    model, ranges = hardswish
    assert ranges["c2"].min < -3  # calibration saw values below -3 ...
    quantized = _cpu(model, ranges)
    q = next(n for n in quantized.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "c2")
    scale, zero = float(constant_value(quantized, q.input[1])), int(constant_value(quantized, q.input[2]))
    assert -zero * scale == pytest.approx(-3.0, abs=scale)  # ... the grid starts at -3
    assert (255 - zero) * scale == pytest.approx(ranges["c2"].cpu_bounds()[1], abs=scale)


def test_input_grid_of_a_float_hardswish_keeps_the_calibrated_low_end(hardswish):
    model, ranges = hardswish
    quantized = _cpu(model, ranges, exclude=["hswish2"])
    # conv2 is INT8, so its output is still quantized (the float HardSwish reads it through a DQ) ...
    q = next(n for n in quantized.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "c2")
    scale, zero = float(constant_value(quantized, q.input[1])), int(constant_value(quantized, q.input[2]))
    # ... on the calibrated range: a float HardSwish sees the values below -3 (and must get them right)
    assert -zero * scale == pytest.approx(ranges["c2"].cpu_bounds()[0], abs=scale)


def test_squeeze_excite_gate_is_folded_into_the_producer(squeeze_excite):
    model, ranges = squeeze_excite
    quantized = _cpu(model, ranges)
    assert "HardSigmoid" not in [n.op_type for n in quantized.graph.node]
    # se_fc2's output Q is the hard-sigmoid grid: scale 1/(256 alpha) = 6/256, zero point 256 beta = 128
    q = next(n for n in quantized.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "f2")
    assert float(constant_value(quantized, q.input[1])) == pytest.approx(6 / 256)
    assert int(constant_value(quantized, q.input[2])) == 128
    fused = optimized_op_histogram(quantized)
    assert "HardSigmoid" not in fused
    assert fused.get("QuantizeLinear") == 1 and fused.get("DequantizeLinear") == 1  # model input and output only
    assert fused.get("QLinearConv") == 4 and fused.get("QLinearMul") == 2  # se_mul + the HardSwish product
    assert output_cosine(model, quantized, tiny.random_feeds(model, 8, seed=5)) > 0.998


def test_model_is_valid_onnx(cpu_residual):
    onnx.checker.check_model(cpu_residual)
    assert all(i.data_type != TensorProto.UINT8 or i.dims == [] for i in cpu_residual.graph.initializer)
