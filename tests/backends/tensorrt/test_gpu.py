"""Real-GPU tests: build engines with the installed TensorRT, run them with pycuda, compare with ONNX Runtime.

Run with ``pytest -m gpu`` on a machine with an NVIDIA GPU, TensorRT 10.x or 11.x and pycuda
(see docs/gpu.md). Everywhere else every test here skips with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.tensorrt.conftest import PROFILE, RecordingConsole, make_batches
from backends.tensorrt.trt_testmodels import conv_gemm_model, conv_gemm_qdq_model, run_ort, save
from helpers import REPO

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def real_trt():
    """(tensorrt, pycuda.driver) when both import and a GPU is visible; skips otherwise."""
    try:
        import pycuda.driver as cuda
        import tensorrt as trt
    except (ImportError, OSError) as exc:
        pytest.skip(f"TensorRT/pycuda not importable: {exc}")
    try:
        cuda.init()
        if cuda.Device.count() < 1:
            pytest.skip("no NVIDIA GPU visible")
    except Exception as exc:  # noqa: BLE001 - pycuda's driver errors
        pytest.skip(f"CUDA driver unusable: {exc}")
    return trt, cuda


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _paths(trt) -> list[str]:
    from quantkit.backends.tensorrt.detect import available_paths

    return available_paths(trt)


@pytest.mark.parametrize("path", ["implicit", "explicit"])
@pytest.mark.parametrize("streams, cuda_graph", [(1, False), (2, True)])
def test_tiny_model_engine_matches_onnx_runtime(real_trt, tmp_path, path, streams, cuda_graph):
    from quantkit.backends.tensorrt.engine import build_engine_trt
    from quantkit.backends.tensorrt.runner import TrtRunner
    from quantkit.config import InputSpec

    trt, _cuda = real_trt
    if path not in _paths(trt):
        pytest.skip(f"TensorRT {trt.__version__} has no {path} path")
    onnx_fp32 = save(conv_gemm_model(), tmp_path / "model.onnx")
    qdq = save(conv_gemm_qdq_model(), tmp_path / "model.qdq.onnx")
    engine = tmp_path / "model.engine"
    console = RecordingConsole()
    details = build_engine_trt(onnx_fp32, qdq, None, engine, fp16_nodes=["/fc/Gemm"], profile=PROFILE,
                               input_specs=[InputSpec(name="input", shape=["batch", 1, 8, 8])], workspace_mb=256,
                               calibration_batches=make_batches(count=8), timing_cache=tmp_path / "timing.cache",
                               console=console, path=path, num_profiles=streams)
    assert details["path"] == path and engine.is_file()
    x = {"input": np.random.default_rng(5).normal(size=(3, 1, 8, 8)).astype(np.float32)}
    reference = run_ort(onnx_fp32, x)[0]
    with TrtRunner(engine, streams=streams, cuda_graph=cuda_graph, console=console) as runner:
        for _ in range(3):  # again with a captured graph, when enabled
            outputs = runner.infer(x)
        timings = runner.last_timings()
        many, _ = runner.infer_concurrent([x] * 4)
    assert _cosine(outputs["logits"], reference) > 0.99
    assert all(_cosine(o["logits"], reference) > 0.99 for o in many)
    assert timings["compute_ms"] > 0 and timings["latency_ms"] >= timings["compute_ms"]


REFERENCE_CONFIGS = ["digits_cnn", "tiny_encoder",
                     pytest.param("resnet18", marks=pytest.mark.slow),
                     pytest.param("mobilenet_v3_small", marks=pytest.mark.slow)]


@pytest.mark.torch
@pytest.mark.parametrize("name", REFERENCE_CONFIGS)
def test_reference_model_engine_agrees_with_onnx_runtime(real_trt, tmp_path, name):
    """export -> calibrate (our cache, header for this TensorRT) -> engine -> compare with FP32 ORT."""
    pytest.importorskip("torch")
    from quantkit.artifacts import ModelWorkspace
    from quantkit.backends.tensorrt.detect import cache_version_code, choose_path
    from quantkit.backends.tensorrt.engine import build_engine_trt
    from quantkit.backends.tensorrt.runner import TrtRunner
    from quantkit.calibrate import calibrate, calibration_dataset
    from quantkit.config import load_config
    from quantkit.export import export_model

    trt, _cuda = real_trt
    cfg = load_config(REPO / "configs" / f"{name}.yaml",
                      {"calibration.trt_cache_version": cache_version_code(trt), "calibration.max_samples": 128})
    ws = ModelWorkspace(tmp_path, cfg.name)
    console = RecordingConsole()
    export_model(cfg, ws, console)
    calibrate(cfg, ws, console)
    path = choose_path(trt, "auto")
    qdq = ws.path("model.qdq.onnx")
    if path == "explicit" and not qdq.is_file():
        pytest.skip("the explicit path needs model.qdq.onnx from the build stage (quantkit build-engine)")
    profile = cfg.build.profile
    dataset = calibration_dataset(cfg)

    def batches():
        for batch in dataset.batches(profile.opt, "drop"):
            yield batch.inputs

    engine = ws.path("model.engine")
    details = build_engine_trt(ws.onnx_model, qdq if qdq.is_file() else None, ws.path("calib.cache"), engine,
                               fp16_nodes=[], profile=(profile.min, profile.opt, profile.max),
                               input_specs=cfg.model.inputs, workspace_mb=cfg.build.workspace_mb,
                               calibration_batches=batches, timing_cache=ws.path("timing.cache"),
                               console=console, path=path)
    if path == "implicit":
        assert details["calibration"]["source"] == "calib.cache", console.warnings
    feed = next(iter(dataset.batches(profile.opt, "drop"))).inputs
    reference = run_ort(ws.onnx_model, feed)[0]
    with TrtRunner(engine) as runner:
        result = runner.infer(feed)[runner.output_names[0]]
    assert _cosine(result, reference) > 0.99
    if reference.ndim == 2 and reference.shape[1] > 1:  # classifiers: top-1 mostly unchanged
        agreement = float(np.mean(result.argmax(1) == reference.argmax(1)))
        assert agreement >= 0.9

