"""The build-engine stage end to end on tiny onnx.helper models (no torch, no export)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import onnx
import pytest
import yaml

from quantkit import build
from quantkit.artifacts import Manifest, ModelWorkspace
from quantkit.backends.onnxruntime import build as ort_build
from quantkit.config import load_config
from quantkit.errors import ConfigError, MissingArtifactError, ModelError, NotAvailableError, StaleArtifactError
from quantkit.qdq import testing as tiny
from quantkit.qdq.trt import fp16_nodes
from quantkit.qdq.trt_check import check_trt_qdq
from quantkit.ui import Console

OUTPUTS = (build.CPU_ARTIFACT, build.TRT_ARTIFACT, build.MANIFEST)


@pytest.fixture(autouse=True)
def quick_guard(monkeypatch):
    monkeypatch.setattr(ort_build, "GUARD_BUDGET_S", 0.02)


@pytest.fixture()
def no_freshness_check(monkeypatch):
    """quantkit.calibrate may not exist yet: treat calib.json as fresh."""
    monkeypatch.setattr(build, "require_fresh_calibration", lambda cfg, ws: None)


def make_project(tmp_path, model: onnx.ModelProto, fallback=(), calibrate=True, name="tiny"):
    """A config (source: onnx), its .npz calibration data, and a workspace with model.onnx (+ calib.json)."""
    model_path = tmp_path / "src.onnx"
    onnx.save(model, str(model_path))
    feeds = tiny.random_feeds(model, batch=16, seed=1)
    np.savez(tmp_path / "calib.npz", **feeds)
    spec = model.graph.input[0]
    shape = ["batch"] + [d.dim_value for d in spec.type.tensor_type.shape.dim[1:]]
    config = {
        "name": name,
        "model": {"source": "onnx", "path": "src.onnx", "inputs": [{"name": spec.name, "shape": shape}]},
        "calibration": {"data": "calib.npz", "batch_size": 8},
        "build": {"backend": "auto", "fallback": list(fallback), "profile": {"min": 1, "opt": 8, "max": 16}},
        "bench": {"batch_sizes": [1, 8]},
    }
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(tmp_path / "tiny.yaml")
    ws = ModelWorkspace(tmp_path / "work", name)
    ws.root.mkdir(parents=True)
    onnx.save(model, str(ws.onnx_model))
    if calibrate:
        tiny.write_minmax_calibration(model, [feeds], ws.path("calib.json"))
    return cfg, ws


def written(ws):
    return [name for name in OUTPUTS if ws.path(name).exists()]


def test_build_writes_both_flavours_and_manifest(tmp_path, no_freshness_check, capsys):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn(), fallback=["head_sigmoid"])
    result = build.build_engine(cfg, ws, Console(), backend="onnxruntime", exclude=["conv2"])
    assert written(ws) == list(OUTPUTS)
    manifest = Manifest.read(ws.path(build.MANIFEST))
    assert manifest.stage == "build-engine"
    assert manifest.fingerprint == build.build_fingerprint(cfg, ws, backend="onnxruntime", exclude=["conv2"])
    assert ws.staleness(build.MANIFEST, manifest.fingerprint) is None
    details = manifest.details
    nodes = {n["name"]: n for n in details["nodes"]}
    assert nodes["conv1"]["cpu"] == {"precision": "int8", "reason": None}
    assert nodes["conv2"]["cpu"] == {"precision": "fp32", "reason": "config"}
    assert nodes["conv2"]["trt"] == {"precision": "fp16", "reason": "config"}
    assert nodes["head_sigmoid"]["cpu"]["reason"] == "config" and "trt" not in nodes["head_sigmoid"]
    assert details["exclusions"] == {"head_sigmoid": ["head_sigmoid"], "conv2": ["conv2"]}
    guard = details["cpu"]["speed_guard"]
    assert guard["batch"] == 8 and guard["threads"] == 2 and guard["fp32_ms"] > 0 and guard["int8_ms"] > 0
    assert details["cpu"]["fused_ops"]["QLinearConv"] == 2
    assert details["trt"]["fp16_nodes"] == ["conv2"] and details["trt"]["check_problems"] == []
    assert details["output_cosine_vs_fp32"]["cpu"] > 0.99 and details["output_cosine_vs_fp32"]["trt"] > 0.99
    trt_model = onnx.load(str(ws.path(build.TRT_ARTIFACT)))
    assert check_trt_qdq(trt_model) == [] and fp16_nodes(trt_model) == ["conv2"]
    line = build.describe(result)
    assert "\n" not in line and "model.int8.onnx" in line and "x FP32" in line
    assert "speed guard" in capsys.readouterr().err
    json.dumps(result.to_json())


@pytest.mark.parametrize("exclude, precision, reason", [((), "int8", None), (("se_gate",), "fp32", "config")])
def test_folded_hardsigmoid_is_reported_as_a_node(tmp_path, no_freshness_check, exclude, precision, reason):
    """The squeeze-excite gate runs in INT8 (folded into se_fc2's Q) or, excluded, in float: build.json says which."""
    cfg, ws = make_project(tmp_path, tiny.squeeze_excite_cnn())
    result = build.build_engine(cfg, ws, Console(verbosity=-1), exclude=list(exclude), guard=False)
    gate = next(n for n in result.to_json()["nodes"] if n["name"] == "se_gate")
    assert gate["op_type"] == "HardSigmoid" and "trt" not in gate  # the TensorRT flavour leaves it to TensorRT
    assert gate["cpu"]["precision"] == precision and gate["cpu"]["reason"] == reason
    written = onnx.load(str(ws.path(build.CPU_ARTIFACT)))
    assert ("HardSigmoid" in [n.op_type for n in written.graph.node]) == bool(exclude)


def test_unknown_exclusion_fails_before_writing(tmp_path, no_freshness_check):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn())
    with pytest.raises(ConfigError) as info:
        build.build_engine(cfg, ws, Console(verbosity=-1), exclude=["conv_3"])
    assert "'conv3'" in str(info.value)
    assert written(ws) == []


