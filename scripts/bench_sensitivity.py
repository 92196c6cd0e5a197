#!/usr/bin/env python
"""Issue 8's "Done means": the automatic sensitive-layer search, measured, into docs/benchmarks.md.

Needs each model exported and calibrated in WORKDIR, e.g.::

    for m in mobilenet_v3_small resnet18 digits_cnn; do
        quantkit --workdir /tmp/sens run --stop-after calibrate configs/$m.yaml; done
    python scripts/bench_sensitivity.py --workdir /tmp/sens

For each model the config's own ``build.fallback.auto`` is replaced by the budget below
(``--metric``/``--target``, cap ``--max-fraction`` of the quantizable nodes) and:

1. ONNX Runtime's ``quantize_static`` with its defaults on the same calibration images (MobileNetV3
   only, the issue's reference point), scored like the rest;
2. ``quantkit.sensitivity.run_sensitivity`` on the config's evaluation data (``bench.data``): the
   all-INT8 figures, the chosen nodes, the search time;
3. the same with half of the evaluation data held out: chosen on the first half, reported on the
   second (selecting and reporting on the same samples is optimistic);
4. ``quantkit.build.build_engine`` with the automatic fallback: the speed guard's FP32/INT8 figures,
   and the written ``model.int8.onnx`` scored on all evaluation samples;
5. with ``--minmax``: steps 2 and 4 again with min/max calibration (``calibration.method: minmax``,
   in ``WORKDIR/minmax``), to separate what the calibration and the fallback each contribute.

The section between ``<!-- sensitivity:start -->`` and ``<!-- sensitivity:end -->`` of
docs/benchmarks.md is replaced (appended when missing) with the tables, the machine and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from docsection import replace_section  # scripts/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
MODELS = ("mobilenet_v3_small", "digits_cnn", "resnet18")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="quantkit workdir with model.onnx + calib.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--metric", default="top1_agreement", choices=("top1_agreement", "cosine"))
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--max-fraction", type=float, default=0.10)
    parser.add_argument("--minmax", action="store_true", help="also run with min/max calibration (MobileNetV3)")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    from quantkit.errors import QuantkitError

    rows = []
    for name in args.models:
        try:
            rows += bench_model(name, args)
        except QuantkitError as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            print(f"run: quantkit --workdir {args.workdir} run --stop-after calibrate configs/{name}.yaml",
                  file=sys.stderr)
            return 1
    command = " ".join(shlex.quote(part) for part in ["python", "scripts/bench_sensitivity.py", *argv])
    section = render(rows, args, command)
    replace_section("sensitivity", section, args.doc)
    print(section)
    print(f"wrote {args.doc}")
    return 0


# --------------------------------------------------------------------------- one model


def load(name: str, args, holdout: float = 0.0, method: str | None = None):
    """The reference config with the benchmark's budget as ``build.fallback.auto``."""
    from quantkit.config import load_config

    path = REPO / "configs" / f"{name}.yaml"
    plain = load_config(path)
    auto = {"metric": args.metric, "target": args.target, "max_fraction": args.max_fraction, "holdout": holdout}
    overrides: dict[str, Any] = {"build.fallback": {"nodes": plain.build.fallback_patterns, "auto": auto},
                                 "build.backend": "onnxruntime"}
    if method:
        overrides["calibration.method"] = method
    return load_config(path, overrides)


