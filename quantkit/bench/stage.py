"""Stage 4: FP32 vs INT8 latency, throughput and accuracy, with gates and reports.

Inputs: ``model.onnx`` (FP32 reference, from export) and ``model.int8.onnx``
with its manifest ``build.json`` (from build-engine), which must be fresh. Both
run under the same backend runner contract, on the same data, with the same
threads. Order of work: validate everything cheap (batch sizes, gates, baseline,
artifacts, labels) -> accuracy pass over the evaluation data -> timing ->
reports -> gates. A failed gate or a regression against ``--compare`` raises
:class:`~quantkit.errors.GateFailedError` (exit 3) *after* the reports are written.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from quantkit.artifacts import ModelWorkspace, atomic_write_text, sha256_bytes, sha256_file
from quantkit.bench import report
from quantkit.bench.accuracy import AccuracyReport, evaluate_accuracy
from quantkit.bench.gates import (PERF_TOLERANCE, Comparison, GateResult, check_gate_batches, compare_payloads,
                                  evaluate_gates, format_number, load_baseline, metric_value, parse_cli_gates)
from quantkit.bench.timing import NOISE_THRESHOLD, BatchTiming, TimingSettings, benchmark
from quantkit.config import Config
from quantkit.data import Dataset, open_dataset
from quantkit.errors import (ConfigError, GateFailedError, MissingArtifactError, NotAvailableError, QuantkitError,
                             UsageError)
from quantkit.gates import Gate
from quantkit.ui import Console

MANIFEST = "bench.json"
MARKDOWN = "bench.md"
BUILD_MANIFEST = "build.json"
# backend -> (FP32 reference, INT8 artifact) in the model's artifact directory
ARTIFACTS = {"onnxruntime": ("model.onnx", "model.int8.onnx")}


@dataclass
class BenchResult:
    """What a bench run measured and decided; :meth:`to_json` is the bench.json content."""

    model_name: str
    config_path: str | None
    backend: str
    fp32_path: Path
    int8_path: Path
    fp32_sha256: str
    int8_sha256: str
    settings: dict[str, Any]
    data_path: str
    environment: dict[str, Any]
    timing: list[BatchTiming]
    accuracy: AccuracyReport
    fingerprint: dict[str, Any]
    created: str
    gates: list[GateResult] = field(default_factory=list)
    comparison: Comparison | None = None
    notes: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    payload: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def failed_gates(self) -> list[GateResult]:
        return [gate for gate in self.gates if not gate.passed]

    @property
    def passed(self) -> bool:
        return not self.failed_gates and not (self.comparison and self.comparison.regressions)

    def to_json(self) -> dict[str, Any]:
        return self.payload or report.build_payload(self)


# --------------------------------------------------------------------------- fingerprint


def _build_fingerprint(cfg: Config, ws: ModelWorkspace) -> dict[str, Any]:
    """The INT8 build's fingerprint (imported lazily: quantkit.build is its own stage)."""
    try:
        from quantkit.build import build_fingerprint
    except ImportError as exc:
        raise NotAvailableError(f"cannot check the INT8 artifact: the build stage is not available ({exc})") from None
    return build_fingerprint(cfg, ws)


def bench_fingerprint(cfg: Config, ws: ModelWorkspace) -> dict[str, Any]:
    """What a bench run with ``cfg``'s settings depends on (cheap; never raises for missing inputs).

    Contains ``passed: True``; a run whose gates failed records ``passed: False``, so
    ``quantkit run`` never treats a failed bench as up to date.
    """
    fp32_name, int8_name = ARTIFACTS["onnxruntime"]
    backend = "onnxruntime" if cfg.build.backend == "auto" else cfg.build.backend
    if backend in ARTIFACTS:
        fp32_name, int8_name = ARTIFACTS[backend]
    return _fingerprint(cfg, ws, backend=backend, settings=_cfg_settings(cfg), threads=cfg.bench.threads,
                        gates=[gate.text for gate in cfg.bench.parsed_gates()], fp32=ws.path(fp32_name),
                        int8=ws.path(int8_name), passed=True)