def test_explicit_tensorrt_without_tensorrt_is_refused_before_writing(tmp_path, no_freshness_check, monkeypatch):
    monkeypatch.setattr(build, "tensorrt_available", lambda: (False, "TensorRT is not installed"))
    cfg, ws = make_project(tmp_path, tiny.residual_cnn())
    with pytest.raises(NotAvailableError, match=r"--backend tensorrt: TensorRT is not installed"):
        build.build_engine(cfg, ws, Console(verbosity=-1), backend="tensorrt")
    assert written(ws) == []


def test_auto_picks_tensorrt_when_it_and_a_gpu_are_present(monkeypatch):
    monkeypatch.setattr(build, "tensorrt_available", lambda: (True, "TensorRT and 1 GPU(s) found"))
    assert build.select_backend("auto") == ("tensorrt", "auto: TensorRT and 1 GPU(s) found")
    assert build.select_backend("onnxruntime") == ("onnxruntime", "requested")


def test_auto_backend_says_why(monkeypatch):
    monkeypatch.setattr(build, "tensorrt_available", lambda: (False, "TensorRT is not installed"))
    assert build.select_backend("auto") == ("onnxruntime", "auto: TensorRT is not installed")


def test_missing_calibration(tmp_path, no_freshness_check):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn(), calibrate=False)
    with pytest.raises(MissingArtifactError, match="calib.json"):
        build.build_engine(cfg, ws, Console(verbosity=-1), guard=False)
    assert written(ws) == []


def test_stale_calibration_via_calibration_fingerprint(tmp_path, monkeypatch):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn())
    fake = types.ModuleType("quantkit.calibrate")
    fake.calibration_fingerprint = lambda cfg, ws: {"model_sha256": "new"}
    monkeypatch.setitem(sys.modules, "quantkit.calibrate", fake)
    payload = json.loads(ws.path("calib.json").read_text())
    payload.update(Manifest("calibrate", {"model_sha256": "old"}, {}, {}, {}).to_json())
    ws.path("calib.json").write_text(json.dumps(payload))
    with pytest.raises(StaleArtifactError, match="model_sha256"):
        build.build_engine(cfg, ws, Console(verbosity=-1), guard=False)
    assert written(ws) == []
    # allow_stale uses it anyway
    build.build_engine(cfg, ws, Console(verbosity=-1), allow_stale=True, guard=False)
    assert written(ws) == list(OUTPUTS)


def test_calibration_for_another_model(tmp_path, no_freshness_check):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn())
    payload = json.loads(ws.path("calib.json").read_text())
    del payload["tensors"]["r2"]
    ws.path("calib.json").write_text(json.dumps(payload))
    with pytest.raises(StaleArtifactError, match="'r2'"):
        build.build_engine(cfg, ws, Console(verbosity=-1), guard=False)
    assert written(ws) == []


