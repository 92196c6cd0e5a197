#!/usr/bin/env python
"""Issue 5's "Done means", measured side by side in one run.

For each reference model (already exported with ``quantkit --workdir WORKDIR export configs/NAME.yaml``):

1. calibrate (``quantkit.calibrate``) unless ``calib.json`` is fresh;
2. build (``quantkit.build.build_engine``: CPU flavour + speed guard, TensorRT flavour + checker);
3. make ONNX Runtime's own ``quantize_static`` artifact from the same calibration images
   (QDQ, uint8 activations / int8 per-channel weights, MinMax, after ``quant_pre_process``);
4. time FP32, our INT8 and ORT's INT8 in ONNX Runtime (2 threads, ORT_ENABLE_ALL) with
   ``quantkit.bench.timing.benchmark`` -- the same trtexec-style, ABBA-interleaved timing as
   ``quantkit bench`` -- at the config's bench batch sizes;
5. accuracy on the evaluation split: top-1 against labels where the data has labels, else
   top-1 agreement and cosine against FP32; the TensorRT flavour's cosine; the checker's verdict.

Writes a Markdown table (``--out``) and prints it. Example::

    python scripts/bench_build.py --workdir /tmp/qa --out /tmp/qa/bench_build.md
    python scripts/bench_build.py --workdir /tmp/qa --models resnet18 --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("digits_cnn", "resnet18", "mobilenet_v3_small", "tiny_encoder")
THREADS = 2

# issue 5, "Done means"
TARGETS = {
    ("resnet18", 32, "speedup"): 2.8,
    ("resnet18", 32, "vs_ort"): 0.95,
    ("mobilenet_v3_small", 32, "speedup"): 1.2,
    ("mobilenet_v3_small", 1, "speedup"): 1.0,
}
MAX_TOP1_DROP_POINTS = {"digits_cnn": 0.3}


@dataclass
class ModelReport:
    name: str
    build: dict[str, Any] = field(default_factory=dict)
    timing: dict[int, dict[str, float]] = field(default_factory=dict)
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    checker: list[str] = field(default_factory=list)
    calibration: str = ""
    error: str | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qa"), help="quantkit workdir with exported models")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", type=Path, default=None, help="Markdown file for the results (default: WORKDIR/bench_build.md)")
    parser.add_argument("--docs", action="store_true", help="also replace the build section of docs/benchmarks.md")
    # many short paired repeats rather than a few long ones: on a shared host the median of
    # per-repeat ratios is what survives other tenants' bursts
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per timed run (trtexec default 3)")
    parser.add_argument("--repeats", type=int, default=7, help="ABBA repeats per batch size")
    parser.add_argument("--quick", action="store_true", help="1 s runs, 3 repeats, at most 128 eval samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 1.0
    out = args.out or args.workdir / "bench_build.md"
    reports = [bench_model(name, args) for name in args.models]
    text = render(reports, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps([vars(r) for r in reports], indent=1, default=str), encoding="utf-8")
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    if args.docs:
        sys.path.insert(0, str(ROOT / "scripts"))
        from docsection import replace_section

        command = "python scripts/bench_build.py " + " ".join(argv if argv is not None else sys.argv[1:])
        replace_section("build", f"Command: `{command}`\n\n{text}")
    return 0 if all(r.error is None for r in reports) and not failures(reports) else 1


# --------------------------------------------------------------------------- one model


def bench_model(name: str, args) -> ModelReport:
    from quantkit.artifacts import ModelWorkspace
    from quantkit.config import load_config
    from quantkit.errors import QuantkitError
    from quantkit.ui import Console

    report = ModelReport(name)
    console = Console()
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    ws = ModelWorkspace(args.workdir, cfg.name)
    try:
        report.calibration = ensure_calibration(cfg, ws, console)
        start = time.perf_counter()
        from quantkit import build

        result = build.build_engine(cfg, ws, console)
        console.info(f"[{name}] {build.describe(result)}")
        report.build = {"seconds": round(time.perf_counter() - start, 2),
                        "guard": result.timing.to_json() if result.timing else None,
                        "automatic": len(result.automatic), "fused_ops": result.fused_ops,
                        "precision": result.precision_counts("cpu")}
        ort_static = make_ort_static(cfg, ws, console)
        report.timing = time_variants(cfg, ws, ort_static, args, console)
        report.accuracy = accuracy(cfg, ws, ort_static, args)
        import onnx

        from quantkit.qdq.trt_check import check_trt_qdq

        report.checker = check_trt_qdq(onnx.load(str(ws.path(build.TRT_ARTIFACT))))
    except QuantkitError as exc:
        report.error = str(exc)
        console.warn(f"[{name}] {exc}")
    return report


def ensure_calibration(cfg, ws, console) -> str:
    from quantkit.calibrate import MANIFEST, calibrate, calibration_fingerprint

    if not ws.onnx_model.exists():
        from quantkit.errors import MissingArtifactError

        raise MissingArtifactError(f"{ws.onnx_model} missing: run `quantkit --workdir {ws.root.parent} export "
                                   f"configs/{cfg.name}.yaml` first")
    reason = ws.staleness(MANIFEST, calibration_fingerprint(cfg, ws))
    if reason is None:
        return f"{cfg.calibration.method} (existing calib.json)"
    console.info(f"[{cfg.name}] calibrating ({reason})")
    result = calibrate(cfg, ws, console)
    return f"{cfg.calibration.method}, {result.samples} samples"


def make_ort_static(cfg, ws, console) -> Path:
    """ONNX Runtime's quantize_static on the same calibration images (its recommended recipe)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from quantkit.calibrate import calibration_dataset

    out = ws.path("model.ort_static.onnx")
    pre = ws.path("model.ort_pre.onnx")
    if out.exists() and out.stat().st_mtime > ws.onnx_model.stat().st_mtime:
        return out
    console.info(f"[{cfg.name}] ONNX Runtime quantize_static baseline")
    quant_pre_process(str(ws.onnx_model), str(pre), skip_symbolic_shape=True)
    batches = calibration_dataset(cfg).batches(cfg.calibration.batch_size)

    class Reader(CalibrationDataReader):
        def get_next(self):
            batch = next(batches, None)
            return None if batch is None else batch.inputs

    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    pre.unlink(missing_ok=True)
    return out


