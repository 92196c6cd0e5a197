"""Contract tests of TrtRunner against the recording fake (pycuda + TensorRT 10 and 11)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.tensorrt.trt_testmodels import run_ort
from quantkit.backends.base import get_backend
from quantkit.backends.tensorrt.engine import build_engine_trt, engine_manifest_path
from quantkit.backends.tensorrt.runner import BACKEND, TrtRunner
from quantkit.errors import ModelError, NotAvailableError, StaleArtifactError


@pytest.fixture(params=[10, 11], ids=["trt10", "trt11"])
def built(request, make_gpu, workspace, build_kwargs):
    """A fake GPU of either major with model.engine built on it (two optimization profiles)."""
    gpu = make_gpu(request.param)
    build_engine_trt(workspace.onnx_fp32, workspace.qdq_model, None, workspace.engine, num_profiles=2,
                     **build_kwargs)
    gpu.calls.clear()
    return gpu


def feed(batch: int, seed: int = 1) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).normal(size=(batch, 1, 8, 8)).astype(np.float32)}


def reference(workspace, built, x: dict[str, np.ndarray]) -> np.ndarray:
    model = workspace.onnx_fp32 if built.major == 10 else workspace.root / "model.typed.onnx"
    return run_ort(model, x)[0]


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_outputs_match_onnx_runtime(built, workspace, batch):
    x = feed(batch)
    with TrtRunner(workspace.engine) as runner:
        outputs = runner.infer(x)
        assert runner.output_names == ["logits"]
        assert runner.input_specs[0].shape == (None, 1, 8, 8)
    np.testing.assert_allclose(outputs["logits"], reference(workspace, built, x), rtol=1e-6, atol=1e-7)


def test_context_pushed_on_activate_and_popped_on_deactivate(built, workspace):
    runner = TrtRunner(workspace.engine)
    runner.activate()
    assert len(built.context_stack) == 1
    runner.infer(feed(2))
    runner.deactivate()
    assert built.context_stack == []
    assert built.order("Context.push", "Context.pop") == ["Context.push", "Context.pop"]


def test_every_io_tensor_gets_pinned_and_device_buffers_of_the_max_shape(built, workspace):
    with TrtRunner(workspace.engine, streams=2) as runner:
        runner.infer(feed(3))
    bound = built.called("IExecutionContext.set_tensor_address")
    contexts = {id(args[0]) for args in bound}
    assert len(contexts) == 2
    for context_id in contexts:
        assert sorted(name for ctx, name, _ in bound if id(ctx) == context_id) == ["input", "logits"]
    # input: 8x1x8x8 float32 (profile MAX); logits: 8x5 float32
    assert sorted(args[0] for args in built.called("mem_alloc")) == [8 * 5 * 4] * 2 + [8 * 64 * 4] * 2
    assert sorted(args[0] for args in built.called("pagelocked_empty")) == [8 * 5] * 2 + [8 * 64] * 2
    assert len(built.called("DeviceAllocation.free")) == 4


def test_each_stream_has_its_own_context_and_profile(built, workspace):
    with TrtRunner(workspace.engine, streams=2) as runner:
        results, timings = runner.infer_concurrent([feed(2, seed) for seed in range(5)])
    chosen = built.called("IExecutionContext.set_optimization_profile_async")
    assert [profile for _, profile, _ in chosen] == [0, 1]
    handles = [handle for _, _, handle in chosen]
    assert len(set(handles)) == 2 and 0 not in handles  # own, non-default streams
    executed = {handle for _, handle in built.called("IExecutionContext.execute_async_v3")}
    assert executed == set(handles)
    for seed, outputs in enumerate(results):
        np.testing.assert_allclose(outputs["logits"], reference(workspace, built, feed(2, seed)), rtol=1e-6)
    assert len(timings) == 5 and all(t["latency_ms"] > 0 for t in timings)


def test_streams_are_synchronized_before_outputs_are_read(built, workspace):
    with TrtRunner(workspace.engine) as runner:
        runner.infer(feed(2))
        [synchronized] = {args for args in built.called("Stream.synchronize")}
        calls = [c for c, _ in built.calls if c in ("IExecutionContext.execute_async_v3", "memcpy_dtoh_async",
                                                     "Stream.synchronize")]
        assert calls[-3:] == ["IExecutionContext.execute_async_v3", "memcpy_dtoh_async", "Stream.synchronize"]
        assert synchronized[0] != 0


def test_timings_follow_trtexec(built, workspace):
    with TrtRunner(workspace.engine) as runner:
        runner.infer(feed(4))
        timings = runner.last_timings()
        assert set(timings) == {"h2d_ms", "compute_ms", "d2h_ms", "latency_ms", "enqueue_ms"}
        assert timings["latency_ms"] == pytest.approx(timings["h2d_ms"] + timings["compute_ms"] + timings["d2h_ms"])
        assert runner.last_inference_time() == pytest.approx(timings["latency_ms"] / 1000)


def test_batch_outside_the_profile_is_refused(built, workspace):
    with TrtRunner(workspace.engine) as runner:
        with pytest.raises(ModelError, match="outside the engine's optimization profile"):
            runner.infer(feed(9))


def test_cuda_graph_is_captured_once_per_shape_and_replayed(built, workspace):
    with TrtRunner(workspace.engine, cuda_graph=True) as runner:
        first = runner.infer(feed(4))["logits"].copy()
        second = runner.infer(feed(4))["logits"].copy()
        runner.infer(feed(2))
        runner.infer(feed(2))
    assert len(built.called("cudaStreamBeginCapture")) == 2
    assert len(built.called("cudaGraphLaunch")) == 2
    assert len(built.called("cudaGraphExecDestroy")) == 2
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(second, reference(workspace, built, feed(4)), rtol=1e-6)


def test_failed_capture_falls_back_to_plain_enqueue(make_gpu, workspace, build_kwargs, console):
    gpu = make_gpu(10, capture_fails=True)
    build_engine_trt(workspace.onnx_fp32, workspace.qdq_model, None, workspace.engine, **build_kwargs)
    with TrtRunner(workspace.engine, cuda_graph=True, console=console) as runner:
        for _ in range(3):
            outputs = runner.infer(feed(4))
    assert len(gpu.called("cudaStreamBeginCapture")) == 1
    assert len(gpu.called("cudaStreamEndCapture")) == 1  # the stream left capture mode
    assert gpu.called("cudaGraphLaunch") == []
    assert any("capture failed" in w for w in console.warnings)
    np.testing.assert_allclose(outputs["logits"], run_ort(workspace.onnx_fp32, feed(4))[0], rtol=1e-6)


def test_corrupt_engine_is_refused_and_the_context_popped(built, workspace):
    workspace.engine.write_bytes(b"not an engine")
    engine_manifest_path(workspace.engine).unlink()
    runner = TrtRunner(workspace.engine)
    with pytest.raises(ModelError, match="cannot deserialize"):
        runner.activate()
    assert built.context_stack == [] and not runner.is_active


def test_engine_from_another_gpu_is_refused(built, workspace):
    manifest_path = engine_manifest_path(workspace.engine)
    manifest = json.loads(manifest_path.read_text())
    manifest["details"].update(gpu_name="NVIDIA A100", compute_capability="8.0")
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(StaleArtifactError, match=r"compute capability 8\.0 \(NVIDIA A100\) vs 8\.9"):
        TrtRunner(workspace.engine).activate()
    assert built.context_stack == []
    TrtRunner(workspace.engine, check_portability=False).activate()  # explicit opt-out


def test_replaced_engine_file_is_refused(built, workspace):
    workspace.engine.write_bytes(workspace.engine.read_bytes() + b" ")
    with pytest.raises(StaleArtifactError, match="modified after"):
        TrtRunner(workspace.engine).activate()


def test_backend_entry(make_gpu, workspace, build_kwargs):
    make_gpu(10)
    backend = get_backend("tensorrt")
    assert backend is BACKEND and backend.is_available() == (True, "")
    runner = backend.open_runner(workspace.engine, threads=4, streams=2)
    assert isinstance(runner, TrtRunner) and runner.streams == 2


def test_backend_without_gpu_is_not_available(make_gpu):
    make_gpu(10, gpus=0)
    available, reason = BACKEND.is_available()
    assert not available and reason
    with pytest.raises(NotAvailableError):
        get_backend("tensorrt")
