"""`quantkit run`: all four stages on a tiny ONNX model, then skipping what did not change."""

from __future__ import annotations

import json

import numpy as np
import yaml
from click.testing import CliRunner

from helpers import tiny_conv_model
from quantkit.cli import cli


def write_project(tmp_path, method="minmax"):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    x = np.random.default_rng(1).normal(size=(16, 1, 8, 8)).astype(np.float32)
    np.savez(data / "x.npz", x=x)
    model = tmp_path / "tiny.onnx"
    if not model.exists():
        tiny_conv_model(model)
    cfg = {
        "name": "tiny",
        "model": {"source": "onnx", "path": str(model), "inputs": [{"name": "x", "shape": ["batch", 1, 8, 8]}]},
        "calibration": {"data": str(data), "batch_size": 8, "method": method, "percentile": 99.5},
        "build": {"profile": {"min": 1, "opt": 8, "max": 8}},
        "bench": {"batch_sizes": [1, 8], "warmup_ms": 0, "duration_s": 0.02, "min_iterations": 2, "repeats": 1,
                  "gates": ["cosine>=0.9"]},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(tmp_path, config):
    result = CliRunner().invoke(cli, ["--workdir", str(tmp_path / "art"), "run", "--json", str(config)])
    assert result.exit_code == 0, result.output
    return {o["name"]: o for o in json.loads(result.stdout)}


def test_run_all_stages_then_skip_unchanged_then_rerun_from_the_changed_stage(tmp_path):
    config = write_project(tmp_path)
    first = run(tmp_path, config)
    assert list(first) == ["export", "calibrate", "build-engine", "bench"]
    assert not any(o["skipped"] for o in first.values())
    root = tmp_path / "art" / "tiny"
    for name in ("model.onnx", "calib.cache", "calib.json", "model.int8.onnx", "model.qdq.onnx", "build.json",
                 "bench.json", "bench.md"):
        assert (root / name).is_file(), name
    second = run(tmp_path, config)
    assert all(o["skipped"] for o in second.values())
    third = run(tmp_path, write_project(tmp_path, method="percentile"))
    assert third["export"]["skipped"]
    assert not third["calibrate"]["skipped"] and "method" in third["calibrate"]["reason"]
    assert not third["build-engine"]["skipped"] and not third["bench"]["skipped"]


def test_a_modified_artifact_is_not_reused(tmp_path):
    config = write_project(tmp_path)
    run(tmp_path, config)
    cache = tmp_path / "art" / "tiny" / "calib.cache"
    cache.write_bytes(cache.read_bytes() + b"extra: 3c000000\n")
    again = run(tmp_path, config)
    assert again["export"]["skipped"] and not again["calibrate"]["skipped"]
    assert "calib.cache was modified" in again["calibrate"]["reason"]


def test_stop_after(tmp_path):
    result = CliRunner().invoke(cli, ["--workdir", str(tmp_path / "art"), "-q", "run", "--stop-after", "calibrate",
                                      str(write_project(tmp_path))])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "art" / "tiny" / "calib.cache").exists()
    assert not (tmp_path / "art" / "tiny" / "build.json").exists()
