"""The calibrate stage end to end on tiny ONNX models (no torch): cache format, determinism, bad data."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from click.testing import CliRunner
from onnx import TensorProto, helper

from quantkit.artifacts import ModelWorkspace
from quantkit.calib.cache import read_trt_cache
from quantkit.calibrate import calibrate, calibration_fingerprint
from quantkit.cli import cli
from quantkit.config import load_config
from quantkit.errors import DataError, StaleArtifactError
from quantkit.export import export_model
from quantkit.ui import Console
from helpers import tiny_conv_model

QUIET = Console(verbosity=-1)


@pytest.fixture
def setup(tmp_path):
    """(config path factory, data dir): an ONNX-source config over .npy data."""
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", np.random.default_rng(1).normal(size=(20, 1, 8, 8)).astype(np.float32))

    def make(**calibration):
        model = tmp_path / "tiny.onnx"
        if calibration.pop("write_model", True):
            tiny_conv_model(model, calibration.pop("zero_second_conv", False))
        cfg = {
            "name": "tiny",
            "model": {"source": "onnx", "path": str(model),
                      "inputs": [{"name": "x", "shape": ["batch", 1, 8, 8]}]},
            "calibration": {"data": str(data), "batch_size": 8, **calibration},
            "build": {"profile": {"min": 1, "opt": 8, "max": 8}},
            "bench": {"batch_sizes": [1, 8]},
        }
        path = tmp_path / "tiny.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return load_config(path)

    return make, data


def run_stages(cfg, root):
    ws = ModelWorkspace(root, cfg.name)
    export_model(cfg, ws, QUIET)
    return ws, calibrate(cfg, ws, QUIET)


def test_cache_format_matches_calib_json(setup, tmp_path):
    make, _ = setup
    ws, result = run_stages(make(), tmp_path / "a")
    cache = read_trt_cache(ws.path("calib.cache").read_bytes())
    assert ws.path("calib.cache").read_bytes().startswith(b"TRT-101601-EntropyCalibration2\n")
    report = json.loads(ws.path("calib.json").read_text())
    assert sorted(cache.scales) == sorted(report["tensors"])
    assert "x" in cache.scales and "r1" in cache.scales
    for name, tensor in report["tensors"].items():
        assert cache.scales[name] == pytest.approx(tensor["amax"] / 127, rel=1e-6)
        assert tensor["method"] == "entropy"
    assert result.samples == 20 and result.batches == 3
    assert report["fingerprint"] == json.loads(json.dumps(calibration_fingerprint(make(), ws)))


def test_minmax_equals_the_true_activation_extremes(setup, tmp_path):
    make, data = setup
    cfg = make(method="minmax")
    ws, _ = run_stages(cfg, tmp_path / "a")
    assert ws.path("calib.cache").read_bytes().startswith(b"TRT-101601-MinMaxCalibration\n")
    tensors = json.loads(ws.path("calib.json").read_text())["tensors"]
    x = np.load(data / "x.npy")
    model = onnx.load(str(ws.onnx_model))
    model.graph.output.append(helper.make_tensor_value_info("r1", TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    _, r1 = session.run(["y", "r1"], {"x": x})
    assert tensors["x"]["amax"] == pytest.approx(float(np.abs(x).max()), rel=1e-6)
    assert tensors["x"]["min"] == pytest.approx(float(x.min()), rel=1e-6)
    assert tensors["r1"]["amax"] == pytest.approx(float(r1.max()), rel=1e-5)
    assert tensors["r1"]["min"] == 0.0


def test_two_runs_give_byte_identical_outputs(setup, tmp_path):
    make, _ = setup
    ws_a, _ = run_stages(make(), tmp_path / "a")
    ws_b, _ = run_stages(make(), tmp_path / "b")
    assert ws_a.path("calib.cache").read_bytes() == ws_b.path("calib.cache").read_bytes()
    assert ws_a.path("calib.json").read_bytes() == ws_b.path("calib.json").read_bytes()


def test_per_tensor_override_and_percentile(setup, tmp_path):
    make, _ = setup
    ws, _ = run_stages(make(method="percentile", percentile=99.0, overrides={"r*": {"method": "minmax"}}),
                       tmp_path / "a")
    tensors = json.loads(ws.path("calib.json").read_text())["tensors"]
    assert tensors["r1"]["method"] == "minmax" and tensors["r1"]["clipped_fraction"] == 0.0
    assert tensors["x"]["method"] == "percentile" and tensors["x"]["params"]["percentile"] == 99.0
    assert 0.0 < tensors["x"]["clipped_fraction"] <= 0.011


def test_memory_bound_splits_batches_without_changing_minmax(setup, tmp_path):
    make, _ = setup
    ws_a, _ = run_stages(make(method="minmax"), tmp_path / "a")
    ws_b, _ = run_stages(make(method="minmax", batch_size=20, memory_limit_mb=16), tmp_path / "b")
    assert ws_a.path("calib.cache").read_bytes() == ws_b.path("calib.cache").read_bytes()


def test_statistics_threads_do_not_change_outputs(setup, tmp_path, monkeypatch):
    import quantkit.calibrate as calibrate_module

    make, _ = setup
    ws_a, _ = run_stages(make(batch_size=3), tmp_path / "a")
    monkeypatch.setattr(calibrate_module, "_MAX_STATS_THREADS", 1)
    ws_b, _ = run_stages(make(batch_size=3), tmp_path / "b")
    assert ws_a.path("calib.cache").read_bytes() == ws_b.path("calib.cache").read_bytes()
    assert ws_a.path("calib.json").read_bytes() == ws_b.path("calib.json").read_bytes()


def test_calibration_session_keeps_one_batch_of_buffers(setup, tmp_path):
    from quantkit.calibrate import _augmented_session

    make, _ = setup
    ws, _ = run_stages(make(), tmp_path / "a")
    session = _augmented_session(ws.onnx_model, ["x", "r1", "y"])
    assert session.get_session_options().enable_mem_pattern is False  # see _augmented_session
    assert [o.name for o in session.get_outputs()] == ["y", "x", "r1"]


def residual_conv_model(path, channels: int):
    """x[batch,3,12,12] -> Conv(c) -> Relu -> Conv(c) -> Add(skip) -> Relu -> y: ORT's NCHWc territory."""
    rng = np.random.default_rng(2)
    w1 = rng.normal(size=(channels, 3, 3, 3)).astype(np.float32)
    w2 = (rng.normal(size=(channels, channels, 3, 3)) / channels).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu2"),
    ]
    graph = helper.make_graph(
        nodes, "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", channels, 12, 12])],
        [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.mark.parametrize("channels", [16, 32, 24, 8])
def test_blocked_layout_outputs_give_identical_results(tmp_path, monkeypatch, channels):
    """Outputs taken from ORT's blocked tensors (no ReorderOutput copies) must not change a byte."""
    import quantkit.calibrate as calibrate_module

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", np.random.default_rng(3).normal(size=(20, 3, 12, 12)).astype(np.float32))
    residual_conv_model(tmp_path / "m.onnx", channels)
    cfg_path = tmp_path / "m.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "name": "m",
        "model": {"source": "onnx", "path": str(tmp_path / "m.onnx"),
                  "inputs": [{"name": "x", "shape": ["batch", 3, 12, 12]}]},
        "calibration": {"data": str(data), "batch_size": 8},
        "build": {"profile": {"min": 1, "opt": 8, "max": 8}},
        "bench": {"batch_sizes": [1, 8]},
    }))
    cfg = load_config(cfg_path)
    ws_blocked, _ = run_stages(cfg, tmp_path / "blocked")
    monkeypatch.setattr(calibrate_module, "_without_output_reorders", lambda *args: None)
    ws_plain, _ = run_stages(cfg, tmp_path / "plain")
    assert ws_blocked.path("calib.cache").read_bytes() == ws_plain.path("calib.cache").read_bytes()
    assert ws_blocked.path("calib.json").read_bytes() == ws_plain.path("calib.json").read_bytes()
    monkeypatch.undo()
    session = calibrate_module._augmented_session(ws_blocked.onnx_model, ["x", "c1", "r1", "c2", "a", "y"])
    blocked = getattr(session, "_quantkit_blocked_outputs", None)
    if channels % 16 == 0 and blocked is None and "AVX512" in str(ort.get_device()):
        pytest.fail("expected blocked outputs on this CPU")
    if blocked is not None:  # they hold exactly the target's values (another order)
        model = onnx.load(str(ws_blocked.onnx_model))
        for name in ("c1", "r1", "c2", "a"):
            model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
        plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.load(data / "x.npy")[:5]
        names = ["c1", "r1", "c2", "a"]
        for got, want in zip(session.run(names, {"x": x}), plain.run(names, {"x": x})):
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.sort(got, axis=None), np.sort(want, axis=None))


