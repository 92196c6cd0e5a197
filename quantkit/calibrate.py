"""Stage 2: INT8 ranges for every tensor the build quantizes -> ``calib.cache`` + ``calib.json``.

Batches stream through an ONNX Runtime session whose graph also outputs the
tensors to calibrate; each batch's activations update per-tensor histograms
(:mod:`quantkit.calib.histogram`) and are dropped, so memory stays flat in the
number of images. A method (:mod:`quantkit.calib.methods`) then turns each
histogram into an amax. Outputs:

* ``calib.cache`` — TensorRT's text cache (scale = amax/127 per tensor).
  Header algorithm: ``EntropyCalibration2`` for entropy, percentile and mse
  (quantkit's TensorRT-10 path feeds the cache through an
  ``IInt8EntropyCalibrator2``, whose header TensorRT checks), ``MinMaxCalibration``
  for minmax. ``calib.json`` records the method actually used per tensor.
* ``calib.json`` — the manifest (fingerprint: model, data, method, parameters,
  versions) plus per tensor amax, scale, signed min/max, method, parameters and
  the fraction of values clipped.
"""

from __future__ import annotations

import fnmatch
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from quantkit.artifacts import (Manifest, ModelWorkspace, atomic_write_bytes, atomic_write_json, library_versions,
                                sha256_file)
from quantkit.config import Config
from quantkit.data import Batch, Dataset, open_dataset
from quantkit.errors import DataError, MissingArtifactError, ModelError
from quantkit.ui import Console

MANIFEST = "calib.json"
CACHE = "calib.cache"
_CACHE_ALGORITHM = {"entropy": "EntropyCalibration2", "percentile": "EntropyCalibration2",
                    "mse": "EntropyCalibration2", "minmax": "MinMaxCalibration"}


@dataclass(frozen=True)
class TensorCalibration:
    """The calibrated range of one tensor."""

    name: str
    amax: float
    scale: float
    min: float
    max: float
    method: str
    params: dict[str, Any]
    clipped_fraction: float
    zero_fraction: float

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in vars(self).items() if key != "name"}


@dataclass
class CalibrationResult:
    cache_path: Path
    json_path: Path
    tensors: list[TensorCalibration]
    samples: int
    batches: int
    seconds: float
    skipped: list[tuple[str, str]] = field(default_factory=list)
    all_zero: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "cache": self.cache_path.name,
            "json": self.json_path.name,
            "tensors": len(self.tensors),
            "samples": self.samples,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "skipped_files": [{"file": f, "reason": r} for f, r in self.skipped],
            "all_zero_tensors": self.all_zero,
        }


def calibration_dataset(cfg: Config) -> Dataset:
    cal = cfg.calibration
    return open_dataset(cal.data, cfg.model.inputs, fmt=cal.format, preprocess=cal.preprocess,
                        max_samples=cal.max_samples, on_bad_file=cal.on_bad_file)


def calibration_fingerprint(cfg: Config, ws: ModelWorkspace) -> dict[str, Any]:
    """Everything the calibration depends on: model, data, method and parameters."""
    cal = cfg.calibration
    return {
        "model_sha256": sha256_file(ws.onnx_model) if ws.onnx_model.exists() else None,
        "data": calibration_dataset(cfg).fingerprint(),
        "method": cal.method,
        "percentile": cal.percentile,
        "overrides": {k: v.model_dump() for k, v in cal.overrides.items()},
        "batch_size": cal.batch_size,
        "max_samples": cal.max_samples,
        "remainder": cal.remainder,
        "trt_cache_version": cal.trt_cache_version,
        "quantkit": library_versions()["quantkit"],
    }


