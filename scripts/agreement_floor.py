#!/usr/bin/env python
"""How much output error a top-1 agreement budget tolerates, and where an INT8 model's error comes from.

1. Adds i.i.d. Gaussian noise at a given SNR to the FP32 model's logits on ``bench.data`` and reports
   the mean top-1 agreement with the clean logits over many draws. Quantization error is not i.i.d.,
   but the curve tells whether a budget such as "agreement >= 0.95" is within reach of an INT8 model
   whose output SNR is known (``quantkit sensitivity`` reports it).
2. With ``--decompose`` (needs ``calib.json``): the all-INT8 CPU flavour against FP32, then the same
   with only the weights rounded to int8 (activations float) and with only the activations rounded
   to uint8 (weights float). If "activations only" already misses a budget, no choice of weights
   (rounding, bias correction) can meet it, and keeping a few nodes in float has to close the rest.
   All three run as an unfused ONNX Runtime graph (``DQ -> float op -> Q``, the same values as the
   integer kernels up to accumulation rounding), so they differ only in what is rounded.

Example::

    python scripts/agreement_floor.py configs/mobilenet_v3_small.yaml --workdir /tmp/qk --decompose
"""

from __future__ import annotations

import argparse
import copy
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
    parser.add_argument("--decompose", action="store_true",
                        help="also score all-INT8, weights-only and activations-only rounding (needs calib.json)")
    args = parser.parse_args(argv)

    import onnx

    from quantkit.artifacts import ModelWorkspace
    from quantkit.config import load_config
    from quantkit.data import open_dataset

    cfg = load_config(args.config)
    data = cfg.bench.data or cfg.calibration.data
    dataset = open_dataset(data, cfg.model.inputs, preprocess=cfg.calibration.preprocess)
    batches = [batch.inputs for batch in dataset.batches(32)]
    ws = ModelWorkspace(Path(args.workdir), cfg.name)
    model = onnx.load(str(ws.onnx_model))
    logits = _logits(model, batches)
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
    if args.decompose:
        from quantkit.errors import QuantkitError

        try:
            decompose(model, ws, batches, logits)
        except QuantkitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    return 0


def decompose(model, ws, batches, reference: np.ndarray) -> None:
    """Score the all-INT8 CPU flavour, weights-only and activations-only rounding against FP32."""
    from quantkit.qdq import load_ranges, placement, widen_overclipped
    from quantkit.qdq.cpu import write_cpu_qdq

    ranges, _ = widen_overclipped(load_ranges(ws.path("calib.json")))
    nodes = placement.select_nodes(placement.quantizable_nodes(model), placement.CPU)
    all_int8 = write_cpu_qdq(model, ranges, nodes, pad_channels=False)  # float_weights swaps in FP32 weights
    print("where the error comes from (unfused ONNX Runtime graph, all evaluation samples):")
    for label, variant in (("all-INT8 CPU flavour", all_int8),
                           ("weights only (int8 per-channel, activations float)", weights_only(model)),
                           ("activations only (uint8 per-tensor, weights float)", float_weights(all_int8, model))):
        print(f"  {label:52s} {_scores(reference, _logits(variant, batches))}")


def weights_only(model):
    """The FP32 model with each Conv/Gemm weight rounded as the CPU flavour rounds it (int8, per output
    channel, scale max|w| / 127); biases and activations stay float."""
    from onnx import numpy_helper

    rounded = copy.deepcopy(model)
    weights = {init.name: init for init in rounded.graph.initializer}
    for node in rounded.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 2 or node.input[1] not in weights:
            continue
        w = numpy_helper.to_array(weights[node.input[1]]).astype(np.float64)
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        axis = 0 if node.op_type == "Conv" or trans_b else 1
        others = tuple(i for i in range(w.ndim) if i != axis)
        scale = np.abs(w).max(axis=others, keepdims=True) / 127.0
        scale[scale == 0] = 1.0
        q = np.clip(np.round(w / scale), -127, 127) * scale
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(q.astype(np.float32), node.input[1]))
    return rounded


def float_weights(qmodel, model):
    """The CPU flavour with every Conv/Gemm reading the FP32 weight and bias instead of their DQs."""
    rounded = copy.deepcopy(qmodel)
    originals = {node.name: node for node in model.graph.node}
    existing = {init.name for init in rounded.graph.initializer}
    for init in model.graph.initializer:
        if init.name not in existing:
            copied = copy.deepcopy(init)
            copied.name = init.name + "__fp32"
            rounded.graph.initializer.append(copied)
    for node in rounded.graph.node:
        original = originals.get(node.name)
        if original is None or node.op_type not in ("Conv", "Gemm"):
            continue
        for index in (1, 2):
            if index < len(original.input) and original.input[index]:
                node.input[index] = original.input[index] + "__fp32"
    from quantkit.qdq.graph import remove_unused

    remove_unused(rounded)
    return rounded


def _logits(model, batches) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, feeds)[0] for feeds in batches]).astype(np.float64)


def _scores(reference: np.ndarray, out: np.ndarray) -> str:
    ref, flat = reference.reshape(len(reference), -1), out.reshape(len(out), -1)
    cosine = np.mean(np.sum(ref * flat, 1) / np.maximum(np.linalg.norm(ref, axis=1) * np.linalg.norm(flat, axis=1),
                                                        1e-30))
    centred = ref - ref.mean(axis=1, keepdims=True)
    snr = 10 * np.log10(np.sum(centred ** 2) / max(np.sum((ref - flat) ** 2), 1e-30))
    agreement = np.mean(ref.argmax(axis=1) == flat.argmax(axis=1))
    return f"top-1 agreement {agreement:.3f}, cosine {cosine:.4f}, output SNR {snr:.1f} dB"


if __name__ == "__main__":
    sys.exit(main())
