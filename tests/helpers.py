"""Helpers shared by tests (tests/ is on sys.path via pytest's pythonpath setting)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