def test_nan_in_an_activation_names_tensor_and_batch(setup, tmp_path):
    make, data = setup
    x = np.load(data / "x.npy")
    x[13, 0, 2, 2] = np.nan
    np.save(data / "x.npy", x)
    with pytest.raises(DataError, match=r"tensor 'x' has NaN/Inf values in batch 1"):
        run_stages(make(), tmp_path / "a")


def test_all_zero_tensor_is_recorded_not_a_crash(setup, tmp_path):
    make, _ = setup
    ws, result = run_stages(make(zero_second_conv=True), tmp_path / "a")
    tensors = json.loads(ws.path("calib.json").read_text())["tensors"]
    zero = [name for name, t in tensors.items() if t["amax"] == 0.0]
    assert zero == result.all_zero
    cache = read_trt_cache(ws.path("calib.cache").read_bytes())
    assert all(cache.scales[name] > 0 for name in cache.scales)


def test_empty_data_directory_is_refused(setup, tmp_path):
    make, data = setup
    (data / "x.npy").unlink()
    with pytest.raises(DataError, match="refusing to run on nothing"):
        run_stages(make(), tmp_path / "a")


def test_stale_model_is_refused(setup, tmp_path):
    make, _ = setup
    cfg = make()
    ws, _ = run_stages(cfg, tmp_path / "a")
    tiny_conv_model(tmp_path / "tiny.onnx", zero_second_conv=True)  # the source model changed
    with pytest.raises(StaleArtifactError, match="onnx_sha256"):
        calibrate(make(write_model=False), ws, QUIET)


def test_inspect_prints_and_diffs_caches(setup, tmp_path):
    make, _ = setup
    ws_a, _ = run_stages(make(), tmp_path / "a")
    ws_b, _ = run_stages(make(method="minmax"), tmp_path / "b")
    runner = CliRunner()
    shown = runner.invoke(cli, ["inspect", str(ws_a.path("calib.cache"))])
    assert shown.exit_code == 0 and "TRT-101601-EntropyCalibration2" in shown.output
    diff = runner.invoke(cli, ["inspect", "--json", str(ws_a.path("calib.cache")), str(ws_b.path("calib.json"))])
    payload = json.loads(diff.stdout)
    assert sum(payload["counts"].values()) == len(read_trt_cache(ws_a.path("calib.cache").read_bytes()).scales)
    bad = tmp_path / "bad.cache"
    bad.write_text("TRT-8601-EntropyCalibration2\nx 3c010204\n")
    broken = runner.invoke(cli, ["inspect", str(bad)])
    assert broken.exit_code == 1 and "bad.cache: calibration cache line 2" in broken.output
