"""Helpers shared by tests (tests/ is on sys.path via pytest's pythonpath setting)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]


def base_config(data_dir: Path) -> dict:
    """A valid config for a 1x8x8 gray model, using ``data_dir`` for calibration."""
    return {
        "name": "tiny",
        "model": {
            "source": "torch",
            "factory": "quantkit.zoo.digits:build_digits_cnn",
            "inputs": [{"name": "input", "shape": ["batch", 1, 8, 8]}],
            "outputs": ["logits"],
        },
        "calibration": {
            "data": str(data_dir),
            "preprocess": {"color": "gray", "layout": "nchw"},
            "batch_size": 4,
        },
        "build": {"profile": {"min": 1, "opt": 4, "max": 8}},
        "bench": {"batch_sizes": [1, 4]},
    }


def write_gray_images(folder: Path, count: int, size: int = 8, classes: int = 0) -> list[Path]:
    """``count`` deterministic gray PNGs, flat or in ``classes`` subfolders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        sub = folder / str(i % classes) if classes else folder
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"{i:04d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8), mode="L").save(path)
        paths.append(path)
    return paths


def tiny_conv_model(path, zero_second_conv: bool = False):
    """x[batch,1,8,8] -> Conv(4) -> Relu -> Conv(2) -> y."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(4, 1, 3, 3)).astype(np.float32)
    w2 = rng.normal(size=(2, 4, 3, 3)).astype(np.float32)
    if zero_second_conv:
        w2[:] = 0
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 8, 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
