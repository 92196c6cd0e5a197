"""Stage 3: ``model.onnx`` + calibration -> INT8 artifacts and ``build.json``.

Two Q/DQ flavours are written from the same ranges (see :mod:`quantkit.qdq`):

* ``model.int8.onnx`` -- the ONNX Runtime CPU artifact, checked by a speed guard
  (:mod:`quantkit.backends.onnxruntime.build`);
* ``model.qdq.onnx`` -- the TensorRT-11 flavour, checked by
  :func:`quantkit.qdq.trt_check.check_trt_qdq` (the TensorRT engine build itself is issue 7).

Everything is validated (backend, calibration freshness, opset, exclusion patterns, ranges
present) and built in memory before the first file is written; files are written atomically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from quantkit.artifacts import (Manifest, ModelWorkspace, atomic_path, fingerprint_hash, library_versions,
                                sha256_file)
from quantkit.config import Config
from quantkit.errors import ConfigError, MissingArtifactError, ModelError, NotAvailableError, StaleArtifactError
from quantkit.ui import Console, human_size

MANIFEST = "build.json"
CPU_ARTIFACT = "model.int8.onnx"
TRT_ARTIFACT = "model.qdq.onnx"
CALIBRATION = "calib.json"
CALIBRATION_CACHE = "calib.cache"
ENGINE_ARTIFACT = "model.engine"
#: Samples used for the output-similarity sanity check written to build.json.
SANITY_SAMPLES = 8


@dataclass
class BuildResult:
    """What ``build-engine`` wrote and measured.

    Attributes:
        backend: the backend that built (``onnxruntime``).
        backend_reason: why it was chosen.
        cpu_path / trt_path: the two artifacts.
        nodes: per quantizable node: precision in each flavour and why it is not INT8.
        exclusions: pattern -> matched node names.
        timing: the speed guard's FP32/INT8 figures (None when the guard was skipped).
        guard_steps: the float regions the guard tried.
        automatic: nodes the guard kept in float.
        fused_ops / unfused_qdq: op counts in ONNX Runtime's optimized CPU graph.
        trt_fp16: nodes the TensorRT flavour marks for FP16.
        trt_problems: checker findings (always empty in a written artifact).
        cosine: output cosine vs FP32 per flavour on a few calibration samples.
        seconds: wall time of the build.
        sizes: bytes of each artifact.
        widened_ranges: calibrated ranges that clipped too much and were replaced by min/max.
        sensitivity: the automatic fallback (``build.fallback.auto``): nodes kept in float, budget, scores.
    """

    backend: str
    backend_reason: str
    cpu_path: Path
    trt_path: Path
    nodes: list[dict[str, Any]]
    exclusions: dict[str, list[str]]
    timing: Any | None
    guard_steps: list[Any]
    automatic: list[str]
    fused_ops: dict[str, int]
    unfused_qdq: dict[str, int]
    trt_fp16: list[str]
    trt_problems: list[str]
    cosine: dict[str, float]
    seconds: float = 0.0
    sizes: dict[str, int] = field(default_factory=dict)
    widened_ranges: dict[str, dict[str, float]] = field(default_factory=dict)
    tensorrt: dict[str, Any] | None = None
    sensitivity: dict[str, Any] | None = None

    def precision_counts(self, flavour: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            if flavour in node:
                precision = node[flavour]["precision"]
                counts[precision] = counts.get(precision, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "backend_reason": self.backend_reason,
            "artifacts": {
                "cpu": {"path": str(self.cpu_path), "size": self.sizes.get("cpu")},
                "trt": {"path": str(self.trt_path), "size": self.sizes.get("trt")},
            },
            "exclusions": self.exclusions,
            "sensitivity": self.sensitivity,
            "widened_ranges": self.widened_ranges,
            "nodes": self.nodes,
            "precision_counts": {"cpu": self.precision_counts("cpu"), "trt": self.precision_counts("trt")},
            "cpu": {
                "speed_guard": self.timing.to_json() if self.timing else None,
                "guard_steps": [step.to_json() for step in self.guard_steps],
                "automatic_fallback": self.automatic,
                "fused_ops": self.fused_ops,
                "unfused_qdq": self.unfused_qdq,
            },
            "trt": {
                "fp16_nodes": self.trt_fp16,
                "fp16_marking": "metadata_props['quantkit.fp16_nodes'] of model.qdq.onnx (JSON list of node names)",
                "check_problems": self.trt_problems,
            },
            "output_cosine_vs_fp32": self.cosine,
            "tensorrt_engine": self.tensorrt,
            "seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------- fingerprint


def _build_tensorrt(cfg: Config, ws: ModelWorkspace, console: Console, fp16_nodes: list[str]) -> dict[str, Any]:
    """Build ``model.engine`` from the artifacts just written (TensorRT 10 implicit or 11 explicit)."""
    from quantkit.backends.tensorrt.engine import build_engine_trt
    from quantkit.calibrate import calibration_dataset

    profile = cfg.build.profile
    cache = ws.path(CALIBRATION_CACHE)

    def batches():
        # TensorRT calibrates at the OPT shape: short remainders are dropped
        return (batch.inputs for batch in calibration_dataset(cfg).batches(profile.opt, "drop"))

    return build_engine_trt(
        ws.onnx_model, ws.path(TRT_ARTIFACT), cache if cache.exists() else None, ws.path(ENGINE_ARTIFACT),
        fp16_nodes=fp16_nodes, profile=(profile.min, profile.opt, profile.max), input_specs=cfg.model.inputs,
        workspace_mb=cfg.build.workspace_mb, calibration_batches=batches, timing_cache=ws.path("timing.cache"),
        console=console,
    )


def build_fingerprint(cfg: Config, ws: ModelWorkspace, *, backend: str | None = None,
                      exclude: Sequence[str] = ()) -> dict[str, Any]:
    """Everything the build's outputs depend on, cheap to compute (hashes, no model loading).

    The config's build section, the CLI exclusions and backend override, the hashes of
    ``model.onnx`` and of the calibration files that exist, and with ``build.fallback.auto`` the
    sensitivity search's fingerprint (evaluation data, search settings).
    """
    import onnxruntime

    def digest(name: str) -> str | None:
        path = ws.path(name)
        return sha256_file(path) if path.exists() else None

    from quantkit.sensitivity import sensitivity_fingerprint

    return {
        "build": cfg.build.model_dump(mode="json"),
        "backend": backend or cfg.build.backend,
        "exclude": list(dict.fromkeys(cfg.build.fallback_patterns + list(exclude))),
        "sensitivity": sensitivity_fingerprint(cfg, ws, exclude) if cfg.build.auto_fallback else None,
        "model_sha256": digest("model.onnx"),
        "calib_json_sha256": digest(CALIBRATION),
        "calib_cache_sha256": digest(CALIBRATION_CACHE),
        "onnxruntime": onnxruntime.__version__,
    }


# --------------------------------------------------------------------------- backend choice


def select_backend(requested: str) -> tuple[str, str]:
    """Resolve ``auto`` / ``onnxruntime`` / ``tensorrt`` to the backend that builds, and why.

    Raises:
        NotAvailableError: ``tensorrt`` was asked for but TensorRT or a GPU is missing.
    """
    if requested == "onnxruntime":
        return "onnxruntime", "requested"
    if requested not in ("auto", "tensorrt"):
        raise NotAvailableError(f"unknown backend {requested!r}", hint="auto, onnxruntime or tensorrt")
    available, why = tensorrt_available()
    if requested == "tensorrt":
        if not available:
            raise NotAvailableError(f"--backend tensorrt: {why}",
                                    hint="pip install 'quantkit[tensorrt]' on a machine with an NVIDIA GPU, "
                                         "or use --backend onnxruntime")
        return "tensorrt", f"requested; {why}"
    if not available:
        return "onnxruntime", f"auto: {why}"
    return "tensorrt", f"auto: {why}"


def tensorrt_available() -> tuple[bool, str]:
    """Whether ``import tensorrt`` works and a CUDA GPU is visible, with the reason when not."""
    try:
        import tensorrt  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False, "TensorRT is not installed"
    count = _cuda_device_count()
    if count <= 0:
        return False, "TensorRT is installed but no CUDA GPU is visible"
    return True, f"TensorRT and {count} GPU(s) found"


def _cuda_device_count() -> int:
    try:
        from cuda import cudart  # cuda-python

        error, count = cudart.cudaGetDeviceCount()
        return int(count) if int(error) == 0 else 0
    except Exception:  # noqa: BLE001
        pass
    try:
        import pycuda.driver as driver

        driver.init()
        return int(driver.Device.count())
    except Exception:  # noqa: BLE001
        return 0


# --------------------------------------------------------------------------- the stage


def build_engine(cfg: Config, ws: ModelWorkspace, console: Console, *, backend: str | None = None,
                 exclude: Sequence[str] = (), allow_stale: bool = False, guard: bool = True) -> BuildResult:
    """Build the INT8 artifacts for ``cfg`` into its artifact directory.

    Args:
        cfg: the validated config.
        ws: the model's artifact directory (``model.onnx`` and ``calib.json`` in it).
        console: where progress goes.
        backend: overrides ``build.backend`` (``auto``, ``onnxruntime``, ``tensorrt``).
        exclude: extra exclusion patterns (node names, globs, op types), added to ``build.fallback``
            (the search of ``build.fallback.auto`` runs with them excluded).
        allow_stale: use ``calib.json`` even if the calibration manifest says it is stale.
        guard: run the speed guard as ``build.speed_guard`` says (False: never, for tests that do not
            time anything).

    Returns:
        A :class:`BuildResult`; ``model.int8.onnx``, ``model.qdq.onnx`` and ``build.json`` are written.

    Raises:
        NotAvailableError: TensorRT requested explicitly.
        MissingArtifactError / StaleArtifactError: no model, no or stale calibration, ranges missing.
        ConfigError: opset < 13, an exclusion pattern that matches nothing.
        ModelError: nothing quantizable, or ORT's quantizer refused the model.
    """
    from quantkit.backends.onnxruntime import build as ort_build
    from quantkit.qdq.trt import write_trt_qdq
    from quantkit.qdq.trt_check import check_trt_qdq

    start = time.perf_counter()
    backend_name, backend_reason = select_backend(backend or cfg.build.backend)
    console.info(f"backend: {backend_name} ({backend_reason})")
    fingerprint = build_fingerprint(cfg, ws, backend=backend, exclude=exclude)
    plan = _plan(cfg, ws, console, exclude, allow_stale)
    feeds = timing_feeds(cfg, console) if guard and cfg.build.speed_guard != "off" else None
    search = cfg.build.speed_guard == "search"

    console.info(f"writing the CPU flavour ({len(plan.cpu_nodes)} nodes quantized, {len(plan.excluded)} excluded)")
    cpu = ort_build.build_cpu_artifact(plan.model, plan.ranges, plan.cpu_nodes, plan.excluded, feeds, console,
                                       extra_feeds=_smaller_batches(cfg, feeds), search=search,
                                       reuse=previous_guard_choice(ws, fingerprint) if feeds is not None and search
                                       else None)
    trt_fp16 = [node for node in plan.excluded if any(c.name == node and c.trt for c in plan.candidates)]
    trt_model = write_trt_qdq(plan.model, plan.ranges, plan.trt_nodes, trt_fp16)
    problems = check_trt_qdq(trt_model)
    if problems:
        listed = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        raise ModelError(f"the TensorRT-flavour Q/DQ model breaks TensorRT's rules: {listed}")

    cpu_path, trt_path = ws.path(CPU_ARTIFACT), ws.path(TRT_ARTIFACT)
    result = BuildResult(
        backend=backend_name, backend_reason=backend_reason, cpu_path=cpu_path, trt_path=trt_path,
        nodes=node_report(plan.candidates, plan.excluded, cpu.automatic, _int8_nodes(cpu.model, cpu.quantized),
                          _int8_nodes(trt_model, plan.trt_nodes), sensitivity=plan.sensitive),
        exclusions=plan.exclusions, timing=cpu.timing, guard_steps=cpu.steps, automatic=cpu.automatic,
        fused_ops=cpu.fused_ops, unfused_qdq=cpu.unfused_qdq, trt_fp16=trt_fp16, trt_problems=problems,
        cosine=_sanity_cosine(plan.model, cpu.model, trt_model, feeds),
        widened_ranges={tensor: {"amax": r.amax, "clipped_fraction": r.clipped_fraction, "used_amax": r.observed_amax}
                        for tensor, r in plan.widened.items()},
        sensitivity=plan.sensitivity,
    )
    _save(cpu.model, cpu_path)
    _save(trt_model, trt_path)
    result.sizes = {"cpu": cpu_path.stat().st_size, "trt": trt_path.stat().st_size}
    outputs = {CPU_ARTIFACT: sha256_file(cpu_path), TRT_ARTIFACT: sha256_file(trt_path)}
    if backend_name == "tensorrt":
        result.tensorrt = _build_tensorrt(cfg, ws, console, trt_fp16)
        outputs[ENGINE_ARTIFACT] = sha256_file(ws.path(ENGINE_ARTIFACT))
    result.seconds = time.perf_counter() - start
    ws.write_manifest(MANIFEST, Manifest(
        stage="build-engine",
        fingerprint=fingerprint,
        outputs=outputs,
        versions=library_versions(),
        details=result.to_json(),
    ))
    return result


@dataclass
class _Plan:
    """Everything validated before anything is built or written."""

    model: Any
    ranges: dict[str, Any]
    widened: dict[str, Any]
    exclusions: dict[str, list[str]]
    excluded: list[str]
    candidates: list[Any]
    cpu_nodes: list[str]
    trt_nodes: list[str]
    sensitive: list[str] = field(default_factory=list)  # chosen by build.fallback.auto (also in excluded)
    sensitivity: dict[str, Any] | None = None


def _plan(cfg: Config, ws: ModelWorkspace, console: Console, exclude: Sequence[str], allow_stale: bool) -> _Plan:
    """Check model, calibration, opset, exclusions and ranges; decide which nodes each flavour quantizes."""
    import onnx

    from quantkit.qdq import MAX_CLIPPED_FRACTION, load_ranges, placement, widen_overclipped

    if not ws.onnx_model.exists():
        raise MissingArtifactError(f"model not found: {ws.onnx_model} does not exist",
                                   hint="run 'quantkit export CONFIG' first")
    if allow_stale:
        console.warn("using calib.json without checking that it is fresh (--allow-stale)")
    else:
        require_fresh_calibration(cfg, ws)
    ranges, widened = widen_overclipped(load_ranges(ws.path(CALIBRATION)))
    if widened:
        shown = ", ".join(f"{tensor!r} ({100 * r.clipped_fraction:.0f}%)" for tensor, r in list(widened.items())[:3])
        console.warn(f"{len(widened)} calibrated range(s) clip more than {100 * MAX_CLIPPED_FRACTION:g}% of the "
                     f"values ({shown}{' ...' if len(widened) > 3 else ''}); using their observed min/max instead "
                     "(consider calibration.overrides with method minmax for them)")
    model = onnx.load(str(ws.onnx_model))
    info = placement.check_model(model)
    exclusions = placement.resolve_exclusions(model, cfg.build.fallback_patterns + list(exclude))
    excluded = list(dict.fromkeys(node for nodes in exclusions.values() for node in nodes))
    candidates = placement.quantizable_nodes(model, info)
    cpu_nodes = placement.select_nodes(candidates, placement.CPU, excluded)
    trt_nodes = placement.select_nodes(candidates, placement.TRT, excluded)
    selected = set(cpu_nodes) | set(trt_nodes)
    if not any(c.name in selected for c in candidates if c.op_type in placement.COMPUTE_OPS):
        raise ConfigError(f"the exclusions ({', '.join(exclusions)}) leave no Conv/Gemm/MatMul to quantize",
                          hint="exclude fewer nodes, or use the FP32 model")
    _require_ranges(model, ranges, cpu_nodes, trt_nodes)
    plan = _Plan(model, ranges, widened, exclusions, excluded, candidates, cpu_nodes, trt_nodes)
    if cfg.build.auto_fallback is not None:
        from quantkit.sensitivity import auto_fallback

        search = auto_fallback(cfg, ws, console, exclude=exclude, allow_stale=allow_stale)
        plan.sensitive = [node for node in search.chosen if node not in excluded]
        plan.sensitivity = search.summary()
        plan.excluded = excluded + plan.sensitive
        plan.cpu_nodes = placement.select_nodes(candidates, placement.CPU, plan.excluded)
        plan.trt_nodes = placement.select_nodes(candidates, placement.TRT, plan.excluded)
    return plan


def describe(result: BuildResult) -> str:
    """One summary line for the terminal."""
    cpu = result.precision_counts("cpu")
    fp32 = cpu.get("fp32", 0)
    text = (f"wrote {result.cpu_path} ({human_size(result.sizes.get('cpu', 0))}, "
            f"{cpu.get('int8', 0)} int8 / {fp32} fp32 nodes")
    if result.sensitivity and result.sensitivity["nodes"]:
        text += f", {len(result.sensitivity['nodes'])} kept in float by the sensitivity search"
    if result.automatic:
        text += f", {len(result.automatic)} kept in float by the speed guard"
    text += ")"
    if result.timing is not None:
        t = result.timing
        text += f", INT8 {t.speedup:.2f}x FP32 at batch {t.batch} ({t.int8_ms:.1f} vs {t.fp32_ms:.1f} ms)"
        text += "".join(f", {row[2]:.2f}x at batch {b}" for b, row in t.by_batch.items() if b != t.batch)
    text += (f" and {result.trt_path.name} (TensorRT rules OK, {len(result.trt_fp16)} FP16 nodes) "
             f"in {result.seconds:.1f} s; next: quantkit bench CONFIG")
    return text


# --------------------------------------------------------------------------- helpers


def require_fresh_calibration(cfg: Config, ws: ModelWorkspace) -> None:
    """Refuse a missing or stale ``calib.json`` (via the calibration stage's fingerprint).

    Raises:
        MissingArtifactError / StaleArtifactError: from the workspace check.
        NotAvailableError: the calibration stage is not part of this version.
    """
    if not ws.path(CALIBRATION).exists():
        raise MissingArtifactError(f"calibration not found: {ws.path(CALIBRATION)} does not exist",
                                   hint="run 'quantkit calibrate CONFIG' first")
    try:
        from quantkit.calibrate import calibration_fingerprint
    except ImportError:
        raise NotAvailableError("cannot check whether calib.json is fresh: the calibration stage is not "
                                "in this version", hint="pass --allow-stale to use it as it is") from None
    ws.require_fresh(CALIBRATION, calibration_fingerprint(cfg, ws), "calibration")


def _require_ranges(model, ranges: Mapping[str, Any], cpu_nodes: Sequence[str], trt_nodes: Sequence[str]) -> None:
    from quantkit.qdq import ortquant
    from quantkit.qdq.placement import CPU, TRT

    needed: dict[str, None] = {}
    for nodes, flavour in ((cpu_nodes, CPU), (trt_nodes, TRT)):
        if nodes:
            needed.update(dict.fromkeys(ortquant.tensors_needing_ranges(model, nodes, flavour)))
    missing = [name for name in needed if name not in ranges]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise StaleArtifactError(f"calib.json has no range for {len(missing)} tensor(s) the build needs: {shown}",
                                 hint="it was made for another model.onnx; re-run 'quantkit calibrate CONFIG'")


def timing_feeds(cfg: Config, console: Console) -> dict[str, np.ndarray]:
    """One batch of ``build.profile.opt`` samples from the calibration data (repeated if there are fewer)."""
    from quantkit.data import open_dataset

    batch = cfg.build.profile.opt
    calib = cfg.calibration
    dataset = open_dataset(calib.data, cfg.model.inputs, fmt=calib.format, preprocess=calib.preprocess,
                           max_samples=batch, on_bad_file=calib.on_bad_file)
    first = next(iter(dataset.batches(batch)))
    feeds = {}
    for name, array in first.inputs.items():
        if array.shape[0] < batch:
            array = np.concatenate([array] * -(-batch // array.shape[0]))[:batch]
        feeds[name] = np.ascontiguousarray(array)
    if first.inputs and next(iter(first.inputs.values())).shape[0] < batch:
        console.detail(f"timing batch repeats {next(iter(first.inputs.values())).shape[0]} samples to {batch}")
    return feeds


def _smaller_batches(cfg: Config, feeds: Mapping[str, np.ndarray] | None) -> list[dict[str, np.ndarray]]:
    """The timing batch cut to ``build.profile.min`` (when smaller than opt): INT8 must not lose there either."""
    smallest = cfg.build.profile.min
    if feeds is None or smallest >= cfg.build.profile.opt:
        return []
    return [{name: np.ascontiguousarray(array[:smallest]) for name, array in feeds.items()}]


def previous_guard_choice(ws: ModelWorkspace, fingerprint: Mapping[str, Any]) -> list[str] | None:
    """The speed guard's automatic float nodes from an earlier build with the same fingerprint, else None.

    Reusing them keeps rebuilds byte-identical although the guard decides by timing.
    """
    if not ws.path(MANIFEST).exists():
        return None
    try:
        previous = Manifest.read(ws.path(MANIFEST))
        cpu = previous.details["cpu"]
        if fingerprint_hash(previous.fingerprint) != fingerprint_hash(fingerprint) or cpu["speed_guard"] is None:
            return None
        return [str(name) for name in cpu["automatic_fallback"]]
    except Exception:  # an unreadable or older build.json: search again
        return None


def _sanity_cosine(model, cpu_model, trt_model, feeds: Mapping[str, np.ndarray] | None) -> dict[str, float]:
    if feeds is None:
        return {}
    from quantkit.backends.onnxruntime.build import output_cosine

    small = {name: array[:SANITY_SAMPLES] for name, array in feeds.items()}
    return {"cpu": round(output_cosine(model, cpu_model, small), 6),
            "trt": round(output_cosine(model, trt_model, small), 6),
            "samples": int(next(iter(small.values())).shape[0])}


def _int8_nodes(qmodel, selected: Sequence[str]) -> set[str]:
    """Selected nodes that really are INT8 in the written model (read a DQ, or were folded away)."""
    from quantkit.qdq.graph import quantized_nodes

    present = {node.name for node in qmodel.graph.node}
    reads_dq = quantized_nodes(qmodel)
    return {name for name in selected if name in reads_dq or name not in present}


def node_report(candidates, excluded: Iterable[str], automatic: Iterable[str], cpu_int8: set[str],
                trt_int8: set[str], sensitivity: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Per quantizable node: precision in each flavour it belongs to, and why it is not INT8.

    Reasons: ``config`` (build.fallback / --exclude), ``sensitivity`` (build.fallback.auto),
    ``automatic`` (speed guard), ``unsupported`` (the node cannot be quantized, with a ``detail``).
    """
    excluded, automatic, sensitivity = set(excluded), set(automatic), set(sensitivity)
    report = []
    for node in candidates:
        if not node.reported:
            continue
        entry: dict[str, Any] = {"name": node.name, "op_type": node.op_type}
        for flavour, member, int8 in (("cpu", node.cpu, cpu_int8), ("trt", node.trt, trt_int8)):
            if not member:
                continue
            if node.name in int8:
                entry[flavour] = {"precision": "int8", "reason": None}
            elif node.name in excluded:
                reason = "sensitivity" if node.name in sensitivity else "config"
                entry[flavour] = {"precision": "fp16" if flavour == "trt" else "fp32", "reason": reason}
            elif flavour == "cpu" and node.name in automatic:
                entry[flavour] = {"precision": "fp32", "reason": "automatic"}
            else:
                detail = node.unsupported or "no quantized neighbour to fuse with"
                entry[flavour] = {"precision": "fp32", "reason": "unsupported", "detail": detail}
        report.append(entry)
    return report


def _save(model, path: Path) -> None:
    import onnx

    with atomic_path(path) as tmp:
        onnx.save(model, str(tmp))