def test_old_opset_fails_before_writing(tmp_path, no_freshness_check):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn(opset=12))
    with pytest.raises(ConfigError, match="opset"):
        build.build_engine(cfg, ws, Console(verbosity=-1), guard=False)
    assert written(ws) == []


def test_nothing_quantizable(tmp_path, no_freshness_check):
    cfg, ws = make_project(tmp_path, tiny.no_weights_model())
    with pytest.raises(ModelError, match="nothing to build"):
        build.build_engine(cfg, ws, Console(verbosity=-1), guard=False)
    assert written(ws) == []


def test_excluding_everything_is_refused(tmp_path, no_freshness_check):
    cfg, ws = make_project(tmp_path, tiny.residual_cnn())
    with pytest.raises(ConfigError, match="leave no"):
        build.build_engine(cfg, ws, Console(verbosity=-1), exclude=["Conv", "Gemm"], guard=False)


def _many(fp32_ms, full_ms, candidate_ms):
    """A fake compare_many over [FP32, all-INT8, candidates...]: fixed medians, speedups vs FP32."""
    def fake(sessions, feeds, budget_s, **_):
        medians = [fp32_ms, full_ms] + [candidate_ms] * (len(sessions) - 2)
        return medians, [fp32_ms / m for m in medians], 3
    return fake


def test_speed_guard_keeps_a_losing_stage_in_float(tmp_path, no_freshness_check, monkeypatch):
    """Fake timings: INT8 loses, the float-prefix candidate is 2x faster, so its nodes become automatic."""
    monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, **_: (10.0, 11.0, 10 / 11, 3))
    monkeypatch.setattr(ort_build, "compare_many", _many(10.0, 11.0, 5.0))
    cfg, ws = make_project(tmp_path, tiny.hardswish_cnn())
    result = build.build_engine(cfg, ws, Console(verbosity=-1))
    assert result.automatic == ["conv1", "hswish1"]
    nodes = {n["name"]: n for n in result.to_json()["nodes"]}
    assert nodes["conv1"]["cpu"] == {"precision": "fp32", "reason": "automatic"}
    assert nodes["conv1"]["trt"]["precision"] == "int8"  # the guard only concerns the CPU flavour
    assert result.guard_steps[0].accepted
    assert "QLinearConv" in result.fused_ops and result.fused_ops["QLinearConv"] == 2


def test_speed_guard_does_not_search_when_int8_clearly_pays(tmp_path, no_freshness_check, monkeypatch):
    monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, **_: (10.0, 2.0, 5.0, 3))

    def forbidden(*_args, **_kwargs):
        raise AssertionError("no float regions should be tried at 5x")

    monkeypatch.setattr(ort_build, "compare_many", forbidden)
    cfg, ws = make_project(tmp_path, tiny.hardswish_cnn())
    result = build.build_engine(cfg, ws, Console(verbosity=-1))
    assert result.automatic == [] and result.guard_steps == [] and result.timing.speedup == 5.0


def test_slower_int8_is_reported(tmp_path, no_freshness_check, monkeypatch, capsys):
    monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, **_: (10.0, 12.0, 10 / 12, 3))
    monkeypatch.setattr(ort_build, "compare_many", _many(10.0, 12.0, 12.0))
    cfg, ws = make_project(tmp_path, tiny.hardswish_cnn())
    result = build.build_engine(cfg, ws, Console())
    assert "slower than FP32" in capsys.readouterr().err
    assert result.to_json()["cpu"]["speed_guard"]["speedup"] < 1


def test_same_inputs_give_byte_identical_artifacts(tmp_path, no_freshness_check, monkeypatch):
    # INT8 wins on this model, so the timing-driven region search must not run and change the placement
    monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, **kw: (1.0, 0.5, 2.0, 3))
    built = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        cfg, ws = make_project(tmp_path / run, tiny.residual_cnn())
        build.build_engine(cfg, ws, Console(verbosity=-1))
        built.append(ws)
    for artifact in (build.CPU_ARTIFACT, build.TRT_ARTIFACT):
        assert built[0].path(artifact).read_bytes() == built[1].path(artifact).read_bytes(), artifact