def eval_batches(cfg, limit: int | None):
    from quantkit.data import open_dataset

    data = cfg.bench.data or cfg.calibration.data
    dataset = open_dataset(data, cfg.model.inputs, fmt="auto", preprocess=cfg.calibration.preprocess,
                           max_samples=limit or cfg.bench.max_samples)
    return dataset


def feed_of(dataset, batch: int) -> dict[str, np.ndarray]:
    first = next(iter(dataset.batches(batch)))
    feed = {}
    for key, array in first.inputs.items():
        if array.shape[0] < batch:
            array = np.concatenate([array] * -(-batch // array.shape[0]))[:batch]
        feed[key] = np.ascontiguousarray(array)
    return feed


def time_variants(cfg, ws, ort_static: Path, args, console) -> dict[int, dict[str, float]]:
    from quantkit import build
    from quantkit.backends.onnxruntime.runner import OrtRunner
    from quantkit.bench.timing import TimingSettings, benchmark

    runners = {"fp32": OrtRunner(ws.onnx_model, THREADS), "int8": OrtRunner(ws.path(build.CPU_ARTIFACT), THREADS),
               "ort": OrtRunner(ort_static, THREADS)}
    dataset = eval_batches(cfg, max(cfg.bench.batch_sizes))
    feeds = {size: feed_of(dataset, size) for size in sorted(cfg.bench.batch_sizes, reverse=True)}
    settings = TimingSettings(warmup_ms=200, duration_s=args.duration, min_iterations=3 if args.quick else 10)
    for runner in runners.values():
        runner.activate()
    try:
        console.info(f"[{cfg.name}] timing fp32 / int8 / ort at batch {', '.join(map(str, feeds))}")
        results = benchmark(runners, feeds, settings, args.repeats)
    finally:
        for runner in runners.values():
            runner.deactivate()
    table = {}
    for batch in results:
        fp32 = batch.variants["fp32"].throughput.median
        int8 = batch.variants["int8"].throughput.median
        ort = batch.variants["ort"].throughput.median
        table[batch.batch_size] = {
            "fp32_ips": fp32, "int8_ips": int8, "ort_ips": ort,
            "speedup": batch.speedup("int8", "fp32").median,
            "ort_speedup": batch.speedup("ort", "fp32").median,
            "vs_ort": batch.speedup("int8", "ort").median,
            "noisy": batch.noisy,
        }
    return table


def accuracy(cfg, ws, ort_static: Path, args) -> dict[str, dict[str, float]]:
    from quantkit import build
    from quantkit.backends.onnxruntime.runner import OrtRunner

    dataset = eval_batches(cfg, 128 if args.quick else None)
    paths = {"fp32": ws.onnx_model, "int8": ws.path(build.CPU_ARTIFACT), "ort": ort_static,
             "trt_flavour": ws.path(build.TRT_ARTIFACT)}
    outputs: dict[str, list[np.ndarray]] = {key: [] for key in paths}
    labels: list[np.ndarray] = []
    runners = {key: OrtRunner(path, THREADS) for key, path in paths.items()}
    for runner in runners.values():
        runner.activate()
    try:
        for batch in dataset.batches(32):
            for key, runner in runners.items():
                result = runner.infer(batch.inputs)
                outputs[key].append(np.asarray(next(iter(result.values())))[: batch.size])
            if batch.labels is not None:
                labels.append(batch.labels[: batch.size])
    finally:
        for runner in runners.values():
            runner.deactivate()
    merged = {key: np.concatenate(value) for key, value in outputs.items()}
    truth = np.concatenate(labels) if labels else None
    ref = merged["fp32"].reshape(len(merged["fp32"]), -1).astype(np.float64)
    table = {}
    for key, out in merged.items():
        flat = out.reshape(len(out), -1).astype(np.float64)
        cos = np.sum(flat * ref, 1) / np.maximum(np.linalg.norm(flat, axis=1) * np.linalg.norm(ref, axis=1), 1e-30)
        row = {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
               "top1_agreement": float(np.mean(out.argmax(-1) == merged["fp32"].argmax(-1))),
               "samples": int(len(out))}
        if truth is not None:
            row["top1"] = float(np.mean(out.argmax(-1) == truth))
        table[key] = row
    return table


# --------------------------------------------------------------------------- report


def failures(reports: list[ModelReport]) -> list[str]:
    found = []
    for report in reports:
        for (name, batch, key), target in TARGETS.items():
            if report.name == name and batch in report.timing and report.timing[batch][key] < target:
                found.append(f"{name} batch {batch} {key} {report.timing[batch][key]:.2f} < {target}")
        limit = MAX_TOP1_DROP_POINTS.get(report.name)
        if limit is not None and "top1" in report.accuracy.get("int8", {}):
            drop = 100 * (report.accuracy["fp32"]["top1"] - report.accuracy["int8"]["top1"])
            if drop > limit:
                found.append(f"{report.name} top-1 drop {drop:.2f} points > {limit}")
        if report.checker:
            found.append(f"{report.name}: TensorRT checker found {len(report.checker)} problem(s)")
    return found


def render(reports: list[ModelReport], args) -> str:
    import onnxruntime

    lines = [
        "# INT8 build: measured (scripts/bench_build.py)",
        "",
        f"ONNX Runtime {onnxruntime.__version__}, CPU EP, {THREADS} intra-op threads, ORT_ENABLE_ALL; "
        f"`quantkit.bench.timing` ({args.duration:g} s runs, {args.repeats} ABBA repeats, median); "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}.",
        "",
        "## Speed (throughput, images/s; speed-ups are medians of paired repeats)",
        "",
        "| model | batch | FP32 | INT8 (quantkit) | ORT quantize_static | INT8/FP32 | ORT/FP32 | INT8/ORT | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for batch, row in report.timing.items():
            goals = [f"{key} >= {value}" for (name, size, key), value in TARGETS.items()
                     if name == report.name and size == batch]
            lines.append(f"| {report.name} | {batch} | {row['fp32_ips']:.1f} | {row['int8_ips']:.1f} | "
                         f"{row['ort_ips']:.1f} | {row['speedup']:.2f}x | {row['ort_speedup']:.2f}x | "
                         f"{row['vs_ort']:.2f}x | {', '.join(goals) or '-'}{' (noisy)' if row['noisy'] else ''} |")
    lines += ["", "## Accuracy on the evaluation split", "",
              "| model | variant | top-1 | top-1 agreement with FP32 | cosine mean (min) | samples |",
              "|---|---|---|---|---|---|"]
    for report in reports:
        for key, row in report.accuracy.items():
            top1 = f"{100 * row['top1']:.2f}%" if "top1" in row else "-"
            lines.append(f"| {report.name} | {key} | {top1} | {100 * row['top1_agreement']:.1f}% | "
                         f"{row['cosine_mean']:.4f} ({row['cosine_min']:.4f}) | {row['samples']} |")
    lines += ["", "## Build", "",
              "| model | calibration | build s | guard (batch, FP32 ms, INT8 ms, x) | automatic float nodes | "
              "fused ops | TensorRT checker |", "|---|---|---|---|---|---|---|"]
    for report in reports:
        if report.error:
            lines.append(f"| {report.name} | error: {report.error} | | | | | |")
            continue
        guard = report.build.get("guard") or {}
        guard_text = (f"{guard.get('batch')}, {guard.get('fp32_ms', 0):.1f}, {guard.get('int8_ms', 0):.1f}, "
                      f"{guard.get('speedup', 0):.2f}x") if guard else "-"
        fused = ", ".join(f"{op} {n}" for op, n in report.build.get("fused_ops", {}).items())
        checker = "pass" if not report.checker else f"{len(report.checker)} problems: {report.checker[0]}"
        lines.append(f"| {report.name} | {report.calibration} | {report.build.get('seconds')} | {guard_text} | "
                     f"{report.build.get('automatic')} | {fused} | {checker} |")
    found = failures(reports)
    lines += ["", "## Targets", ""]
    lines += [f"- FAIL: {text}" for text in found] or ["- all targets met"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
