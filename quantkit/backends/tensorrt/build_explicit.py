"""Explicit quantization: a strongly typed network from the Q/DQ model (TensorRT 11.x; 10.x too).

Precision is written into the graph instead of requested with flags: INT8 where the
build stage put Q/DQ pairs (``model.qdq.onnx``, symmetric INT8, explicit axes), FP16 where
:mod:`.fp16` inserted Casts and FP16 initializers for the configured nodes, FP32 elsewhere.
TensorRT then follows the tensor types exactly; no precision builder flag is set (11.x has
none). The converted graph is kept next to the engine (``<engine>.typed.onnx``) because it
is exactly what TensorRT built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import onnx

from quantkit.backends.tensorrt import network as net
from quantkit.backends.tensorrt.detect import strongly_typed_flags
from quantkit.backends.tensorrt.fp16 import FP16Report, convert_file

_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
# where quantkit.qdq.trt records the nodes it left without Q/DQ for TensorRT to build in FP16
FP16_METADATA_KEY = "quantkit.fp16_nodes"


def recorded_fp16_nodes(qdq_model: Path) -> list[str]:
    """The FP16 list stored in the Q/DQ model's metadata by the build stage (empty when absent)."""
    model = onnx.load(str(qdq_model), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == FP16_METADATA_KEY:
            return [str(name) for name in json.loads(prop.value)]
    return []


def typed_model_path(out_engine: Path) -> Path:
    """Where the FP16-converted Q/DQ model that TensorRT parses is kept."""
    return out_engine.with_name(out_engine.stem + ".typed.onnx")


def build_explicit(trt: Any, *, qdq_model: Path, out_engine: Path, fp16_nodes: Sequence[str],
                   ranges: Sequence[net.ShapeRange], workspace_mb: int, timing_cache: Path, console: Any,
                   num_profiles: int = 1) -> tuple[bytes, dict[str, Any]]:
    """Build the engine; returns (plan bytes, details for build.json).

    Raises:
        ConfigError: an FP16 node is unknown or cannot be converted.
        ModelError: parse/build failure.
    """
    typed_path = typed_model_path(out_engine)
    # the Q/DQ model names the nodes it left unquantized for FP16; build those too
    recorded = recorded_fp16_nodes(qdq_model)
    nodes = list(dict.fromkeys([*fp16_nodes, *recorded]))
    report = convert_file(qdq_model, typed_path, nodes)
    if report.clipped:
        console.warn(f"FP16 conversion clipped initializer values to +-65504: {report.clipped}")
    logger = net.make_logger(trt)
    builder = trt.Builder(logger)
    flags = strongly_typed_flags(trt)
    network = builder.create_network(flags)
    parser = net.parse_onnx(trt, network, logger, typed_path)
    config = builder.create_builder_config()
    net.set_workspace(trt, config, workspace_mb)
    net.add_profiles(builder, network, config, ranges, num_profiles)
    net.attach_timing_cache(config, timing_cache, console)
    engine_bytes = net.require_plan(builder.build_serialized_network(network, config))
    net.save_timing_cache(config, timing_cache)
    del parser  # keep the parser (and the weights it owns) alive until the build has finished
    details = {
        "typed_model": str(typed_path),
        "strongly_typed_flag": bool(flags),
        "fp16_conversion": {"nodes": report.nodes, "from_qdq_metadata": [n for n in recorded if n not in fp16_nodes], "casts_to_fp16": report.casts_to_fp16,
                            "casts_to_fp32": report.casts_to_fp32, "initializers": len(report.initializers),
                            "clipped": report.clipped},
        "flags": [],
        "layers": requested_precisions(onnx.load(str(typed_path), load_external_data=False), report),
    }
    return engine_bytes, details


def requested_precisions(model: onnx.ModelProto, report: FP16Report) -> dict[str, dict[str, Any]]:
    """ONNX node name -> {"requested": "int8" | "fp16" | "fp32"} as the typed graph states it.

    INT8: a compute node that reads a DequantizeLinear output; FP16: converted by
    :mod:`.fp16`; FP32: everything else. Q/DQ nodes and the inserted Casts are not listed.
    """
    producers = {output: node for node in model.graph.node for output in node.output}
    converted = set(report.nodes)
    result: dict[str, dict[str, Any]] = {}
    for node in model.graph.node:
        if node.op_type in _QDQ_OPS or node.name.endswith(("__cast_fp16", "__cast_fp32")):
            continue
        if node.name in converted:
            requested = "fp16"
        elif any(producers.get(name) is not None and producers[name].op_type == "DequantizeLinear"
                 for name in node.input):
            requested = "int8"
        else:
            requested = "fp32"
        result[node.name] = {"requested": requested}
    return result
