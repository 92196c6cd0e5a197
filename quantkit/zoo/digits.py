"""Small CNN for scikit-learn's 8x8 handwritten digits, plus the fixed data split.

Input: float32 ``[N, 1, 8, 8]`` with values in 0..1, i.e. the 8-bit value of
the shipped PNGs divided by 255 (see :func:`pixels_to_input`).
Output: logits ``[N, 10]``.

The graph only contains Conv, BatchNormalization (folded into Conv on export),
Relu, MaxPool, Flatten and Gemm, so a Q/DQ quantizer can handle all of it.

Weights are not loaded here; the caller does::

    model = build_digits_cnn()
    model.load_state_dict(torch.load("models/digits_cnn.pt", weights_only=True))
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

__all__ = [
    "DigitsCNN",
    "DigitsSplit",
    "build_digits_cnn",
    "digits_split",
    "pixels_to_input",
    "SPLIT_SEED",
    "EVAL_FRACTION",
]

SPLIT_SEED = 0
EVAL_FRACTION = 0.3


class DigitsCNN(nn.Module):
    """Three 3x3 conv blocks and a two-layer classifier head (~40k parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),  # 16 x 8 x 8
            nn.Conv2d(16, 32, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 32 x 4 x 4
            nn.Conv2d(32, 64, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 64 x 2 x 2
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * 2 * 2, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def build_digits_cnn() -> DigitsCNN:
    """Return an untrained :class:`DigitsCNN` in eval mode."""
    return DigitsCNN().eval()


class DigitsSplit(NamedTuple):
    """The fixed train / held-out split of ``sklearn.datasets.load_digits()``.

    ``x_*`` are uint8 ``[N, 8, 8]`` pixel values exactly as stored in the shipped
    PNGs (``round(v * 255 / 16)``, round-half-to-even), ``y_*`` are int64 labels
    and ``idx_*`` are the sample indices into ``load_digits()`` (used as the PNG
    file names).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    idx_train: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray
    idx_eval: np.ndarray


def digits_split() -> DigitsSplit:
    """Stratified 70/30 split of the 1797 digits with ``random_state=0``.

    Imports scikit-learn lazily (the dataset ships inside the package, nothing
    is downloaded).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    # images are 0..16 floats; map to the 8-bit values the PNGs hold.
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    idx = np.arange(len(labels))
    idx_train, idx_eval = train_test_split(
        idx, test_size=EVAL_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    return DigitsSplit(
        x_train=pixels[idx_train],
        y_train=labels[idx_train],
        idx_train=idx_train,
        x_eval=pixels[idx_eval],
        y_eval=labels[idx_eval],
        idx_eval=idx_eval,
    )


def pixels_to_input(pixels: np.ndarray) -> np.ndarray:
    """uint8 ``[N, 8, 8]`` (or ``[8, 8]``) PNG values -> float32 ``[N, 1, 8, 8]`` model input."""
    arr = np.asarray(pixels, dtype=np.float32) / 255.0
    if arr.ndim == 2:
        arr = arr[None]
    return arr[:, None, :, :]
