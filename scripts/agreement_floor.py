#!/usr/bin/env python
"""How much output error a top-1 agreement budget tolerates on a model's own evaluation data.

Adds i.i.d. Gaussian noise at a given SNR to the FP32 model's logits on ``bench.data`` and reports
the mean top-1 agreement with the clean logits over many draws. Quantization error is not i.i.d.,
but the curve tells whether a budget such as "agreement >= 0.95" is within reach of an INT8 model
whose output SNR is known (``quantkit sensitivity`` reports it). Example::

    python scripts/agreement_floor.py configs/mobilenet_v3_small.yaml --workdir /tmp/qk
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--workdir", required=True, help="where `quantkit export` wrote model.onnx")
    parser.add_argument("--snr", default="15,17.5,20,22,25,30", help="output SNRs in dB, comma-separated")
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args(argv)

    import onnxruntime as ort

    from quantkit.artifacts import ModelWorkspace
    from quantkit.config import load_config
    from quantkit.data import open_dataset

    cfg = load_config(args.config)
    data = cfg.bench.data or cfg.calibration.data
    dataset = open_dataset(data, cfg.model.inputs, preprocess=cfg.calibration.preprocess)
    ws = ModelWorkspace(Path(args.workdir), cfg.name)
    session = ort.InferenceSession(str(ws.onnx_model), providers=["CPUExecutionProvider"])
    logits = np.concatenate([session.run(None, batch.inputs)[0] for batch in dataset.batches(32)]).astype(np.float64)
    centred = logits - logits.mean(axis=1, keepdims=True)
    top = np.sort(logits, axis=1)
    print(f"{cfg.name}: {len(logits)} samples from {data}; median top-1/top-2 logit gap = "
          f"{np.median((top[:, -1] - top[:, -2]) / logits.std(axis=1)):.2f} logit standard deviations")
    rng = np.random.default_rng(0)
    reference = logits.argmax(axis=1)
    for snr in (float(v) for v in args.snr.split(",")):
        sigma = np.sqrt((centred ** 2).mean(axis=1, keepdims=True) / 10 ** (snr / 10))
        agreement = [np.mean((logits + rng.normal(size=logits.shape) * sigma).argmax(axis=1) == reference)
                     for _ in range(args.draws)]
        print(f"  output SNR {snr:5.1f} dB: top-1 agreement mean {np.mean(agreement):.3f}, "
              f"10th percentile {np.percentile(agreement, 10):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