def calibrate(cfg: Config, ws: ModelWorkspace, console: Console) -> CalibrationResult:
    """Calibrate ``model.onnx`` on the configured data and write the cache and report.

    Raises:
        MissingArtifactError: no ``model.onnx`` (run ``quantkit export`` first).
        DataError: no data, data that does not fit, NaN/Inf in an activation.
    """
    from quantkit.calib.cache import amax_to_scale, write_trt_cache

    from quantkit.export import MANIFEST as EXPORT_MANIFEST, export_fingerprint

    start = time.perf_counter()
    if not ws.onnx_model.exists():
        raise MissingArtifactError(f"{ws.onnx_model} does not exist: run `quantkit export` first")
    ws.require_fresh(EXPORT_MANIFEST, export_fingerprint(cfg), "model.onnx (run `quantkit export` again)")
    fingerprint = calibration_fingerprint(cfg, ws)
    targets = calibration_targets_of(ws.onnx_model)
    dataset = calibration_dataset(cfg)
    stats, samples, batches = collect_statistics(ws.onnx_model, targets, dataset, cfg, console)
    tensors, all_zero = compute_ranges(stats, cfg)
    for name in all_zero:
        console.detail(f"tensor {name!r} was all zeros on the calibration data: amax 0, smallest scale")
    cal = cfg.calibration
    cache = write_trt_cache({t.name: amax_to_scale(t.amax) for t in tensors}, cal.trt_cache_version,
                            _CACHE_ALGORITHM[cal.method])
    elapsed = time.perf_counter() - start
    result = CalibrationResult(ws.path(CACHE), ws.path(MANIFEST), tensors, samples, batches, elapsed,
                               list(dataset.skipped), all_zero)
    atomic_write_bytes(ws.path(CACHE), cache)
    manifest = Manifest(
        stage="calibrate",
        fingerprint=fingerprint,
        outputs={CACHE: sha256_file(ws.path(CACHE))},
        versions=library_versions(),
        details={k: v for k, v in result.to_json().items() if k != "seconds"},  # keep the file reproducible
    )
    payload = manifest.to_json()
    payload["tensors"] = {t.name: t.to_json() for t in tensors}
    atomic_write_json(ws.path(MANIFEST), payload)
    return result


def describe(result: CalibrationResult) -> str:
    clipped = max((t.clipped_fraction for t in result.tensors), default=0.0)
    text = (f"wrote {result.cache_path} and {result.json_path.name}: {len(result.tensors)} tensors from "
            f"{result.samples} samples in {result.batches} batches, {result.seconds:.1f} s "
            f"({result.samples / max(result.seconds, 1e-9):.0f} samples/s); most clipped tensor {clipped:.4%}")
    if result.skipped:
        text += f"; skipped {len(result.skipped)} bad file(s)"
    return text


def calibration_targets_of(model_path: Path) -> list[str]:
    """The tensors the INT8 build quantizes (graph inputs and quantized ops' activations)."""
    import onnx

    from quantkit.qdq.placement import calibration_targets

    model = onnx.load(str(model_path), load_external_data=False)
    targets = calibration_targets(model)
    if not targets:
        raise ModelError(f"{model_path}: no tensor to calibrate (the model has no quantizable op)")
    return targets


def collect_statistics(model_path: Path, targets: list[str], dataset: Dataset, cfg: Config,
                       console: Console) -> tuple[dict[str, Any], int, int]:
    """Stream the dataset through ORT and update one histogram per target tensor.

    After each run the targets' histograms are updated in parallel, one task per tensor
    (numpy releases the GIL in the heavy loops, and ORT is idle meanwhile); the batch's
    activations are dropped before the next run, so at most one batch of them is alive.
    Every tensor's statistics see the batches in order, so the result does not depend on
    the number of threads.
    """
    from quantkit.calib.histogram import TensorStats

    cal = cfg.calibration
    session = _augmented_session(model_path, targets)
    chunk_elems = max(1 << 16, cal.memory_limit_mb * (1 << 20) // 4 // 8)  # bounds histogramming temporaries
    stats = {name: TensorStats(chunk_elems=chunk_elems) for name in targets}
    samples = batches = 0
    planned = dataset.planned_samples()
    with _stats_pool(len(targets)) as pool, console.progress(planned, "calibrating", unit="img") as bar:
        for batch in _prefetch(dataset.batches(cal.batch_size, cal.remainder)):
            for sub in _split_for_memory(batch, session, targets, cal.memory_limit_mb):
                outputs = _run(session, targets, sub.inputs, batch)
                _update_stats(pool, stats, targets, outputs, batch)
                del outputs
            samples += batch.size
            batches += 1
            bar.update(batch.size)
    if samples == 0:
        raise DataError(f"{dataset.root}: no usable samples; refusing to calibrate on nothing")
    return stats, samples, batches


# Histogram threads: measured 1.45x faster with 2 threads than 1 on a 2-core machine; each
# holds ~4 MB of scratch, so more than a few buy little.
_MAX_STATS_THREADS = 8


def _stats_pool(tasks: int) -> ThreadPoolExecutor:
    import os

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=max(1, min(cpus, tasks, _MAX_STATS_THREADS)),
                              thread_name_prefix="quantkit-stats")


