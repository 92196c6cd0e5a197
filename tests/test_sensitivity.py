"""The sensitivity search end to end on tiny onnx.helper models: ranking, choice, reuse, build, CLI, config."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import yaml
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from quantkit import build, sensitivity
from quantkit.artifacts import Manifest, ModelWorkspace
from quantkit.backends.onnxruntime import build as ort_build
from quantkit.cli import cli
from quantkit.config import load_config
from quantkit.errors import ConfigError, DataError
from quantkit.qdq import testing as tiny
from quantkit.ui import Console

QUIET = Console(verbosity=-1)


def fragile_cnn(seed: int = 0) -> onnx.ModelProto:
    """conv1 -> relu -> [+1000 on channel 0] -> conv2 -> relu -> conv3 -> relu -> gap -> flatten -> fc.

    The constant Add is not quantizable (a bias), so its output is quantized only as conv2's input:
    one uint8 range for a channel at ~1000 and seven at ~1 wipes out the seven (conv2 barely uses
    channel 0). conv2 is the one fragile node; in float it reads the exact tensor.
    """
    rng = np.random.default_rng(seed)
    c = 8
    spike = np.zeros((1, c, 1, 1))
    spike[0, 0] = 1000.0
    w2 = rng.normal(0, 0.3, (c, c, 3, 3))
    w2[:, 0] = 1e-4

    def init(name, array):
        return numpy_helper.from_array(np.asarray(array, np.float32), name)

    inits = [init("w1", rng.normal(0, 0.4, (c, 3, 3, 3))), init("b1", rng.normal(0, 0.1, c)), init("spike", spike),
             init("w2", w2), init("b2", rng.normal(0, 0.1, c)),
             init("w3", rng.normal(0, 0.3, (c, c, 3, 3))), init("b3", rng.normal(0, 0.1, c)),
             init("wf", rng.normal(0, 0.5, (5, c))), init("bf", rng.normal(0, 0.1, 5))]
    pads = {"pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", **pads),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Add", ["r1", "spike"], ["s"], name="outlier"),
        helper.make_node("Conv", ["s", "w2", "b2"], ["c2"], name="conv2", **pads),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3", **pads),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "fragile", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                               ["batch", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


@pytest.fixture(autouse=True)
def fresh_calibration(monkeypatch):
    """calib.json here is written by quantkit.qdq.testing (no calibration manifest): treat it as fresh."""
    monkeypatch.setattr(build, "require_fresh_calibration", lambda cfg, ws: None)
    monkeypatch.setattr(ort_build, "GUARD_BUDGET_S", 0.02)


def make_project(tmp_path, model: onnx.ModelProto, auto: dict | None = None, fallback=(), eval_samples=32,
                 name="tiny"):
    """Config (source: onnx) with .npz calibration and evaluation data; workspace with model.onnx + calib.json."""
    onnx.save(model, str(tmp_path / "src.onnx"))
    calib = tiny.random_feeds(model, batch=16, seed=1)
    np.savez(tmp_path / "calib.npz", **calib)
    np.savez(tmp_path / "eval.npz", **tiny.random_feeds(model, batch=eval_samples, seed=2))
    spec = model.graph.input[0]
    shape = ["batch"] + [d.dim_value for d in spec.type.tensor_type.shape.dim[1:]]
    config = {
        "name": name,
        "model": {"source": "onnx", "path": "src.onnx", "inputs": [{"name": spec.name, "shape": shape}]},
        "calibration": {"data": "calib.npz", "batch_size": 8},
        "build": {"backend": "onnxruntime", "fallback": {"nodes": list(fallback), "auto": auto} if auto is not None
                  else list(fallback), "profile": {"min": 1, "opt": 8, "max": 16}},
        "bench": {"batch_sizes": [1, 8], "data": "eval.npz"},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    ws = ModelWorkspace(tmp_path / "work", name)
    ws.root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(ws.onnx_model))
    tiny.write_minmax_calibration(model, [calib], ws.path("calib.json"))
    return path, load_config(path), ws


COSINE_BUDGET = {"metric": "cosine", "target": 0.99, "max_nodes": 2}


# --------------------------------------------------------------------------- the search


def test_the_fragile_node_is_ranked_first_and_chosen(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET)
    result = sensitivity.run_sensitivity(cfg, ws, QUIET)
    ranked = sorted(result.nodes, key=lambda row: row["rank"])
    assert ranked[0]["name"] == "conv2" and ranked[0]["op_type"] == "Conv"
    assert result.baseline["cosine"] < 0.99
    assert result.met and result.chosen == ["conv2"] and result.final["cosine"] >= 0.99
    assert {row["name"] for row in result.nodes} == {"conv1", "conv2", "conv3", "gap", "fc"}
    assert ranked[0]["leave_one_out"]["cosine"] >= 0.99 and ranked[0]["chosen"]
    manifest = Manifest.read(ws.path(sensitivity.MANIFEST))
    assert manifest.stage == "sensitivity" and manifest.details["chosen"] == ["conv2"]
    assert manifest.fingerprint == sensitivity.sensitivity_fingerprint(cfg, ws)
    table = sensitivity.format_table(result)
    assert table.splitlines()[1].split()[:3] == ["1", "conv2", "Conv"] and "yes" in table.splitlines()[1]
    assert "1 of 5 nodes in float" in sensitivity.describe(result)


def test_a_fresh_result_is_reused_and_a_stale_one_recomputed(tmp_path, monkeypatch):
    path, cfg, ws = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET)
    first = sensitivity.run_sensitivity(cfg, ws, QUIET)
    monkeypatch.setattr(sensitivity, "_search", lambda *a, **k: pytest.fail("searched although fresh"))
    again = sensitivity.run_sensitivity(cfg, ws, QUIET)
    assert again.reused and again.chosen == first.chosen and again.nodes == first.nodes
    monkeypatch.undo()
    monkeypatch.setattr(build, "require_fresh_calibration", lambda cfg, ws: None)
    raw = yaml.safe_load(path.read_text())
    raw["build"]["fallback"]["auto"]["target"] = 0.995  # another budget: stale
    path.write_text(yaml.safe_dump(raw))
    cfg2 = load_config(path)
    assert ws.staleness(sensitivity.MANIFEST, sensitivity.sensitivity_fingerprint(cfg2, ws)) is not None
    assert not sensitivity.run_sensitivity(cfg2, ws, QUIET).reused


def test_a_result_written_by_another_version_is_recomputed(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET)
    ws.write_manifest(sensitivity.MANIFEST, Manifest("sensitivity", sensitivity.sensitivity_fingerprint(cfg, ws), {},
                                                     {}, {"chosen": ["conv2"]}))
    result = sensitivity.run_sensitivity(cfg, ws, QUIET)
    assert not result.reused and result.nodes


def test_budget_met_by_all_int8_means_no_fallback(tmp_path):
    _, cfg, ws = make_project(tmp_path, tiny.residual_cnn(), auto={"metric": "cosine", "target": 0.9})
    result = sensitivity.run_sensitivity(cfg, ws, QUIET)
    assert result.met and result.chosen == [] and result.evaluations == 1
    assert "no fallback needed" in sensitivity.describe(result)


def test_unreachable_budget_is_reported_and_the_best_set_within_the_cap_kept(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto={"metric": "cosine", "target": 1.0, "max_nodes": 1})
    result = sensitivity.run_sensitivity(cfg, ws, QUIET)
    assert not result.met and result.cap == 1 and result.chosen == ["conv2"]
    message = sensitivity.unmet_message(result)
    assert "cannot be met within the cap of 1" in message and "cosine" in message


def test_top1_agreement_needs_a_classifier_output(tmp_path):
    _, cfg, ws = make_project(tmp_path, tiny.hardswish_cnn(), auto={"metric": "top1_agreement"})
    with pytest.raises(ConfigError, match="needs a first output shaped \\[N, C\\].*metric: cosine"):
        sensitivity.run_sensitivity(cfg, ws, QUIET)


def test_holdout_reports_the_chosen_set_on_samples_it_was_not_chosen_on(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto={**COSINE_BUDGET, "holdout": 0.25})
    result = sensitivity.run_sensitivity(cfg, ws, QUIET)
    assert result.samples["select"] == 24 and result.samples["holdout"] == 8
    assert result.holdout["final"]["cosine"] > result.holdout["baseline"]["cosine"]


def test_too_few_samples_for_the_holdout(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto={**COSINE_BUDGET, "samples": None, "holdout": 0.01},
                              eval_samples=20)
    with pytest.raises(DataError, match="cannot be split with holdout"):
        sensitivity.run_sensitivity(cfg, ws, QUIET)


def test_config_exclusions_are_kept_out_of_the_search(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET, fallback=["conv2"])
    result = sensitivity.run_sensitivity(cfg, ws, QUIET)
    assert "conv2" not in {row["name"] for row in result.nodes}
    assert result.met and result.chosen == []  # conv2 in float already meets the budget


# --------------------------------------------------------------------------- the build


def test_build_applies_the_chosen_nodes_with_reason_sensitivity(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET)
    result = build.build_engine(cfg, ws, QUIET)
    nodes = {node["name"]: node for node in result.nodes}
    assert nodes["conv2"]["cpu"] == {"precision": "fp32", "reason": "sensitivity"}
    assert nodes["conv2"]["trt"] == {"precision": "fp16", "reason": "sensitivity"}
    assert nodes["conv1"]["cpu"]["precision"] == "int8"
    assert result.trt_fp16 == ["conv2"] and result.cosine["cpu"] > 0.99
    details = Manifest.read(ws.path(build.MANIFEST)).details
    assert details["sensitivity"]["nodes"] == ["conv2"] and details["sensitivity"]["met"]
    fingerprint = build.build_fingerprint(cfg, ws)
    assert fingerprint["sensitivity"] == sensitivity.sensitivity_fingerprint(cfg, ws)
    assert ws.staleness(build.MANIFEST, fingerprint) is None
    assert "kept in float by the sensitivity search" in build.describe(result)


def test_build_warns_when_the_budget_cannot_be_met(tmp_path, capsys):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), auto={"metric": "cosine", "target": 1.0, "max_nodes": 1})
    result = build.build_engine(cfg, ws, Console(), guard=False)
    assert "cannot be met within the cap of 1" in capsys.readouterr().err
    assert result.sensitivity["met"] is False and result.sensitivity["nodes"] == ["conv2"]


def test_build_without_auto_has_no_sensitivity(tmp_path):
    _, cfg, ws = make_project(tmp_path, fragile_cnn(), fallback=["conv3"])
    result = build.build_engine(cfg, ws, QUIET, guard=False)
    assert result.sensitivity is None and build.build_fingerprint(cfg, ws)["sensitivity"] is None
    assert not ws.path(sensitivity.MANIFEST).exists()


# --------------------------------------------------------------------------- the command


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


def test_cli_prints_the_table_and_the_next_command(tmp_path):
    path, _, ws = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET)
    result = invoke("--workdir", str(tmp_path / "work"), "sensitivity", str(path))
    assert result.exit_code == 0, result.output
    assert "conv2" in result.stdout and "rank" in result.stdout
    assert "next: quantkit build-engine" in result.stderr
    assert ws.path(sensitivity.MANIFEST).exists()


def test_cli_json(tmp_path):
    path, _, _ = make_project(tmp_path, fragile_cnn(), auto=COSINE_BUDGET)
    result = invoke("--workdir", str(tmp_path / "work"), "sensitivity", "--json", str(path))
    assert result.exit_code == 0
    payload = json.loads(result.stdout)
    assert payload["chosen"] == ["conv2"] and payload["met"] is True


def test_cli_unmet_budget_warns_and_strict_exits_1(tmp_path):
    path, _, _ = make_project(tmp_path, fragile_cnn(), auto={"metric": "cosine", "target": 1.0, "max_nodes": 1})
    loose = invoke("--workdir", str(tmp_path / "work"), "sensitivity", str(path))
    assert loose.exit_code == 0 and "warning: the accuracy budget" in loose.stderr
    strict = invoke("--workdir", str(tmp_path / "work"), "sensitivity", "--strict", str(path))
    assert strict.exit_code == 1 and "error: the accuracy budget" in strict.stderr
    assert "Traceback" not in strict.output


def test_cli_without_auto_uses_the_defaults_and_says_how_to_apply(tmp_path):
    path, _, _ = make_project(tmp_path, tiny.residual_cnn())
    result = invoke("--workdir", str(tmp_path / "work"), "sensitivity", str(path))
    assert result.exit_code == 0
    assert "build.fallback.auto.enabled: true" in result.stderr


def test_cli_help_has_an_example():
    result = invoke("sensitivity", "--help")
    assert result.exit_code == 0 and "quantkit sensitivity configs/" in result.output


# --------------------------------------------------------------------------- config


def write_config(make_config, fallback):
    return make_config({"build.fallback": fallback})


def test_the_list_form_still_works_and_dumps_unchanged(make_config):
    cfg = load_config(write_config(make_config, ["/head/*", "Sigmoid"]))
    assert cfg.build.fallback_patterns == ["/head/*", "Sigmoid"] and cfg.build.auto_fallback is None
    assert cfg.build.model_dump(mode="json")["fallback"] == ["/head/*", "Sigmoid"]  # same build fingerprints


def test_the_mapping_form(make_config):
    cfg = load_config(write_config(make_config, {"nodes": ["conv1"], "auto": {"target": 0.95, "max_nodes": 3}}))
    assert cfg.build.fallback_patterns == ["conv1"]
    auto = cfg.build.auto_fallback
    assert auto.metric == "top1_agreement" and auto.target == 0.95 and auto.cap(98) == 3
    assert cfg.build.model_dump(mode="json")["fallback"]["auto"]["target"] == 0.95
    assert load_config(write_config(make_config, {"auto": {}})).build.auto_fallback.cap(98) == 9  # 10 %
    disabled = load_config(write_config(make_config, {"auto": {"enabled": False}}))
    assert disabled.build.auto_fallback is None and disabled.build.fallback.auto is not None


@pytest.mark.parametrize("fallback, message", [
    ({"auto": {"taget": 0.9}}, "build.fallback.auto.taget: unknown key (did you mean 'target'?)"),
    ({"atuo": {}}, "build.fallback.atuo: unknown key (did you mean 'auto'?)"),
    ({"auto": {"metric": "top5"}}, "build.fallback.auto.metric: Input should be 'top1_agreement' or 'cosine'"),
    ({"auto": {"target": 1.5}}, "build.fallback.auto.target: Input should be less than or equal to 1"),
    ({"auto": {"max_nodes": 3, "max_fraction": 0.2}}, "max_nodes and max_fraction both cap the fallback set"),
    ({"auto": {"samples": 4, "holdout": 0.1}}, "holdout 0.1 of 4 samples leaves no samples to report on"),
    ({"auto": {"candidates": "8"}}, "build.fallback.auto.candidates: Input should be a valid integer"),
    ("Conv", "build.fallback: expected a list of node patterns or a mapping"),
])
def test_bad_auto_settings_fail_with_the_key_and_line(make_config, fallback, message):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(make_config, fallback))
    assert message in str(info.value)
