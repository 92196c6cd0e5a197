"""Fixtures for the bench tests: a tiny ONNX classifier, its INT8 twin and a workspace."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from quantkit.artifacts import Manifest, ModelWorkspace, sha256_file

FEATURES, CLASSES = 16, 10
BUILD_FINGERPRINT = {"test": "tiny classifier", "version": 1}


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.5, (FEATURES, 32)).astype(np.float32)
    b1 = rng.normal(0, 0.1, 32).astype(np.float32)
    w2 = rng.normal(0, 0.5, (32, CLASSES)).astype(np.float32)
    b2 = rng.normal(0, 0.1, CLASSES).astype(np.float32)
    return w1, b1, w2, b2


def forward(x: np.ndarray) -> np.ndarray:
    w1, b1, w2, b2 = _weights()
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def write_classifier(path: Path, batch: int | str = "batch") -> Path:
    """logits = relu(x W1 + b1) W2 + b2, input [batch, 16] -> logits [batch, 10]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w1, b1, w2, b2 = _weights()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
         helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["o"]),
         helper.make_node("Add", ["o", "b2"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, CLASSES])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def quantize(fp32: Path, int8: Path, samples: np.ndarray) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter([{"input": samples[i:i + 8]} for i in range(0, len(samples), 8)])

        def get_next(self):
            return next(self._it, None)

    quantize_static(str(fp32), str(int8), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return int8


def _data(seed: int, count: int, labels: bool) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).normal(0, 1, (count, FEATURES)).astype(np.float32)
    arrays = {"input": x}
    if labels:
        truth = forward(x).argmax(axis=1)
        truth[::10] = (truth[::10] + 1) % CLASSES  # FP32 top-1 is 90 %, not a suspicious 100 %
        arrays["labels"] = truth.astype(np.int64)
    return arrays


def write_config(root: Path, *, gates: list[str] = (), labels: bool = True, batch_sizes=(1, 4),
                 extra_bench: str = "", bench_data: bool = True) -> Path:
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    np.savez(data / "calib.npz", **_data(1, 48, labels=False))
    np.savez(data / "eval.npz", **_data(2, 40, labels=labels))
    write_classifier(root / "source.onnx")
    gate_list = ", ".join(f'"{g}"' for g in gates)
    text = f"""
name: tiny
model:
  source: onnx
  path: source.onnx
  inputs:
    - name: input
      shape: [batch, {FEATURES}]
  outputs: [logits]
calibration:
  data: data/calib.npz
  batch_size: 8
build:
  profile: {{min: 1, opt: 4, max: 8}}
bench:
  batch_sizes: [{", ".join(str(b) for b in batch_sizes)}]
  warmup_ms: 1
  duration_s: 0.005
  min_iterations: 3
  repeats: 2
  threads: 1
  max_samples: 40
  gates: [{gate_list}]
{"  data: data/eval.npz" if bench_data else ""}
{extra_bench}
"""
    path = root / "tiny.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def bench_setup(tmp_path, monkeypatch):
    """Factory: (cfg, ws) with model.onnx, model.int8.onnx and a fresh build.json."""
    from quantkit.bench import stage
    from quantkit.config import load_config

    monkeypatch.setattr(stage, "_build_fingerprint", lambda cfg, ws: dict(BUILD_FINGERPRINT))

    def make(**options):
        cfg = load_config(write_config(tmp_path, **options))
        ws = ModelWorkspace(tmp_path / "work", cfg.name)
        ws.root.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "source.onnx", ws.onnx_model)
        int8 = quantize(ws.onnx_model, ws.path("model.int8.onnx"), _data(1, 48, labels=False)["input"])
        ws.write_manifest("build.json", Manifest(
            stage="build", fingerprint=dict(BUILD_FINGERPRINT), outputs={int8.name: sha256_file(int8)},
            versions={}, details={}))
        return cfg, ws

    return make


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(fp32 path, int8 path) of the tiny classifier, built once."""
    root = tmp_path_factory.mktemp("tiny")
    fp32 = write_classifier(root / "model.onnx")
    int8 = quantize(fp32, root / "model.int8.onnx", _data(1, 48, labels=False)["input"])
    return fp32, int8