def _update_stats(pool: ThreadPoolExecutor, stats: dict[str, Any], targets: list[str],
                  outputs: list[np.ndarray], batch: Batch) -> None:
    """Add one run's outputs to the statistics; errors are reported for the first failing
    tensor in target order (a failed update leaves that tensor's statistics untouched)."""
    from quantkit.calib.histogram import HistogramOverflowError, NonFiniteError

    def update(k: int) -> Exception | None:
        try:
            stats[targets[k]].update(outputs[k])
        except (NonFiniteError, HistogramOverflowError) as exc:
            return exc
        return None

    order = sorted(range(len(targets)), key=lambda k: -np.size(outputs[k]))  # largest first: balance
    errors = dict(zip(order, pool.map(update, order)))
    for k, name in enumerate(targets):
        exc = errors[k]
        if isinstance(exc, NonFiniteError):
            raise DataError(f"tensor {name!r} has NaN/Inf values in batch {batch.index} "
                            f"(files {batch.sources[0]} .. {batch.sources[-1]}): {exc}") from None
        if isinstance(exc, HistogramOverflowError):
            raise DataError(f"tensor {name!r} in batch {batch.index}: {exc}; calibrate with a "
                            "larger first batch or use method minmax for it") from None


def compute_ranges(stats: dict[str, Any], cfg: Config) -> tuple[list[TensorCalibration], list[str]]:
    """Apply the configured method (or a per-tensor override) to every histogram."""
    from quantkit.calib.cache import amax_to_scale
    from quantkit.calib.methods import METHODS

    cal = cfg.calibration
    tensors, all_zero = [], []
    for name, tensor_stats in stats.items():
        method, params = _method_for(name, cfg)
        ranged = METHODS[method](tensor_stats, **params)
        amax = float(ranged.amax)
        if amax == 0.0:
            all_zero.append(name)
        count = max(int(tensor_stats.count), 1)
        tensors.append(TensorCalibration(
            name=name, amax=amax, scale=float(amax_to_scale(amax)), min=float(tensor_stats.min or 0.0),
            max=float(tensor_stats.max or 0.0), method=method, params=dict(ranged.params),
            clipped_fraction=float(ranged.clipped_fraction),
            zero_fraction=float(tensor_stats.zero_count) / count,
        ))
    return tensors, all_zero


def _method_for(name: str, cfg: Config) -> tuple[str, dict[str, Any]]:
    cal = cfg.calibration
    for pattern, override in cal.overrides.items():
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            method = override.method
            percentile = override.percentile if override.percentile is not None else cal.percentile
            return method, ({"percentile": percentile} if method == "percentile" else {})
    return cal.method, ({"percentile": cal.percentile} if cal.method == "percentile" else {})


