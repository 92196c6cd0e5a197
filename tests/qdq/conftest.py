"""Shared fixtures: tiny onnx.helper models calibrated with ORT min/max (quantkit.qdq.testing)."""

from __future__ import annotations

import pytest

from quantkit.qdq import load_ranges
from quantkit.qdq import testing as tiny


def _calibrated(model, tmp_path_factory, name):
    path = tmp_path_factory.mktemp(name) / "calib.json"
    tiny.write_minmax_calibration(model, [tiny.random_feeds(model, 4, seed) for seed in range(4)], path)
    return model, load_ranges(path)


@pytest.fixture(scope="session")
def residual(tmp_path_factory):
    """(model, ranges) for the residual CNN: conv/relu/conv/relu/conv + add/relu/gap/flatten/gemm/sigmoid."""
    return _calibrated(tiny.residual_cnn(), tmp_path_factory, "residual")


@pytest.fixture(scope="session")
def hardswish(tmp_path_factory):
    return _calibrated(tiny.hardswish_cnn(), tmp_path_factory, "hardswish")


@pytest.fixture(scope="session")
def mlp(tmp_path_factory):
    return _calibrated(tiny.matmul_mlp(), tmp_path_factory, "mlp")


@pytest.fixture(scope="session")
def squeeze_excite(tmp_path_factory):
    return _calibrated(tiny.squeeze_excite_cnn(), tmp_path_factory, "squeeze_excite")