def test_region_search_runs_only_when_int8_loses(tmp_path, no_freshness_check, monkeypatch):
    searched = []
    monkeypatch.setattr(ort_build, "input_side_regions", lambda *a, **k: searched.append(1) or [])
    for ratio in (1.5, 0.8):
        monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, r=ratio, **kw: (1.0, 1.0 / r, r, 3))
        (tmp_path / str(ratio)).mkdir()
        cfg, ws = make_project(tmp_path / str(ratio), tiny.residual_cnn())
        build.build_engine(cfg, ws, Console(verbosity=-1))
    assert len(searched) == 1


def test_guard_scores_regions_at_the_slowest_batch_size(tmp_path, no_freshness_check, monkeypatch):
    """A region that wins at batch 8 but loses at batch 1 (profile.min) must not be chosen."""
    monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, **_: (10.0, 11.0, 10 / 11, 3))

    def by_batch(sessions, feeds, budget_s, **_):
        batch = next(iter(feeds.values())).shape[0]
        candidate = 5.0 if batch == 8 else 20.0  # 2x faster at 8, 2x slower at 1
        medians = [10.0, 11.0] + [candidate] * (len(sessions) - 2)
        return medians, [10.0 / m for m in medians], 3

    monkeypatch.setattr(ort_build, "compare_many", by_batch)
    cfg, ws = make_project(tmp_path, tiny.hardswish_cnn())
    result = build.build_engine(cfg, ws, Console(verbosity=-1))
    assert result.automatic == [] and result.guard_steps and not result.guard_steps[0].accepted
    assert result.guard_steps[0].speedups == {8: 2.0, 1: 0.5}
    assert set(result.timing.by_batch) == {8, 1}


def test_near_tied_regions_are_decided_by_the_geometric_mean_over_batch_sizes():
    """MobileNetV3 as measured: both prefixes ~1.12x at batch 1 (noise decides), only one 1.32x at batch 32."""
    # speedups per candidate: [batch 32, batch 1]
    speedups = [[1.32, 1.12], [1.18, 1.13], [0.95, 0.90]]
    scores = [min(row) for row in speedups]
    assert ort_build._best_candidate(scores, speedups) == 0
    # outside the tie band the slowest batch still rules, however good the other batch size is
    assert ort_build._best_candidate([1.00, 1.20], [[2.0, 1.00], [1.3, 1.20]]) == 1


def test_rebuild_reuses_the_guard_choice_instead_of_searching(tmp_path, no_freshness_check, monkeypatch):
    monkeypatch.setattr(ort_build, "compare", lambda a, b, feeds, budget_s, **_: (10.0, 11.0, 10 / 11, 3))
    monkeypatch.setattr(ort_build, "compare_many", _many(10.0, 11.0, 5.0))
    cfg, ws = make_project(tmp_path, tiny.hardswish_cnn())
    first = build.build_engine(cfg, ws, Console(verbosity=-1))
    first_bytes = ws.path(build.CPU_ARTIFACT).read_bytes()
    assert first.automatic

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the choice of the previous build must be reused")

    monkeypatch.setattr(ort_build, "compare_many", forbidden)
    second = build.build_engine(cfg, ws, Console(verbosity=-1))
    assert second.automatic == first.automatic and second.timing.reused
    assert ws.path(build.CPU_ARTIFACT).read_bytes() == first_bytes
    # another input (here: an exclusion) means another fingerprint: the guard searches again
    monkeypatch.setattr(ort_build, "compare_many", _many(10.0, 11.0, 12.0))
    third = build.build_engine(cfg, ws, Console(verbosity=-1), exclude=["conv2"])
    assert third.automatic == [] and not third.timing.reused


@pytest.mark.parametrize("mode", ["measure", "off"])
def test_speed_guard_measure_and_off_never_change_the_placement(tmp_path, no_freshness_check, monkeypatch, mode):
    timed = []
    monkeypatch.setattr(ort_build, "compare",
                        lambda a, b, feeds, budget_s, **_: timed.append(1) or (10.0, 11.0, 10 / 11, 3))

    def forbidden(*_args, **_kwargs):
        raise AssertionError("no float regions may be tried")

    monkeypatch.setattr(ort_build, "compare_many", forbidden)
    _, ws = make_project(tmp_path, tiny.hardswish_cnn())
    cfg = load_config(tmp_path / "tiny.yaml", {"build.speed_guard": mode})
    result = build.build_engine(cfg, ws, Console(verbosity=-1))
    assert result.automatic == []
    assert (result.timing is not None and timed) if mode == "measure" else (result.timing is None and not timed)