def _augmented_session(model_path: Path, targets: list[str]):
    """An ORT session over the model with every target tensor exposed as a graph output.

    Where ORT runs convolutions in its blocked NCHWc layout (x86 with AVX2 / AVX-512), it
    would add a ReorderOutput copy back to NCHW for every exposed target; the returned session
    outputs the blocked tensors themselves instead (see :func:`_without_output_reorders`):
    the same values in another order, which histograms, min/max and counts do not see. That
    saved ~11% per batch (ResNet-18) and the copies' memory. Anything unexpected falls back
    to the plain augmented graph.
    """
    import tempfile

    import onnx
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    existing = {o.name for o in model.graph.output}
    for name in targets:
        if name not in existing:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    serialized = model.SerializeToString()
    del model
    optimized = None
    try:
        with tempfile.TemporaryDirectory(prefix="quantkit-calib-") as tmp:
            options = _calibration_session_options(ort)
            options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
            try:  # the optimised graph is written during session creation
                session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
                optimized = onnx.load(options.optimized_model_filepath)
            except Exception:  # noqa: BLE001 - e.g. cannot write the file: plain session below
                session = ort.InferenceSession(serialized, _calibration_session_options(ort),
                                               providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own types
        raise ModelError(f"{model_path}: ONNX Runtime cannot load the calibration graph: {exc}") from None
    return (_without_output_reorders(optimized, targets, session) if optimized is not None else None) or session


def _calibration_session_options(ort, level=None):
    """Session options of the calibration sessions (``level`` defaults to ORT_ENABLE_ALL)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL if level is None else level
    # With every activation a graph output, ORT's memory pattern (one pre-planned block per
    # input shape, allocated on the second run) doubled peak RSS (ResNet-18, batch 32: 2.2 GB
    # vs 1.1 GB) for no measurable speed; the arena alone reuses the buffers between batches.
    options.enable_mem_pattern = False
    # Idle ORT workers block instead of spinning: the histogram threads run right after each
    # run, and other processes may share the cores (measured equal or faster, less CPU).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


_NCHWC_DOMAIN = "com.microsoft.nchwc"


def _without_output_reorders(optimized, targets: list[str], plain):
    """A session over ORT's optimised graph minus the NCHWc -> NCHW copies of target outputs.

    ``ReorderOutput(x) -> target`` nodes are dropped and the blocked tensor ``x`` is renamed
    to the target, so the target is output in blocked layout: a permutation of the NCHW
    tensor as long as no channel padding is involved. The graph is already optimised, so it
    is loaded with optimisations off (the same kernels run). Checked on one random sample
    against ``plain`` (the session over the augmented graph): every target must have the
    same element count, min and max, and sum up to rounding.

    Returns:
        The session, or None when there is nothing to drop or anything is unexpected.
    """
    import onnx
    import onnxruntime as ort

    graph = optimized.graph
    wanted = set(targets) & {o.name for o in graph.output}
    rename: dict[str, str] = {}
    dropped = set()
    for index, node in enumerate(graph.node):
        if (node.domain == _NCHWC_DOMAIN and node.op_type == "ReorderOutput" and len(node.input) == 1
                and node.output[0] in wanted and node.input[0] not in rename):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if not attrs.get("channels_last", 0):
                rename[node.input[0]] = node.output[0]
                dropped.add(index)
    if not rename or any(o.name in rename for o in graph.output):
        return None
    kept = [node for index, node in enumerate(graph.node) if index not in dropped]
    for node in kept:
        for k, name in enumerate(node.input):
            node.input[k] = rename.get(name, name)
        for k, name in enumerate(node.output):
            node.output[k] = rename.get(name, name)
    del graph.node[:]
    graph.node.extend(kept)
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a failing check is not an error: the plain session is used
    try:
        options = _calibration_session_options(ort, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        options.log_severity_level = 4
        session = ort.InferenceSession(optimized.SerializeToString(), options, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feed = {}
        for arg in session.get_inputs():  # one sample; other dimensions must be fixed
            dims = [1 if k == 0 and not isinstance(d, int) else d for k, d in enumerate(arg.shape)]
            if arg.type != "tensor(float)" or not all(isinstance(d, int) and d > 0 for d in dims):
                return None
            feed[arg.name] = rng.standard_normal(dims).astype(np.float32)
        got = [_invariants(out) for out in session.run(targets, feed, quiet)]  # one run's outputs alive
        want = [_invariants(out) for out in plain.run(targets, feed, quiet)]
    except Exception:  # noqa: BLE001 - the plain session is used instead
        return None
    for (size, lo, hi, total, scale), (size_b, lo_b, hi_b, total_b, _) in zip(got, want):
        if size != size_b or lo != lo_b or hi != hi_b or not abs(total - total_b) <= 1e-9 * scale:
            return None  # e.g. padded channels: the blocked tensor holds more values than the target
    session._quantkit_blocked_outputs = sorted(rename.values())
    return session


def _invariants(array: np.ndarray) -> tuple[int, float, float, float, float]:
    """Order-independent summary: size, min, max, float64 sum and sum of |x| (NaN never matches)."""
    if array.size == 0:
        return 0, 0.0, 0.0, 0.0, 0.0
    return (int(array.size), float(array.min()), float(array.max()), float(array.sum(dtype=np.float64)),
            float(np.abs(array).sum(dtype=np.float64)))


def _run(session, targets: list[str], feed: dict[str, np.ndarray], batch: Batch) -> list[np.ndarray]:
    try:
        return session.run(targets, feed)
    except Exception as exc:  # noqa: BLE001 - shape/dtype mismatches surface here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"batch {batch.index} ({batch.sources[0]} ..) does not run through the model: {first}") from None


def _split_for_memory(batch: Batch, session, targets: list[str], limit_mb: int) -> Iterator[Batch]:
    """Yield the batch whole, or in sub-batches when its activations would exceed the memory bound.

    The per-sample activation size is measured once on the first sample and remembered on the session.
    """
    per_sample = getattr(session, "_quantkit_bytes_per_sample", None)
    if per_sample is None:
        probe = {name: array[:1] for name, array in batch.inputs.items()}
        per_sample = sum(out.nbytes for out in session.run(targets, probe))
        session._quantkit_bytes_per_sample = per_sample
    rows = len(next(iter(batch.inputs.values())))
    step = max(1, min(rows, (limit_mb << 20) // max(per_sample, 1)))
    if step >= rows:
        yield batch
        return
    for begin in range(0, rows, step):
        inputs = {name: array[begin:begin + step] for name, array in batch.inputs.items()}
        yield Batch(batch.index, inputs, None, batch.sources, min(step, rows - begin))


def _prefetch(batches: Iterator[Batch]) -> Iterator[Batch]:
    """Decode the next batch in a thread while the current one runs through the model."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-data") as pool:
        pending = pool.submit(next, batches, None)
        while True:
            batch = pending.result()
            if batch is None:
                return
            pending = pool.submit(next, batches, None)
            yield batch