def _fingerprint(cfg: Config, ws: ModelWorkspace, *, backend: str, settings: dict[str, Any], threads: int | None,
                 gates: Sequence[str], fp32: Path, int8: Path, passed: bool) -> dict[str, Any]:
    try:
        data_hash = _open_eval_data(cfg)[0].fingerprint()
    except (QuantkitError, OSError):
        data_hash = None
    return {
        "backend": backend,
        "settings": {**settings, "threads": threads},
        "gates": list(gates),
        "data": {"sha": data_hash, "labels": cfg.bench.labels, "max_samples": cfg.bench.max_samples},
        "fp32_sha256": sha256_file(fp32) if fp32.is_file() else None,
        "int8_sha256": sha256_file(int8) if int8.is_file() else None,
        "passed": passed,
    }


def _cfg_settings(cfg: Config) -> dict[str, Any]:
    bench = cfg.bench
    return {"batch_sizes": list(dict.fromkeys(bench.batch_sizes)), "warmup_ms": bench.warmup_ms,
            "duration_s": float(bench.duration_s),
            "min_iterations": bench.min_iterations, "repeats": bench.repeats}


# --------------------------------------------------------------------------- the stage


def run_bench(cfg: Config, ws: ModelWorkspace, console: Console, *, backend: str | None = None,
              batch_sizes: Sequence[int] | None = None, duration: float | None = None, threads: int | None = None,
              gates: Iterable[str | Gate] = (), compare: str | Path | None = None, json_path: str | Path | None = None,
              markdown_path: str | Path | None = None, compare_tolerance: float = PERF_TOLERANCE) -> BenchResult:
    """Benchmark the INT8 artifact against the FP32 model and write bench.json / bench.md.

    Args:
        cfg: the validated config (``bench`` section: batch sizes, timing, data, gates).
        ws: the model's artifact directory.
        console: where progress and the summary table go (``--quiet`` silences them).
        backend: overrides ``build.backend`` (``auto`` means onnxruntime on CPU).
        batch_sizes: override ``bench.batch_sizes``; each must lie in ``build.profile``.
        duration: override ``bench.duration_s`` (seconds of timing per run, at least).
        threads: override ``bench.threads`` (default: physical cores).
        gates: extra gates (strings are parsed; a bad one is a UsageError), checked with the config's.
        compare: a baseline bench.json; regressions beyond ``compare_tolerance`` fail like gates.
        json_path: also write bench.json here; ``"-"`` prints it on stdout (and nothing else there).
        markdown_path: also write bench.md here.
        compare_tolerance: relative tolerance for timing figures in the comparison (0.10 = 10 %).

    Returns:
        The result (also written to ``<workdir>/<name>/bench.json`` and ``bench.md``).

    Raises:
        UsageError / ConfigError (exit 2): batch sizes outside the profile, bad gates, a label
            gate without labels, an unreadable baseline.
        MissingArtifactError / StaleArtifactError (exit 1): no or outdated INT8 artifact.
        GateFailedError (exit 3): a gate failed or a regression was found; reports are written first.
    """
    start = time.perf_counter()
    to_stdout = str(json_path) == "-" if json_path is not None else False
    out = Console(verbosity=console.verbosity, json_mode=True) if to_stdout else console
    settings, requested_threads = _settings(cfg, batch_sizes, duration, threads)
    all_gates = cfg.bench.parsed_gates() + parse_cli_gates(gates)
    check_gate_batches(all_gates, settings["batch_sizes"])
    baseline = load_baseline(compare) if compare is not None else None
    if not 0 <= compare_tolerance < 1:
        raise UsageError(f"compare tolerance must be in [0, 1), got {compare_tolerance}")
    backend_name = _backend_name(cfg, backend)
    backend_impl = _get_backend(backend_name)
    fp32_path, int8_path = _check_artifacts(cfg, ws, backend_name)
    dataset, data_path, notes = _open_eval_data(cfg)
    for note in notes:
        out.warn(note)
    use_labels = _check_labels(cfg, dataset, all_gates)

    runners = {name: backend_impl.open_runner(path, threads=settings["threads"])
               for name, path in (("fp32", fp32_path), ("int8", int8_path))}
    with ExitStack() as stack:
        for runner in runners.values():
            stack.enter_context(runner)
        _check_batch_axis(runners, settings["batch_sizes"])
        accuracy = _accuracy_pass(runners, dataset, max(settings["batch_sizes"]), use_labels, out)
        _check_gates_available(all_gates, accuracy)
        timing = _timing_pass(runners, dataset, settings, out)
        env = report.environment(threads=settings["threads"],
                                 providers={name: r.providers for name, r in runners.items()})

    warnings = accuracy.notes + [f"skipped unreadable file {path}: {why}" for path, why in dataset.skipped]
    warnings += _noise_notes(timing, settings["repeats"]) + _cpu_notes(env)
    for note in warnings:
        out.warn(note)
    notes += warnings
    result = BenchResult(
        model_name=cfg.name,
        config_path=str(cfg.source_path) if cfg.source_path else None,
        backend=backend_name,
        fp32_path=fp32_path, int8_path=int8_path,
        fp32_sha256=sha256_file(fp32_path), int8_sha256=sha256_file(int8_path),
        settings=settings, data_path=data_path, environment=env, timing=timing, accuracy=accuracy,
        fingerprint={}, created=datetime.now(timezone.utc).isoformat(timespec="seconds"), notes=notes,
    )
    partial = report.build_payload(result)
    result.gates = evaluate_gates(all_gates, partial)
    if baseline is not None:
        result.comparison = compare_payloads(partial, baseline, baseline=str(compare), tolerance=compare_tolerance)
    result.fingerprint = _fingerprint(cfg, ws, backend=backend_name, settings=_effective(settings),
                                      threads=requested_threads, gates=[g.text for g in all_gates],
                                      fp32=fp32_path, int8=int8_path, passed=result.passed)
    result.seconds = time.perf_counter() - start
    _write_reports(result, ws, json_path, markdown_path, to_stdout)
    out.result(report.terminal_table(result.payload))
    if to_stdout:
        sys.stdout.write(report.dumps(result.payload))
        sys.stdout.flush()
    out.info(f"wrote {', '.join(str(p) for p in result.written)} in {result.seconds:.1f} s")
    if not result.passed:
        error = GateFailedError(_failure_message(result))
        error.result = result  # type: ignore[attr-defined]
        raise error
    return result


