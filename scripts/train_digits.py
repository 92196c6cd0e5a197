#!/usr/bin/env python
"""Train the reference DigitsCNN on scikit-learn's 8x8 digits (deterministic, CPU, < 1 min).

Writes ``models/digits_cnn.pt`` (state_dict) and ``models/digits_cnn.json``
(metadata) and prints the held-out top-1 accuracy. The split and the pixel
preprocessing are shared with ``scripts/make_reference_data.py`` through
``quantkit.zoo.digits``, so the model sees exactly what the shipped PNGs give.

The recipe is a fixed number of epochs (no early stopping on the held-out
split); the script fails if held-out accuracy ends below 95%.

Usage: python scripts/train_digits.py [--out-dir models]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.zoo.digits import SPLIT_SEED, build_digits_cnn, digits_split, pixels_to_input  # noqa: E402

SEED = 0
EPOCHS = 40
BATCH_SIZE = 64
LR = 3e-3
WEIGHT_DECAY = 1e-4
MIN_ACCURACY = 0.95
TARGET_ACCURACY = 0.97


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    return float((pred == y).float().mean())


def augment(xb: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random +-1 pixel shift (zero fill), applied per batch."""
    dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=gen))
    if dy == 0 and dx == 0:
        return xb
    out = torch.zeros_like(xb)
    ys, yd = (slice(0, 8 - dy), slice(dy, 8)) if dy >= 0 else (slice(-dy, 8), slice(0, 8 + dy))
    xs, xd = (slice(0, 8 - dx), slice(dx, 8)) if dx >= 0 else (slice(-dx, 8), slice(0, 8 + dx))
    out[:, :, yd, xd] = xb[:, :, ys, xs]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "models")
    args = parser.parse_args(argv)

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    split = digits_split()
    x_train = torch.from_numpy(pixels_to_input(split.x_train))
    y_train = torch.from_numpy(split.y_train)
    x_eval = torch.from_numpy(pixels_to_input(split.x_eval))
    y_eval = torch.from_numpy(split.y_eval)

    model = build_digits_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = (len(x_train) + BATCH_SIZE - 1) // BATCH_SIZE
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=LR, epochs=EPOCHS, steps_per_epoch=steps_per_epoch
    )
    gen = torch.Generator().manual_seed(SEED)

    for epoch in range(EPOCHS):
        model.train()
        perm = torch.randperm(len(x_train), generator=gen)
        total = 0.0
        for i in range(0, len(perm), BATCH_SIZE):
            idx = perm[i : i + BATCH_SIZE]
            xb = augment(x_train[idx], gen)
            loss = F.cross_entropy(model(xb), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        if (epoch + 1) % 10 == 0:
            print(f"epoch {epoch + 1:3d}  train loss {total / len(x_train):.4f}")

    model.eval()
    train_acc = evaluate(model, x_train, y_train)
    acc = evaluate(model, x_eval, y_eval)
    print(f"train top-1 {train_acc:.4f}")
    print(f"held-out top-1 {acc:.4f} ({len(y_eval)} samples)")
    if acc < MIN_ACCURACY:
        print(f"ERROR: held-out accuracy {acc:.4f} < {MIN_ACCURACY}", file=sys.stderr)
        return 1
    if acc < TARGET_ACCURACY:
        print(f"warning: held-out accuracy below target {TARGET_ACCURACY}", file=sys.stderr)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out_dir / "digits_cnn.pt")
    meta = {
        "heldout_top1": round(acc, 6),
        "train_size": int(len(y_train)),
        "eval_size": int(len(y_eval)),
        "seed": SPLIT_SEED,
        "torch": torch.__version__,
    }
    (args.out_dir / "digits_cnn.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out_dir / 'digits_cnn.pt'} and digits_cnn.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
