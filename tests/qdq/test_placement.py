import pytest

from quantkit.errors import ConfigError, ModelError
from quantkit.qdq import testing as tiny
from quantkit.qdq.placement import (CPU, TRT, calibration_targets, check_model, input_side_regions,
                                    quantizable_nodes, resolve_exclusions, select_nodes)


def test_calibration_targets_cover_both_flavours_in_graph_order():
    targets = calibration_targets(tiny.residual_cnn())
    # graph input, conv activation inputs, residual Add inputs (c3, r2), ReLU outputs that ORT folds
    # into the conv's Q (r1, r2, r3), and the outputs the CPU flavour quantizes for fusion (g, z, logits)
    assert targets == ["input", "c1", "r1", "c2", "r2", "c3", "s", "r3", "g", "f", "z", "logits"]


def test_calibration_targets_skip_weights_and_integer_tensors():
    targets = calibration_targets(tiny.matmul_mlp())
    assert "W1" not in targets and "b1" not in targets
    assert targets[0] == "x"


def test_flavour_tables():
    nodes = {n.name: n for n in quantizable_nodes(tiny.residual_cnn())}
    assert nodes["conv1"].cpu and nodes["conv1"].trt
    assert nodes["add"].trt  # residual: both inputs [N,8,8,8]
    assert nodes["relu1"].cpu and not nodes["relu1"].trt  # TensorRT fuses ReLU itself
    assert nodes["head_sigmoid"].cpu and not nodes["head_sigmoid"].trt
    assert select_nodes(list(nodes.values()), TRT) == ["conv1", "conv2", "conv3", "add", "fc"]


def test_bias_add_with_a_constant_is_not_a_candidate():
    names = [n.name for n in quantizable_nodes(tiny.matmul_mlp())]
    assert "bias1" not in names and "mm1" in names


def test_excluded_nodes_are_not_selected():
    nodes = quantizable_nodes(tiny.residual_cnn())
    assert "conv2" not in select_nodes(nodes, CPU, exclude={"conv2"})


def test_resolve_exclusions_by_name_glob_and_op_type():
    model = tiny.residual_cnn()
    matches = resolve_exclusions(model, ["conv2", "relu*", "Sigmoid"])
    assert matches == {"conv2": ["conv2"], "relu*": ["relu1", "relu2", "relu3"], "Sigmoid": ["head_sigmoid"]}


def test_unknown_exclusion_names_close_matches():
    with pytest.raises(ConfigError) as info:
        resolve_exclusions(tiny.residual_cnn(), ["conv_2"])
    assert "conv_2" in str(info.value) and "'conv2'" in str(info.value)


def test_unmatched_glob_is_an_error_too():
    with pytest.raises(ConfigError, match="head/"):
        resolve_exclusions(tiny.residual_cnn(), ["head/*"])


def test_old_opset_is_refused():
    with pytest.raises(ConfigError, match="opset 12"):
        check_model(tiny.residual_cnn(opset=12))


def test_model_without_weights_is_refused():
    with pytest.raises(ModelError, match="nothing to build"):
        check_model(tiny.no_weights_model())


def test_input_side_regions_end_on_a_stage_boundary():
    model = tiny.hardswish_cnn()
    quantized = select_nodes(quantizable_nodes(model), CPU)
    # the stride-2 conv2 starts a new stage; conv1 + its HardSwish are the first stage
    assert input_side_regions(model, quantized) == [["conv1", "hswish1"]]