def describe(result: BenchResult) -> str:
    """One summary line: speedups, accuracy, gates, where the report is."""
    speedups = ", ".join(f"{row.speedup().median:.2f}x @{row.batch_size}" for row in result.timing)
    parts = [f"INT8 vs FP32 speedup {speedups}"]
    cosine = min((o.cosine for o in result.accuracy.outputs), default=float("nan"))
    parts.append(f"cosine {cosine:.5f}")
    if result.accuracy.labels:
        labels = result.accuracy.labels
        parts.append(f"top-1 {labels.fp32.top1:.2f}% -> {labels.int8.top1:.2f}%")
    if result.gates:
        parts.append(f"gates {sum(g.passed for g in result.gates)}/{len(result.gates)} passed")
    if result.comparison is not None:
        parts.append(f"{len(result.comparison.regressions)} regression(s) vs baseline")
    where = f"; report {result.written[0]}" if result.written else ""
    return "; ".join(parts) + where


# --------------------------------------------------------------------------- checks


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32] (for the CLI).

    Raises:
        UsageError: not a comma-separated list of positive integers.
    """
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--batch-sizes {text!r}: expected comma-separated integers, e.g. 1,8,32") from None
    if not sizes or any(size < 1 for size in sizes):
        raise UsageError(f"--batch-sizes {text!r}: expected positive integers, e.g. 1,8,32")
    return sizes


def _settings(cfg: Config, batch_sizes: Sequence[int] | None, duration: float | None,
              threads: int | None) -> tuple[dict[str, Any], int | None]:
    from quantkit.backends.onnxruntime.runner import physical_cores

    sizes = list(dict.fromkeys(batch_sizes if batch_sizes is not None else cfg.bench.batch_sizes))
    where = "--batch-sizes" if batch_sizes is not None else "bench.batch_sizes"
    profile = cfg.build.profile
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise UsageError(f"{where} {sizes}: expected positive integers")
    outside = [s for s in sizes if not profile.min <= s <= profile.max]
    if outside:
        raise UsageError(f"{where} {outside} lie outside the artifact's optimization range build.profile "
                         f"[{profile.min}, {profile.max}]; pick sizes in the range or rebuild with a wider profile")
    if duration is not None and not duration > 0:
        raise UsageError(f"--duration must be > 0 seconds, got {duration}")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    requested = threads if threads is not None else cfg.bench.threads
    settings = {**_cfg_settings(cfg), "batch_sizes": sizes,
                "duration_s": float(duration if duration is not None else cfg.bench.duration_s),
                "threads": requested if requested is not None else physical_cores()}
    return settings, requested


def _effective(settings: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in settings.items() if key != "threads"}


def _backend_name(cfg: Config, backend: str | None) -> str:
    name = backend or cfg.build.backend
    # auto: the CPU path; when a TensorRT runner exists, auto follows what build.json recorded
    return "onnxruntime" if name == "auto" else name


def _get_backend(name: str):
    from quantkit.backends.base import get_backend

    if name not in ARTIFACTS:
        raise NotAvailableError(f"bench on backend {name!r} is not available yet; use --backend onnxruntime")
    return get_backend(name)


def _check_artifacts(cfg: Config, ws: ModelWorkspace, backend: str) -> tuple[Path, Path]:
    fp32_name, int8_name = ARTIFACTS[backend]
    fp32, int8 = ws.path(fp32_name), ws.path(int8_name)
    if not fp32.is_file():
        raise MissingArtifactError(f"FP32 model not found: {fp32} does not exist",
                                   hint=f"run: quantkit export {cfg.source_path or cfg.name}")
    if not int8.is_file():
        raise MissingArtifactError(f"INT8 artifact not found: {int8} does not exist",
                                   hint=f"run: quantkit build-engine {cfg.source_path or cfg.name}")
    ws.require_fresh(BUILD_MANIFEST, _build_fingerprint(cfg, ws), "INT8 artifact")
    return fp32, int8


def _open_eval_data(cfg: Config) -> tuple[Dataset, str, list[str]]:
    """The evaluation dataset, its path, and notes for the report (the fallback to calibration data)."""
    notes = []
    if cfg.bench.data is not None:
        path, fmt = cfg.bench.data, "auto"
    else:
        path, fmt = cfg.calibration.data, cfg.calibration.format
        notes.append("bench.data is not set: accuracy is measured on the calibration data, "
                     "which flatters INT8 (its ranges were fitted to it)")
    dataset = open_dataset(path, cfg.model.inputs, fmt=fmt, preprocess=cfg.calibration.preprocess,
                           max_samples=cfg.bench.max_samples, on_bad_file=cfg.calibration.on_bad_file)
    return dataset, str(path), notes


def dataset_has_labels(dataset: Dataset) -> bool:
    """Image folders: one subfolder per class; tensors: every .npz has a 'labels' key."""
    if dataset.format == "images":
        return dataset.has_labels
    from quantkit.data import LABELS_KEY

    for path in dataset.files:
        if path.suffix.lower() != ".npz":
            return False
        with np.load(path, allow_pickle=False) as npz:
            if LABELS_KEY not in npz.files:
                return False
    return True


def _check_labels(cfg: Config, dataset: Dataset, gates: Sequence[Gate]) -> bool:
    needing = [gate.text for gate in gates if gate.needs_labels]
    if cfg.bench.labels == "none":
        if needing:  # config validation catches YAML gates; this catches CLI ones
            raise UsageError(f"gate(s) {needing} need labels, but bench.labels is 'none'")
        return False
    has = dataset_has_labels(dataset)
    if needing and not has:
        raise ConfigError(f"gate(s) {needing} need labels, but the evaluation data {dataset.root} has none "
                          "(image folders need one subfolder per class, .npz files a 'labels' key)")
    return has


def _check_batch_axis(runners: dict[str, Any], batch_sizes: Sequence[int]) -> None:
    for name, runner in runners.items():
        for spec in runner.input_specs:
            first = spec.shape[0] if spec.shape else None
            wrong = [b for b in batch_sizes if isinstance(first, int) and first != b]
            if wrong:
                raise UsageError(f"the {name.upper()} artifact fixes the batch of input {spec.name!r} to {first}; "
                                 f"batch sizes {wrong} cannot run on it")


def _check_gates_available(gates: Sequence[Gate], accuracy: AccuracyReport) -> None:
    """Accuracy gates whose value cannot exist (no [N, C] output, <= 5 classes) fail fast, before timing."""
    partial = {"accuracy": accuracy.to_json()}
    for gate in gates:
        if gate.metric in ("speedup", "p99_ms"):
            continue
        value, why = metric_value(partial, gate)
        if value is None:
            raise ConfigError(f"gate {gate.text!r} cannot be evaluated for this model: {why}")


# --------------------------------------------------------------------------- the work


def _accuracy_pass(runners: dict[str, Any], dataset: Dataset, batch_size: int, use_labels: bool,
                   console: Console) -> AccuracyReport:
    with console.progress(dataset.planned_samples(), "accuracy", unit="sample") as bar:
        return evaluate_accuracy(runners["fp32"], runners["int8"], dataset.batches(batch_size, remainder="pad"),
                                 batch_size=batch_size, use_labels=use_labels, on_batch=bar.update)


def _timing_feeds(dataset: Dataset, batch_sizes: Sequence[int]) -> dict[int, dict[str, np.ndarray]]:
    """One real batch per size (padded by repeating the last sample when the data is smaller)."""
    feeds = {}
    for size in batch_sizes:
        batch = next(iter(dataset.batches(size, remainder="pad")))
        if batch.size < size:
            # fewer samples than the batch: cycle them (timing needs the shape, not distinct samples)
            batch.inputs = {name: np.resize(array[:batch.size], array.shape) for name, array in batch.inputs.items()}
        feeds[size] = batch.inputs
    return feeds


def _timing_pass(runners: dict[str, Any], dataset: Dataset, settings: dict[str, Any],
                 console: Console) -> list[BatchTiming]:
    feeds = _timing_feeds(dataset, settings["batch_sizes"])
    timing = TimingSettings(settings["warmup_ms"], settings["duration_s"], settings["min_iterations"])
    total = settings["repeats"] * len(feeds) * len(runners)
    with console.progress(total, "timing", unit="run") as bar:
        def advance(name: str, size: int, run) -> None:
            bar.update(1, model=name, batch=size, items_s=f"{run.throughput:.0f}")

        return benchmark(runners, feeds, timing, settings["repeats"], on_run=advance)


def _noise_notes(timing: list[BatchTiming], repeats: int) -> list[str]:
    if repeats < 2:
        return ["1 repeat: the spread over repeats (machine noise) is unknown; set bench.repeats >= 3"]
    notes = []
    for row in timing:
        for name, variant in row.variants.items():
            width = variant.throughput.relative_width
            if width > NOISE_THRESHOLD:
                notes.append(f"throughput varied by {width * 100:.0f}% over repeats ({name.upper()}, batch "
                              f"{row.batch_size}): the machine is noisy; compare spreads, not single figures")
    return notes


def _cpu_notes(env: dict[str, Any]) -> list[str]:
    cpu = env["cpu"]
    if cpu["vnni"] or cpu["amx"]:
        return []
    return ["this CPU has neither VNNI nor AMX: INT8 runs on slower paths, expect little or no speedup"]


def _write_reports(result: BenchResult, ws: ModelWorkspace, json_path: str | Path | None,
                   markdown_path: str | Path | None, to_stdout: bool) -> None:
    payload = report.build_payload(result)
    markdown = report.to_markdown(payload)
    payload["outputs"] = {MARKDOWN: sha256_bytes(markdown.encode("utf-8"))}
    text = report.dumps(payload)
    targets_md = [ws.path(MARKDOWN)] + ([Path(markdown_path)] if markdown_path is not None else [])
    targets_json = [ws.path(MANIFEST)] + ([Path(json_path)] if json_path is not None and not to_stdout else [])
    for path in dict.fromkeys(p.resolve() for p in targets_md):
        atomic_write_text(path, markdown)
        result.written.append(path)
    for path in dict.fromkeys(p.resolve() for p in targets_json):
        atomic_write_text(path, text)
        result.written.append(path)
    result.written.sort(key=lambda p: p.suffix != ".json")  # bench.json first
    result.payload = payload


def _failure_message(result: BenchResult) -> str:
    parts = []
    for gate in result.failed_gates:
        value = "n/a" if gate.value is None else format_number(gate.value)
        parts.append(f"{gate.gate.text} (value {value}{', ' + gate.detail if gate.detail else ''})")
    if result.comparison is not None:
        parts += [f"{item.metric}{'@' + str(item.batch_size) if item.batch_size else ''} regressed "
                  f"vs {result.comparison.baseline}" for item in result.comparison.regressions]
    where = result.written[0] if result.written else "bench.json"
    return f"bench failed: {'; '.join(parts)} (report: {where})"