def bench_model(name: str, args) -> list[dict[str, Any]]:
    from quantkit.artifacts import ModelWorkspace
    from quantkit.ui import Console

    console = Console()
    cfg = load(name, args)
    ws = ModelWorkspace(args.workdir, cfg.name)
    rows = []
    if name == "mobilenet_v3_small":
        rows.append(ort_default_row(cfg, ws, console))
    rows.append(search_row(cfg, ws, console, f"{name}", build=True))
    if name != "digits_cnn":
        rows.append(search_row(load(name, args, holdout=0.5), ws, console, f"{name}, held-out half", build=False))
    if args.minmax and name == "mobilenet_v3_small":
        mm_cfg = load(name, args, method="minmax")
        mm_ws = minmax_workspace(mm_cfg, ws, args.workdir / "minmax", console)
        rows.append(search_row(mm_cfg, mm_ws, console, f"{name}, min/max calibration", build=True))
        rows.append(search_row(load(name, args, holdout=0.5, method="minmax"), mm_ws, console,
                               f"{name}, min/max calibration, held-out half", build=False))
    return rows


def search_row(cfg, ws, console, label: str, build: bool) -> dict[str, Any]:
    from quantkit import sensitivity

    console.info(f"[{label}] sensitivity search")
    load_before = os.getloadavg()[0]
    tick = time.perf_counter()
    result = sensitivity.run_sensitivity(cfg, ws, console, force=True)
    seconds = time.perf_counter() - tick
    console.info(f"[{label}] {sensitivity.describe(result)}")
    row = {"label": label, "kind": "search", "result": result.to_json(), "seconds": seconds,
           "load": (load_before, os.getloadavg()[0])}
    if build:
        row.update(build_figures(cfg, ws, console))
    return row


def build_figures(cfg, ws, console) -> dict[str, Any]:
    """Build with the automatic fallback; the guard's timing and the artifact scored on all eval samples."""
    import onnx

    from quantkit import build

    result = build.build_engine(cfg, ws, console)
    console.info(build.describe(result))
    scores = score_models(cfg, ws, {"artifact": onnx.load(str(result.cpu_path))})
    reasons = Counter(node["cpu"]["reason"] for node in result.nodes
                      if node.get("cpu", {}).get("precision") == "fp32")
    return {"guard": result.timing.to_json() if result.timing else None, "artifact": scores["artifact"],
            "float_reasons": dict(reasons), "samples_all": scores["samples"]}


def ort_default_row(cfg, ws, console) -> dict[str, Any]:
    """ONNX Runtime's quantize_static with its defaults, on the calibration images."""
    import tempfile

    import onnx
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    from quantkit.calibrate import calibration_dataset

    console.info(f"[{cfg.name}] ONNX Runtime quantize_static (defaults)")
    batches = calibration_dataset(cfg).batches(cfg.calibration.batch_size)

    class Reader(CalibrationDataReader):
        def get_next(self):
            batch = next(batches, None)
            return None if batch is None else batch.inputs

    with tempfile.TemporaryDirectory(prefix="quantkit-ort-") as tmp:
        out = Path(tmp) / "ort_default.onnx"
        quantize_static(str(ws.onnx_model), str(out), Reader())
        scores = score_models(cfg, ws, {"ort": onnx.load(str(out))})
    return {"label": f"{cfg.name}, ORT quantize_static defaults", "kind": "reference", "artifact": scores["ort"],
            "samples_all": scores["samples"]}


def score_models(cfg, ws, models: dict[str, Any]) -> dict[str, Any]:
    """Each model against FP32 on every evaluation sample (the search's scorer, all samples)."""
    import onnx

    from quantkit import sensitivity
    from quantkit.qdq.fallback_search import OutputScorer

    settings = sensitivity.auto_settings(cfg).model_copy(update={"samples": None, "holdout": 0.0})
    batches, _, _, _ = sensitivity.evaluation_batches(cfg, settings)
    scorer = OutputScorer(onnx.load(str(ws.onnx_model)), batches)
    scores = {key: scorer.score(model).to_json() for key, model in models.items()}
    scores["samples"] = sum(b.size for b in batches)
    return scores


