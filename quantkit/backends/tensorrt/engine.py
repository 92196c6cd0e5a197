"""Build a TensorRT engine (the build stage's TensorRT backend) and guard against foreign engines.

:func:`build_engine_trt` picks the path by feature detection (:mod:`.detect`), builds with
:mod:`.build_implicit` or :mod:`.build_explicit`, writes ``model.engine`` atomically plus a
manifest beside it (``model.engine.json``: TensorRT version, GPU, compute capability, input
fingerprints) and returns the details for ``build.json``.

Engines are not portable: a plan only runs on the TensorRT version and GPU architecture
that built it. :func:`check_engine_portability` compares a manifest with this machine and
refuses a foreign engine with a message that says what to rebuild.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from quantkit.artifacts import (Manifest, atomic_write_bytes, library_versions, sha256_bytes, sha256_file,
                                atomic_write_json)
from quantkit.backends.tensorrt import detect
from quantkit.backends.tensorrt import network as net
from quantkit.config import InputSpec
from quantkit.errors import ConfigError, MissingArtifactError, StaleArtifactError

ENGINE_STAGE = "tensorrt-engine"


def engine_manifest_path(engine_path: Path) -> Path:
    """``model.engine`` -> ``model.engine.json``."""
    engine_path = Path(engine_path)
    return engine_path.with_name(engine_path.name + ".json")


def build_engine_trt(onnx_fp32: Path, qdq_model: Path | None, calib_cache: Path | None, out_engine: Path, *,
                     fp16_nodes: list[str], profile: tuple[int, int, int], input_specs: Sequence[InputSpec],
                     workspace_mb: int,
                     calibration_batches: Callable[[], Iterator[Mapping[str, np.ndarray]]] | None,
                     timing_cache: Path, console: Any, path: str = "auto", num_profiles: int = 1) -> dict[str, Any]:
    """Build ``out_engine`` with the installed TensorRT.

    Args:
        onnx_fp32: the exported FP32 model (the implicit path parses it).
        qdq_model: the TensorRT-flavour Q/DQ model (``model.qdq.onnx``; the explicit path parses it).
        calib_cache: our ``calib.cache``, passed only when fresh; used when its header matches
            this TensorRT (otherwise, and when None, the implicit path calibrates on the GPU).
        out_engine: where to write the engine (atomically); its manifest goes beside it.
        fp16_nodes: ONNX node names to run in FP16 (layer constraints on the implicit path,
            Casts and FP16 initializers on the explicit one).
        profile: (min, opt, max) batch sizes of the optimization profile; calibration uses opt.
        input_specs: the model inputs from the config (non-batch dynamic axes take their size
            from the first calibration batch).
        workspace_mb: builder scratch memory limit.
        calibration_batches: returns a fresh iterator of ``{input: array}`` batches of the OPT
            batch size (the calibrate stage's loader), or None.
        timing_cache: TensorRT timing cache file, read if present and rewritten after the build.
        console: a :class:`quantkit.ui.Console`.
        path: ``auto`` (implicit where the bindings have calibrators, else explicit),
            ``implicit`` or ``explicit``.
        num_profiles: identical optimization profiles to add (default one); a runner with N
            streams gives each stream its own profile when the engine has N.

    Returns:
        Details for build.json: ``path``, ``tensorrt_version``, ``gpu`` (name, compute
        capability), ``layers`` (ONNX node -> requested precision), ``timing_cache``, ``engine``,
        ``engine_manifest``, ``build_seconds`` and path-specific entries.

    Raises:
        NotAvailableError: TensorRT/pycuda missing, no GPU, or the requested path is not in
            the installed TensorRT.
        ConfigError, MissingArtifactError, ModelError, DataError: invalid inputs or a failed build.
    """
    if path not in ("auto", *detect.PATHS):
        raise ConfigError(f"unknown TensorRT build path {path!r}; expected auto, implicit or explicit")
    out_engine = Path(out_engine)
    trt = detect.import_tensorrt()
    cuda = detect.import_pycuda()
    chosen = detect.choose_path(trt, path)
    if chosen == "explicit" and (qdq_model is None or not Path(qdq_model).is_file()):
        raise MissingArtifactError(f"the explicit TensorRT path builds the Q/DQ model, but {qdq_model} does not "
                                   "exist; run `quantkit build-engine` for the Q/DQ artifact first")
    if chosen == "implicit" and not Path(onnx_fp32).is_file():
        raise MissingArtifactError(f"{onnx_fp32} does not exist; run `quantkit export` first")
    ranges = net.shape_ranges(input_specs, tuple(profile), net.peek_data_shapes(calibration_batches))
    started = time.perf_counter()
    with detect.primary_context(cuda) as device:
        gpu = detect.gpu_info(device)
        console.info(f"building a TensorRT engine ({chosen} path) with TensorRT {detect.trt_version(trt)} "
                     f"on {gpu['name']} (compute {gpu['compute_capability']}) ...")
        if chosen == "implicit":
            from quantkit.backends.tensorrt.build_implicit import build_implicit

            engine_bytes, details = build_implicit(
                trt, cuda, onnx_fp32=Path(onnx_fp32), calib_cache=calib_cache, out_engine=out_engine,
                fp16_nodes=fp16_nodes, ranges=ranges, workspace_mb=workspace_mb,
                calibration_batches=calibration_batches, timing_cache=Path(timing_cache), console=console,
                num_profiles=num_profiles)
        else:
            from quantkit.backends.tensorrt.build_explicit import build_explicit

            engine_bytes, details = build_explicit(
                trt, qdq_model=Path(qdq_model), out_engine=out_engine, fp16_nodes=fp16_nodes, ranges=ranges,
                workspace_mb=workspace_mb, timing_cache=Path(timing_cache), console=console,
                num_profiles=num_profiles)
    seconds = time.perf_counter() - started
    atomic_write_bytes(out_engine, engine_bytes)
    platform = {"tensorrt_version": detect.trt_version(trt), "gpu_name": gpu["name"],
                "compute_capability": gpu["compute_capability"]}
    fingerprint = _fingerprint(chosen, onnx_fp32, qdq_model, calib_cache, fp16_nodes, ranges, workspace_mb)
    manifest = Manifest(stage=ENGINE_STAGE, fingerprint=fingerprint,
                        outputs={out_engine.name: sha256_bytes(engine_bytes)},
                        versions=library_versions("tensorrt"), details=platform)
    atomic_write_json(engine_manifest_path(out_engine), manifest.to_json())
    console.info(f"wrote {out_engine} ({len(engine_bytes) / (1 << 20):.1f} MiB) in {seconds:.1f} s")
    return {
        "path": chosen,
        "tensorrt_version": platform["tensorrt_version"],
        "gpu": {"name": gpu["name"], "compute_capability": gpu["compute_capability"]},
        "engine": str(out_engine),
        "engine_manifest": str(engine_manifest_path(out_engine)),
        "timing_cache": str(timing_cache),
        "profile": [{"input": r.name, "min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for r in ranges],
        "num_profiles": num_profiles,
        "build_seconds": round(seconds, 3),
        **details,
    }


def _fingerprint(path: str, onnx_fp32: Path, qdq_model: Path | None, calib_cache: Path | None,
                 fp16_nodes: Sequence[str], ranges: Sequence[net.ShapeRange], workspace_mb: int) -> dict[str, Any]:
    def digest(file: Path | None) -> str | None:
        return sha256_file(Path(file)) if file is not None and Path(file).is_file() else None

    return {
        "path": path,
        "onnx_fp32": digest(onnx_fp32) if path == "implicit" else None,
        "qdq_model": digest(qdq_model) if path == "explicit" else None,
        "calib_cache": digest(calib_cache) if path == "implicit" else None,
        "fp16_nodes": sorted(fp16_nodes),
        "profile": [[r.name, list(r.min), list(r.opt), list(r.max)] for r in ranges],
        "workspace_mb": workspace_mb,
    }


# ---------------------------------------------------------------------------- portability


def current_platform(trt: Any, device: Any) -> dict[str, str]:
    """This machine's TensorRT version, GPU name and compute capability (``device``: pycuda Device)."""
    gpu = detect.gpu_info(device)
    return {"tensorrt_version": detect.trt_version(trt), "gpu_name": gpu["name"],
            "compute_capability": gpu["compute_capability"]}


def check_engine_portability(manifest: Manifest | Mapping[str, Any], current: Mapping[str, str],
                             engine_name: str = "model.engine") -> None:
    """Refuse an engine built with another TensorRT version or on another GPU architecture.

    Args:
        manifest: the engine manifest (a :class:`Manifest`, its JSON dict, or its ``details``).
        current: :func:`current_platform` of this machine.
        engine_name: for the message.

    Raises:
        StaleArtifactError: naming both platforms and how to rebuild.
    """
    built = _platform_of(manifest)
    differences = []
    if built.get("tensorrt_version") != current.get("tensorrt_version"):
        differences.append(f"TensorRT {built.get('tensorrt_version')} vs {current.get('tensorrt_version')} here")
    if built.get("compute_capability") != current.get("compute_capability"):
        differences.append(f"compute capability {built.get('compute_capability')} "
                           f"({built.get('gpu_name')}) vs {current.get('compute_capability')} "
                           f"({current.get('gpu_name')}) here")
    elif built.get("gpu_name") != current.get("gpu_name"):
        differences.append(f"GPU {built.get('gpu_name')} vs {current.get('gpu_name')} here")
    if differences:
        raise StaleArtifactError(
            f"{engine_name} was built elsewhere ({'; '.join(differences)}); TensorRT engines only run where they "
            "were built: rebuild it here with `quantkit build-engine CONFIG --backend tensorrt`")


def _platform_of(manifest: Manifest | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(manifest, Manifest):
        return manifest.details
    if "details" in manifest and isinstance(manifest["details"], Mapping):
        return manifest["details"]
    return manifest


def read_engine_manifest(engine_path: Path) -> Manifest | None:
    """The manifest beside an engine, or None when there is none."""
    path = engine_manifest_path(engine_path)
    return Manifest.read(path) if path.is_file() else None


def check_engine_file(engine_path: Path, manifest: Manifest) -> None:
    """The engine's bytes are the ones the manifest recorded (not replaced or truncated)."""
    engine_path = Path(engine_path)
    recorded = manifest.outputs.get(engine_path.name)
    if recorded is not None and sha256_file(engine_path) != recorded:
        raise StaleArtifactError(f"{engine_path} was modified after {engine_manifest_path(engine_path).name} "
                                 "was written; rebuild it with `quantkit build-engine CONFIG --backend tensorrt`")
