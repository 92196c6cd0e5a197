"""Fixtures for the TensorRT backend tests: the recording fake, tiny models, data and a console."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from backends.tensorrt.fake_trt import FakeGPU, Options
from backends.tensorrt.trt_testmodels import conv_gemm_model, conv_gemm_qdq_model, save
from quantkit.config import InputSpec

OPT_BATCH = 4
PROFILE = (1, OPT_BATCH, 8)


@dataclass
class RecordingConsole:
    """A quantkit.ui.Console stand-in that keeps what it was told."""

    infos: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def info(self, message: str) -> None:
        self.infos.append(message)

    def detail(self, message: str) -> None:
        self.infos.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture
def console() -> RecordingConsole:
    return RecordingConsole()


@pytest.fixture
def make_gpu(monkeypatch) -> Callable[..., FakeGPU]:
    """make_gpu(major, **options): install a fake TensorRT ``major`` + pycuda machine."""

    def _make(major: int, **options) -> FakeGPU:
        return FakeGPU(major, Options(**options)).install(monkeypatch)

    return _make


@dataclass
class Workspace:
    root: Path
    onnx_fp32: Path
    qdq_model: Path
    engine: Path
    timing_cache: Path


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    root = tmp_path / "tiny"
    return Workspace(root, save(conv_gemm_model(), root / "model.onnx"), save(conv_gemm_qdq_model(), root / "model.qdq.onnx"),
                     root / "model.engine", root / "timing.cache")


@pytest.fixture
def input_specs() -> list[InputSpec]:
    return [InputSpec(name="input", shape=["batch", 1, 8, 8])]


def make_batches(count: int = 3, batch: int = OPT_BATCH, remainder: int = 2, seed: int = 0
                 ) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
    """A loader like Dataset.batches: ``count`` full batches, then a short remainder batch."""

    def _batches() -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        for _ in range(count):
            yield {"input": rng.normal(size=(batch, 1, 8, 8)).astype(np.float32)}
        if remainder:
            yield {"input": rng.normal(size=(remainder, 1, 8, 8)).astype(np.float32)}

    return _batches


@pytest.fixture
def batches() -> Callable[[], Iterator[dict[str, np.ndarray]]]:
    return make_batches()


@pytest.fixture
def build_kwargs(workspace: Workspace, input_specs, batches, console) -> dict:
    """Keyword arguments for build_engine_trt on the tiny model (no cache, with data)."""
    return dict(fp16_nodes=[], profile=PROFILE, input_specs=input_specs, workspace_mb=64,
                calibration_batches=batches, timing_cache=workspace.timing_cache, console=console)
