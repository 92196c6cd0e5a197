"""The runner contract (quantkit.backends.base) and the ONNX Runtime runner."""

from __future__ import annotations

import numpy as np
import pytest

from quantkit.backends.base import Backend, Runner, RunnerStateError, TensorSpec, get_backend
from quantkit.backends.onnxruntime.runner import OrtRunner, physical_cores
from quantkit.errors import ModelError, NotAvailableError


class EchoRunner(Runner):
    def __init__(self):
        super().__init__("echo")
        self.events = []

    def _activate_impl(self):
        self.events.append("activate")

    def _deactivate_impl(self):
        self.events.append("deactivate")

    def _input_specs_impl(self):
        return [TensorSpec("x", ("batch", 3), np.dtype(np.float32))]

    def _output_names_impl(self):
        return ["y"]

    def _infer_impl(self, feed):
        return {"y": feed["x"] * 2}


def test_infer_before_activate_is_an_error():
    runner = EchoRunner()
    with pytest.raises(RunnerStateError, match="needs an active runner"):
        runner.infer({"x": np.zeros((1, 3), np.float32)})
    with pytest.raises(RunnerStateError):
        runner.input_specs


def test_context_manager_deactivates_on_exception():
    runner = EchoRunner()
    with pytest.raises(KeyError):
        with runner:
            assert runner.is_active
            raise KeyError("boom")
    assert not runner.is_active and runner.events == ["activate", "deactivate"]
    runner.deactivate()  # deactivating an inactive runner is a no-op (cleanup paths may always call it)
    assert runner.events == ["activate", "deactivate"]


def test_double_activate_is_an_error():
    with EchoRunner() as runner:
        with pytest.raises(RunnerStateError, match="already active"):
            runner.activate()


def test_infer_checks_the_feed_and_times_the_call():
    with EchoRunner() as runner:
        assert runner.last_inference_time() is None
        out = runner.infer({"x": np.ones((2, 3), np.float32)})
        assert out["y"].tolist() == [[2.0] * 3] * 2
        assert runner.last_inference_time() >= 0
        with pytest.raises(ModelError, match="missing"):
            runner.infer({"z": np.ones((2, 3), np.float32)})
        with pytest.raises(ModelError, match="float64"):
            runner.infer({"x": np.ones((2, 3))})
        with pytest.raises(ModelError, match="fixes it to 3"):
            runner.infer({"x": np.ones((2, 4), np.float32)})


def test_ort_runner_runs_the_tiny_model(tiny_models):
    fp32, _ = tiny_models
    runner = OrtRunner(fp32, threads=1)
    with runner:
        assert [s.name for s in runner.input_specs] == ["input"] and runner.output_names == ["logits"]
        assert runner.providers == ["CPUExecutionProvider"]
        out = runner.infer({"input": np.zeros((3, 16), np.float32)})
        assert out["logits"].shape == (3, 10)
        assert runner.last_inference_time() > 0
    assert not runner.is_active


def test_ort_runner_sets_threads_and_full_optimisation(tiny_models):
    import onnxruntime as ort

    options = OrtRunner(tiny_models[0], threads=1).session_options()
    assert options.intra_op_num_threads == 1
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert OrtRunner(tiny_models[0]).threads == physical_cores() >= 1


def test_ort_runner_missing_model_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        OrtRunner(tmp_path / "missing.onnx", threads=1).activate()


def test_backend_table():
    backend = get_backend("onnxruntime")
    assert isinstance(backend, Backend) and backend.is_available() == (True, "")
    with pytest.raises(NotAvailableError, match="unknown backend"):
        get_backend("nope")
    with pytest.raises(NotAvailableError, match="tensorrt"):
        get_backend("tensorrt")  # no runner shipped (or no GPU) here