def minmax_workspace(cfg, ws, workdir: Path, console):
    """A workspace with the same model.onnx, calibrated with min/max."""
    from quantkit.artifacts import ModelWorkspace
    from quantkit.calibrate import calibrate

    target = ModelWorkspace(workdir, cfg.name)
    target.root.mkdir(parents=True, exist_ok=True)
    for name in ("model.onnx", "export.json"):
        shutil.copy2(ws.path(name), target.path(name))
    console.info(f"[{cfg.name}] min/max calibration into {target.root}")
    calibrate(cfg, target, console)
    return target


# --------------------------------------------------------------------------- report


def render(rows: list[dict[str, Any]], args, command: str) -> str:
    import onnxruntime

    lines = ["<!-- generated by scripts/bench_sensitivity.py: edit the script, not this section -->", "",
             "## Automatic fallback: sensitive-layer search (issue 8)", "",
             f"Machine: {machine()}; 2 ORT threads; onnxruntime {onnxruntime.__version__}; "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}. Shared host: timings are noisy.", "",
             f"Command: `{command}`", "",
             f"Budget: {args.metric} >= {args.target:g} against FP32, at most {100 * args.max_fraction:g} % of the "
             "quantizable nodes in float. *select* = the samples the nodes were chosen on, *report* = the "
             "figure on samples not used for choosing (held-out half) or on all of them (the built artifact).", "",
             "| run | quantizable | in float | all-INT8 top-1 agr. / cosine | chosen set top-1 agr. / cosine "
             "| budget met | search s (models) | built artifact (samples); its fp32 nodes by reason "
             "| speed guard FP32 → INT8 ms |",
             "|:---|---:|---:|:---|:---|:---|---:|:---|:---|"]
    for row in rows:
        lines.append(render_row(row))
    lines += ["", "Figures are *select* unless marked *report*. The all-INT8 and chosen-set columns of a "
                  "held-out row are measured on the held-out half; its chosen set was picked on the other half. "
                  "The built artifact also carries the speed guard's float regions (reason `automatic`), chosen "
                  "after the search for speed, which change its accuracy too.",
              ""]
    return "\n".join(lines)


def render_row(row: dict[str, Any]) -> str:
    def pair(score: dict | None) -> str:
        if not score:
            return "-"
        agreement = score.get("top1_agreement")
        cosine = score.get("cosine")
        return f"{'-' if agreement is None else f'{agreement:.3f}'} / {'-' if cosine is None else f'{cosine:.4f}'}"

    if row["kind"] == "reference":
        return (f"| {row['label']} | | | | | | | {pair(row['artifact'])} ({row['samples_all']} samples) | |")
    result = row["result"]
    held = result.get("holdout")
    base = pair(held["baseline"]) + " *report*" if held else pair(result["baseline"])
    final = pair(held["final"]) + " *report*" if held else pair(result["final"])
    guard = row.get("guard")
    guard_text = (f"{guard['fp32_ms']:.1f} → {guard['int8_ms']:.1f} ({guard['speedup']:.2f}x, batch {guard['batch']})"
                  if guard else "-")
    artifact = "-"
    if row.get("artifact"):
        reasons = row.get("float_reasons") or {}
        floats = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
        artifact = f"{pair(row['artifact'])} ({row['samples_all']}); fp32: {floats or 'none'}"
    chosen = len(result["chosen"])
    percent = 100 * chosen / result["quantizable"] if result["quantizable"] else 0
    return (f"| {row['label']} | {result['quantizable']} | {chosen} ({percent:.0f} %, cap {result['cap']}) | {base} "
            f"| {final} | {'yes' if result['met'] else '**no**'} | {row['seconds']:.0f} ({result['evaluations']}) "
            f"| {artifact} | {guard_text} |")


def machine() -> str:
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
        vnni = "avx512_vnni" in Path("/proc/cpuinfo").read_text()
    except OSError:
        model, vnni = platform.processor() or platform.machine(), False
    return f"{model}, {os.cpu_count()} logical cores{' (AVX512-VNNI)' if vnni else ''}, {platform.system()}"


if __name__ == "__main__":
    sys.exit(main())
