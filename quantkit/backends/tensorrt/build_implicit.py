"""TensorRT 10.x implicit INT8: FP32 ONNX + INT8/FP16 flags + entropy calibrator + FP16 layers.

TensorRT picks INT8, FP16 or FP32 per layer by speed, within what the flags allow; the
calibrator supplies the INT8 scales (from our ``calib.cache`` when valid, else by running
the loader's batches on the GPU). Layers of the configured FP16 nodes are constrained to
FP16 (precision and output types) and ``OBEY_PRECISION_CONSTRAINTS`` makes that binding.
Deprecated by NVIDIA since 10.1 (implicit quantization) and 10.12 (per-layer precision),
removed in 11.x; :mod:`.detect` only offers this path where the bindings still have it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from quantkit.backends.tensorrt import network as net
from quantkit.backends.tensorrt.calibrator import CalibrationFeeder, load_valid_cache, make_entropy_calibrator
from quantkit.backends.tensorrt.detect import cache_version_code
from quantkit.errors import ConfigError, ModelError

REQUESTED_FP16 = "fp16"
REQUESTED_INT8 = "int8"  # INT8 allowed: TensorRT may still pick FP16/FP32 where faster
NOT_APPLICABLE = "n/a"  # shape or integer layers: no float precision to choose


def build_implicit(trt: Any, cuda: Any, *, onnx_fp32: Path, calib_cache: Path | None, out_engine: Path,
                   fp16_nodes: Sequence[str], ranges: Sequence[net.ShapeRange], workspace_mb: int,
                   calibration_batches: Callable[[], Iterator[Mapping[str, np.ndarray]]] | None,
                   timing_cache: Path, console: Any, num_profiles: int = 1) -> tuple[bytes, dict[str, Any]]:
    """Build the engine; returns (plan bytes, details for build.json).

    Raises:
        ConfigError: an FP16 node matches no layer, or neither a valid cache nor data can calibrate.
        ModelError: parse/build failure, or a calibrator callback failed.
    """
    logger = net.make_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in 10.x (the flag is ignored)
    parser = net.parse_onnx(trt, network, logger, onnx_fp32)
    config = builder.create_builder_config()
    net.set_workspace(trt, config, workspace_mb)
    config.set_flag(trt.BuilderFlag.INT8)
    config.set_flag(trt.BuilderFlag.FP16)
    config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
    profile = net.add_profiles(builder, network, config, ranges, num_profiles)
    # calibration runs at one shape; TensorRT overwrites the profile's MIN and MAX with OPT
    if not config.set_calibration_profile(profile):
        raise ModelError("TensorRT rejected the calibration profile")

    cache = load_valid_cache(calib_cache, cache_version_code(trt), console)
    if cache is None and calibration_batches is None:
        raise ConfigError("implicit INT8 needs a valid calibration cache or calibration data; "
                          "run `quantkit calibrate` first")
    feeder = CalibrationFeeder(cuda, calibration_batches, {r.name: r.opt for r in ranges}, cache,
                               out_engine.with_name(out_engine.stem + ".trt_calib.cache"), console)
    config.int8_calibrator = make_entropy_calibrator(trt, feeder)
    layers = constrain_fp16_layers(trt, network, fp16_nodes)
    net.attach_timing_cache(config, timing_cache, console)
    if cache is None:
        console.info("calibrating on the GPU (no usable calib.cache) ...")
    try:
        plan = builder.build_serialized_network(network, config)
    finally:
        feeder.free()
    feeder.raise_recorded()  # a failed callback explains a failed build better than None does
    engine_bytes = net.require_plan(plan)
    net.save_timing_cache(config, timing_cache)
    del parser  # the parser owns the parsed weights; keep it alive until the build has finished
    details = {
        "calibration": {
            "source": "calib.cache" if cache is not None and "get_batch" not in feeder.events else "gpu",
            "batches_fed": feeder.fed,
            "short_batches_skipped": feeder.skipped,
            "written_cache": str(feeder.written) if feeder.written else None,
            "callbacks": _summarise(feeder.events),
        },
        "flags": ["INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS"],
        "layers": layers,
    }
    return engine_bytes, details


def constrain_fp16_layers(trt: Any, network: Any, fp16_nodes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Constrain the layers of ``fp16_nodes`` to FP16; returns the per-node requested precision.

    A layer belongs to a node when the parser's metadata names it (one node may give
    several layers). Shape computations and non-float layers are left alone (TensorRT
    requires INT32/INT64 there), and network outputs keep their type: only the output of
    an inner layer is retyped.

    Returns:
        ONNX node name -> {"requested": "fp16" | "int8" | "n/a", "layers": [TensorRT layer names]};
        "int8" means INT8 is allowed (TensorRT picks the fastest of INT8/FP16/FP32), "n/a" marks
        nodes with only shape or integer layers.

    Raises:
        ConfigError: an FP16 node that matches no float layer.
    """
    wanted = set(fp16_nodes)
    report: dict[str, dict[str, Any]] = {}
    matched: set[str] = set()
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        nodes = net.onnx_nodes_of(layer)
        hit = [node for node in nodes if node in wanted]
        is_float = _is_float_compute(trt, layer)
        constrained = bool(hit) and is_float
        if constrained:
            layer.precision = trt.float16
            for output_index in range(layer.num_outputs):
                tensor = layer.get_output(output_index)
                if not tensor.is_network_output:
                    layer.set_output_type(output_index, trt.float16)
            matched.update(hit)
        for node in nodes:
            entry = report.setdefault(node, {"requested": NOT_APPLICABLE, "layers": []})
            entry["layers"].append(layer.name)
            if constrained:
                entry["requested"] = REQUESTED_FP16
            elif is_float and entry["requested"] == NOT_APPLICABLE:
                entry["requested"] = REQUESTED_INT8
    missing = sorted(wanted - matched)
    if missing:
        raise ConfigError(f"FP16 node(s) {missing} match no floating-point TensorRT layer; use ONNX node names "
                          f"as in model.onnx (e.g. {sorted(report)[:3]})")
    return report


def _is_float_compute(trt: Any, layer: Any) -> bool:
    """True for layers that compute on float tensors (not shape arithmetic, not integer/bool)."""
    if layer.type == trt.LayerType.SHAPE or layer.type == trt.LayerType.CONSTANT:
        return False
    for output_index in range(layer.num_outputs):
        tensor = layer.get_output(output_index)
        if tensor.is_shape_tensor or tensor.dtype not in (trt.float32, trt.float16):
            return False
    return True


def _summarise(events: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in events:
        counts[event] = counts.get(event, 0) + 1
    return counts
