"""Build steps both TensorRT paths share: parse, optimization profiles, timing cache, layer names.

Every function takes the imported ``trt`` module (and TensorRT objects named by their role,
see :mod:`.surface`) and uses only names that exist in both the 10.x and 11.x bindings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from quantkit.artifacts import atomic_write_bytes
from quantkit.config import InputSpec
from quantkit.errors import ConfigError, ModelError

_ONNX_LAYER = re.compile(r"\[ONNX Layer: (.*?)\]")
MIB = 1 << 20


@dataclass(frozen=True)
class ShapeRange:
    """min/opt/max shapes of one network input."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def make_logger(trt: Any) -> Any:
    """A TensorRT logger that shows warnings and errors (TensorRT's own default severity)."""
    return trt.Logger(trt.Logger.WARNING)


def parse_onnx(trt: Any, network: Any, logger: Any, model_path: Path) -> Any:
    """Parse ``model_path`` into ``network``; returns the parser (keep it alive until the build ends).

    Raises:
        ModelError: listing every parser error with its ONNX node.
    """
    parser = trt.OnnxParser(network, logger)
    data = Path(model_path).read_bytes()
    # the path lets the parser find external weight files next to the model
    if parser.parse(data, str(model_path)):
        return parser
    messages = []
    for index in range(parser.num_errors):
        parser_error = parser.get_error(index)
        node = parser_error.node_name() or f"#{parser_error.node()}"
        messages.append(f"node {node} ({parser_error.node_operator()}): {parser_error.desc()}")
    detail = "; ".join(messages) or "no error reported"
    raise ModelError(f"TensorRT cannot parse {model_path}: {detail}")


def peek_data_shapes(calibration_batches: Callable[[], Iterator[Mapping[str, np.ndarray]]] | None
                     ) -> dict[str, tuple[int, ...]]:
    """Shapes of the first calibration batch (the source of non-batch dynamic axes), or {}."""
    if calibration_batches is None:
        return {}
    for batch in calibration_batches():
        return {name: tuple(int(d) for d in np.shape(array)) for name, array in batch.items()}
    return {}


def shape_ranges(input_specs: Sequence[InputSpec], batch: tuple[int, int, int],
                 data_shapes: Mapping[str, tuple[int, ...]]) -> list[ShapeRange]:
    """min/opt/max per input: the batch axis from ``batch``, other dynamic axes from the data.

    Args:
        input_specs: the model inputs from the config (a string dimension is dynamic).
        batch: (min, opt, max) batch sizes of the optimization profile.
        data_shapes: input name -> shape of a data batch (used for dynamic non-batch axes).

    Raises:
        ConfigError: a dynamic non-batch axis whose size the data does not give.
    """
    batch_min, batch_opt, batch_max = batch
    if not 1 <= batch_min <= batch_opt <= batch_max:
        raise ConfigError(f"profile batch sizes must satisfy 1 <= min <= opt <= max, got {batch}")
    ranges = []
    for spec in input_specs:
        fixed: list[int] = []
        for axis, dim in enumerate(spec.shape[1:], start=1):
            if isinstance(dim, int):
                fixed.append(dim)
                continue
            shape = data_shapes.get(spec.name)
            if shape is None or len(shape) != len(spec.shape):
                raise ConfigError(f"input {spec.name!r} axis {axis} ({dim!r}) is dynamic and no calibration data "
                                  "gives its size; TensorRT needs it for the optimization profile")
            fixed.append(int(shape[axis]))
        if isinstance(spec.shape[0], int):
            first = (spec.shape[0],) * 3
        else:
            first = (batch_min, batch_opt, batch_max)
        ranges.append(ShapeRange(spec.name, (first[0], *fixed), (first[1], *fixed), (first[2], *fixed)))
    return ranges


def add_profiles(builder: Any, network: Any, config: Any, ranges: Sequence[ShapeRange], count: int = 1) -> Any:
    """Add ``count`` identical optimization profiles; returns the first (for calibration).

    Raises:
        ModelError: the network's inputs and the configured inputs differ, or TensorRT rejects the profile.
    """
    network_inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    configured = [r.name for r in ranges]
    if sorted(network_inputs) != sorted(configured):
        raise ModelError(f"the ONNX model's inputs {network_inputs} differ from the configured inputs {configured}")
    first = None
    for _ in range(max(1, count)):
        profile = builder.create_optimization_profile()
        for shape_range in ranges:
            profile.set_shape(shape_range.name, shape_range.min, shape_range.opt, shape_range.max)
        if config.add_optimization_profile(profile) < 0:
            raise ModelError(f"TensorRT rejected the optimization profile {[vars(r) for r in ranges]}")
        first = first if first is not None else profile
    return first


def set_workspace(trt: Any, config: Any, workspace_mb: int) -> None:
    """Limit the builder's scratch memory."""
    if workspace_mb < 1:
        raise ConfigError(f"workspace_mb must be >= 1, got {workspace_mb}")
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb * MIB)


def attach_timing_cache(config: Any, path: Path, console: Any) -> None:
    """Start from the timing cache at ``path`` (or an empty one); a cache from another GPU is dropped."""
    data = Path(path).read_bytes() if Path(path).is_file() else b""
    timing_cache = config.create_timing_cache(data)
    if not config.set_timing_cache(timing_cache, False) and data:
        console.warn(f"{path}: timing cache does not fit this GPU/TensorRT; starting an empty one")
        timing_cache = config.create_timing_cache(b"")
        config.set_timing_cache(timing_cache, False)


def save_timing_cache(config: Any, path: Path) -> None:
    """Write the builder's (updated) timing cache atomically, so the next build is faster."""
    timing_cache = config.get_timing_cache()
    if timing_cache is not None:
        atomic_write_bytes(Path(path), bytes(timing_cache.serialize()))


def onnx_nodes_of(layer: Any) -> list[str]:
    """The ONNX node names a network layer came from.

    The ONNX parser records ``[ONNX Layer: <node name>]`` in each layer's metadata; layer
    names follow node names too, but get suffixes when one node makes several layers.
    """
    names = _ONNX_LAYER.findall(layer.metadata or "")
    return names or [layer.name]


def require_plan(plan: Any) -> bytes:
    """The serialized engine as bytes; ModelError when ``build_serialized_network`` returned None."""
    if plan is None:
        raise ModelError("TensorRT could not build the engine (build_serialized_network returned None); "
                         "the TensorRT log above says why")
    return bytes(plan)
