"""Where Q/DQ goes: which nodes each flavour quantizes and which tensors need a calibrated range.

Placement is a *node selection*: this module decides which nodes run in INT8 in each flavour;
ONNX Runtime's ``QDQQuantizer`` (driven from :mod:`quantkit.qdq.ortquant`) then places the
QuantizeLinear/DequantizeLinear pairs around exactly those nodes. The policies:

* **CPU** (ONNX Runtime, x86): every op ORT runs as a fused integer kernel when its inputs
  and output are quantized -- Conv/ConvTranspose/Gemm/MatMul, Add/Mul of two activations
  (residuals, squeeze-excite), pooling, LUT activations (Sigmoid, LeakyRelu), HardSwish and HardSigmoid
  (requantizations, :mod:`quantkit.qdq.cpu`), plus the ops that just pass uint8 through (ReLU/Clip
  fold into the producer's Q range; MaxPool, Flatten, Reshape ... share their input's scale).
* **TensorRT**: Q/DQ only on the activation and weight inputs of Conv/ConvTranspose/Gemm/MatMul
  and on both inputs of residual Adds (so TensorRT fuses Conv+Add); never on outputs. TensorRT
  fuses the pointwise ops around them itself.

Exclusions (``build.fallback`` / ``--exclude``) are node names, glob patterns over node names,
or op types; :func:`resolve_exclusions` fails on a pattern that matches nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import onnx
from onnx import TensorProto

from quantkit.errors import ConfigError, ModelError

CPU = "cpu"
TRT = "trt"
FLAVOURS = (CPU, TRT)

# Per-channel Q/DQ (the `axis` attribute of QuantizeLinear/DequantizeLinear) arrived in opset 13.
MIN_OPSET = 13

#: Ops with a weight: the ones INT8 is for.
COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
#: Binary ops quantized when both inputs are activations (residual Add, squeeze-excite Mul).
BINARY_OPS = ("Add", "Mul")
#: Ops ORT runs as their own integer kernel when DQ -> op -> Q (each needs input and output ranges).
#: (HardSwish is lowered to a requantization and a QLinearMul, HardSigmoid folded into its producer's
#: Q: :mod:`quantkit.qdq.cpu`.)
CPU_OWN_RANGE_OPS = ("GlobalAveragePool", "AveragePool", "Sigmoid", "LeakyRelu", "HardSwish", "HardSigmoid")
#: Ops ORT folds into the producer's Q (ReLU/Clip) or runs on uint8 with the input's scale.
CPU_PASS_THROUGH_OPS = ("Relu", "Clip", "MaxPool", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose")
CPU_OPS = COMPUTE_OPS + BINARY_OPS + CPU_OWN_RANGE_OPS + CPU_PASS_THROUGH_OPS
TRT_OPS = COMPUTE_OPS + ("Add",)
QUANTIZABLE_OPS = tuple(dict.fromkeys(CPU_OPS + TRT_OPS))

_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class QuantizableNode:
    """A node one of the flavours could run in INT8.

    Attributes:
        name: the node name.
        op_type: its op type.
        cpu: the CPU flavour quantizes this kind of node.
        trt: the TensorRT flavour quantizes this kind of node.
        unsupported: why no flavour can quantize this particular node (None when one can).
    """

    name: str
    op_type: str
    cpu: bool
    trt: bool
    unsupported: str | None = None

    def in_flavour(self, flavour: str) -> bool:
        return self.cpu if flavour == CPU else self.trt

    @property
    def reported(self) -> bool:
        """Listed in build.json: ops that get their own Q/DQ (pass-through ops follow their input)."""
        return self.op_type not in CPU_PASS_THROUGH_OPS


class GraphInfo:
    """Read-only facts about a model's main graph: producers, consumers, constants, types and shapes."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.nodes = list(model.graph.node)
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001 - shape inference is best effort; missing types make nodes unsupported
            inferred = model
        infos = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
        self._types = {vi.name: vi.type.tensor_type.elem_type for vi in infos if vi.type.HasField("tensor_type")}
        self._shapes = {vi.name: _static_shape(vi) for vi in infos if vi.type.HasField("tensor_type")}
        self.initializers = {init.name: init for init in model.graph.initializer}
        for init in model.graph.initializer:
            self._types[init.name] = init.data_type
            self._shapes[init.name] = tuple(init.dims)
        self.constant_outputs = {out for node in self.nodes if node.op_type == "Constant" for out in node.output}
        self.graph_inputs = [vi.name for vi in model.graph.input if vi.name not in self.initializers]
        self.graph_outputs = {vi.name for vi in model.graph.output}

    @cached_property
    def producer(self) -> dict[str, onnx.NodeProto]:
        return {out: node for node in self.nodes for out in node.output if out}

    @cached_property
    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        result: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.input:
                if name:
                    result.setdefault(name, []).append(node)
        return result

    @cached_property
    def by_name(self) -> dict[str, onnx.NodeProto]:
        return {node.name: node for node in self.nodes}

    def is_constant(self, tensor: str) -> bool:
        return tensor in self.initializers or tensor in self.constant_outputs

    def is_float(self, tensor: str) -> bool:
        return self._types.get(tensor) == TensorProto.FLOAT

    def shape(self, tensor: str) -> tuple | None:
        return self._shapes.get(tensor)

    def opset(self) -> int:
        for entry in self.model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                return entry.version
        return 0

    def tensor_order(self) -> dict[str, int]:
        """Graph order of every tensor: graph inputs first, then node outputs as nodes appear."""
        order: dict[str, int] = {}
        for name in self.graph_inputs:
            order.setdefault(name, len(order))
        for node in self.nodes:
            for name in list(node.input) + list(node.output):
                if name:
                    order.setdefault(name, len(order))
        return order


def _static_shape(vi: onnx.ValueInfoProto) -> tuple | None:
    if not vi.type.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in vi.type.tensor_type.shape.dim)


# --------------------------------------------------------------------------- checks


def check_model(model: onnx.ModelProto, info: GraphInfo | None = None) -> GraphInfo:
    """Refuse models no flavour can quantize, before anything is written.

    Raises:
        ConfigError: the opset is older than 13 (per-channel Q/DQ needs the ``axis`` attribute).
        ModelError: no node can be quantized.
    """
    info = info or GraphInfo(model)
    opset = info.opset()
    if opset < MIN_OPSET:
        raise ConfigError(
            f"model opset {opset} is too old for per-channel Q/DQ (needs >= {MIN_OPSET})",
            hint=f"re-export with export.opset: {MIN_OPSET} or newer",
        )
    usable = [n for n in quantizable_nodes(model, info) if n.unsupported is None and n.op_type in COMPUTE_OPS]
    if not usable:
        raise ModelError(
            "model has no quantizable Conv/ConvTranspose/Gemm/MatMul with float activations and constant "
            "weights: nothing to build in INT8"
        )
    return info


def quantizable_nodes(model: onnx.ModelProto, info: GraphInfo | None = None) -> list[QuantizableNode]:
    """Every node of a quantizable op type, in graph order, with what each flavour may do with it."""
    info = info or GraphInfo(model)
    result = []
    for node in info.nodes:
        if node.op_type not in QUANTIZABLE_OPS or not _is_candidate(node, info):
            continue
        cpu = node.op_type in CPU_OPS
        trt = node.op_type in TRT_OPS
        result.append(QuantizableNode(node.name, node.op_type, cpu, trt, _unsupported_reason(node, info)))
    return result


def _is_candidate(node: onnx.NodeProto, info: GraphInfo) -> bool:
    """Whether a node of a quantizable op type is one this tool considers at all.

    Add/Mul count only between two activations (with a constant they are a bias, a scale or a
    mask), and an Add only without broadcasting (a residual; a broadcast Add is e.g. an attention
    mask whose huge negative values would swamp the uint8 grid). Pass-through and LUT ops count
    only on float tensors (on integer tensors they are shape arithmetic).
    """
    inputs = [name for name in node.input if name]
    if node.op_type in BINARY_OPS:
        if len(inputs) != 2 or any(info.is_constant(name) for name in inputs):
            return False
        return node.op_type == "Mul" or _is_residual_add(node, info)
    if node.op_type in CPU_PASS_THROUGH_OPS + CPU_OWN_RANGE_OPS:
        return bool(inputs) and info.is_float(inputs[0])
    return True


def _unsupported_reason(node: onnx.NodeProto, info: GraphInfo) -> str | None:
    """Why this node cannot be quantized by any flavour, or None."""
    if not node.name:
        return "node has no name"
    op = node.op_type
    inputs = [name for name in node.input if name]
    if not inputs:
        return "no inputs"
    if op in ("Conv", "ConvTranspose", "Gemm"):
        if len(inputs) < 2 or not info.is_constant(node.input[1]) or node.input[1] not in info.initializers:
            return "weight is not a constant initializer"
        if not info.is_float(node.input[1]):
            return "weight is not float32"
        if info.is_constant(node.input[0]) or not info.is_float(node.input[0]):
            return "activation input is not a float32 tensor"
        if op == "Gemm" and len(node.input) > 2 and node.input[2] and not info.is_constant(node.input[2]):
            return "bias is not constant"
        return None
    if op == "MatMul":
        if info.is_constant(node.input[0]):
            return "constant first input (only B may be a weight)"
        if not (info.is_float(node.input[0]) and info.is_float(node.input[1])):
            return "inputs are not float32"
        if info.is_constant(node.input[1]) and node.input[1] not in info.initializers:
            return "weight is a Constant node, not an initializer"
        return None
    if op in BINARY_OPS:
        if not all(info.is_float(name) for name in inputs):
            return "inputs are not float32"
        return None
    if not info.is_float(node.input[0]):
        return "input is not float32"
    return None


def _is_residual_add(node: onnx.NodeProto, info: GraphInfo) -> bool:
    """An Add of two activations of the same shape (no broadcasting): the skip connection of a block.

    Shape inference leaves symbolic dims (``batch``, ``unk__3``) that cannot be compared, so only
    static dims are: equal ranks, equal static dims, and no static 1 against anything else.
    """
    shape_a, shape_b = info.shape(node.input[0]), info.shape(node.input[1])
    if shape_a is None or shape_b is None or len(shape_a) != len(shape_b):
        return False
    for a, b in zip(shape_a, shape_b):
        if isinstance(a, int) and isinstance(b, int) and a != b:
            return False
        if (a == 1) != (b == 1):
            return False
    return True


# --------------------------------------------------------------------------- selection


def select_nodes(nodes: Sequence[QuantizableNode], flavour: str, exclude: Iterable[str] = ()) -> list[str]:
    """Names of the nodes ``flavour`` quantizes: supported, in the flavour's table, not excluded."""
    excluded = set(exclude)
    return [n.name for n in nodes if n.unsupported is None and n.in_flavour(flavour) and n.name not in excluded]


def resolve_exclusions(model: onnx.ModelProto, patterns: Iterable[str]) -> dict[str, list[str]]:
    """Match each exclusion pattern against the graph.

    A pattern is a node name, a glob over node names (``/head/*``) or an op type (``Sigmoid``).

    Args:
        model: the FP32 model.
        patterns: from ``build.fallback`` and ``--exclude``, in that order.

    Returns:
        pattern -> matched node names (graph order), for every pattern.

    Raises:
        ConfigError: a pattern matches nothing; the message names close node names/op types.
    """
    names = [node.name for node in model.graph.node if node.name]
    op_types = sorted({node.op_type for node in model.graph.node})
    matches: dict[str, list[str]] = {}
    for pattern in dict.fromkeys(patterns):
        if pattern in op_types:
            found = [node.name for node in model.graph.node if node.op_type == pattern and node.name]
        elif _GLOB_CHARS & set(pattern):
            found = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        else:
            found = [name for name in names if name == pattern]
        if not found:
            close = difflib.get_close_matches(pattern, names + op_types, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
                f"op types in this model: {', '.join(op_types)}"
            raise ConfigError(f"exclude pattern {pattern!r} matches no node name, glob or op type in the model",
                              hint=hint)
        matches[pattern] = found
    return matches


# --------------------------------------------------------------------------- calibration targets


def calibration_targets(model: onnx.ModelProto) -> list[str]:
    """Every tensor that needs a calibrated range so that both flavours can be written.

    That is what ONNX Runtime's Q/DQ quantizer asks a range for when it quantizes every node each
    flavour may quantize (no exclusions: excluding nodes only ever needs fewer ranges): graph inputs
    feeding quantized ops, activation inputs of Conv/ConvTranspose/Gemm/MatMul, both inputs of
    residual Adds, and -- for the CPU flavour's DQ -> op -> Q fusion -- the outputs of quantized ops
    (including ReLU outputs, whose range replaces the producer's).

    Args:
        model: the FP32 model (``model.onnx``).

    Returns:
        Tensor names in graph order, no duplicates.
    """
    from quantkit.qdq import ortquant

    info = GraphInfo(model)
    nodes = quantizable_nodes(model, info)
    wanted: set[str] = set()
    for flavour in FLAVOURS:
        selected = select_nodes(nodes, flavour)
        if selected:
            wanted |= set(ortquant.tensors_needing_ranges(model, selected, flavour))
    order = info.tensor_order()
    return sorted(wanted, key=lambda name: order.get(name, len(order)))


# --------------------------------------------------------------------------- float regions


def input_side_regions(model: onnx.ModelProto, quantized: Sequence[str], limit: int = 3,
                       info: GraphInfo | None = None) -> list[list[str]]:
    """Growing float prefixes of the graph, one resolution stage at a time, for the speed guard to try.

    A *cut* is a point in graph order where a single tensor carries everything the rest of the graph
    needs; cuts are grouped by that tensor's per-sample size (a resolution stage), and each region
    runs from the graph inputs to the last cut of a stage -- so the float->INT8 boundary, where a
    Q and a layout change go, sits on the stage's output. Early stages are where INT8 pays least
    on CPU (few channels at full resolution, memory-bound kernels, the first Q on the biggest
    tensor), so these are the candidates the guard times.

    Args:
        model: the FP32 model.
        quantized: the nodes the CPU flavour currently quantizes.
        limit: how many regions at most.

    Returns:
        Regions (lists of node names, graph order), each containing the previous one; a region never
        takes more than half of the quantized compute nodes.
    """
    info = info or GraphInfo(model)
    quantized_set = set(quantized)
    is_compute = [n.name in quantized_set and n.op_type in COMPUTE_OPS for n in info.nodes]
    total = sum(is_compute)
    stages: list[tuple[tuple, list[tuple[int, int]]]] = []  # (stage key, [(boundary size, cut index)])
    for index, tensor in sorted(_single_tensor_cuts(info).items()):
        key = _stage_key(info.shape(tensor), len(stages))
        if not stages or stages[-1][0] != key:
            stages.append((key, []))
        stages[-1][1].append((_sample_size(info.shape(tensor)), index))
    stage_end: list[int] = []
    for _, cuts in stages:
        smallest = min(size for size, _ in cuts)
        stage_end.append(max(index for size, index in cuts if size == smallest))
    regions: list[list[str]] = []
    covered = 0
    for end in stage_end:
        count = sum(is_compute[: end + 1])
        if count <= covered:
            continue
        if count * 2 > total:
            break
        regions.append([n.name for n in info.nodes[: end + 1] if n.name])
        covered = count
        if len(regions) == limit:
            break
    return regions


def _stage_key(shape: tuple | None, position: int) -> tuple:
    """Cuts in one resolution stage share their spatial dims (everything after batch and channels)."""
    if not shape or len(shape) < 3:
        return ("unknown", position)
    return tuple(shape[2:])


def _sample_size(shape: tuple | None) -> int:
    """Elements per sample (static dims after the batch axis); unknown sizes sort last."""
    if not shape:
        return 1 << 62
    size = 1
    for dim in shape[1:]:
        if not isinstance(dim, int):
            return 1 << 62
        size *= dim
    return size


def _single_tensor_cuts(info: GraphInfo) -> dict[int, str]:
    """Node index -> the one non-constant tensor still needed downstream after that node."""
    last_use: dict[str, int] = {}
    for index, node in enumerate(info.nodes):
        for name in node.input:
            if name:
                last_use[name] = index
    end = len(info.nodes)
    for name in info.graph_outputs:
        last_use[name] = end
    live: set[str] = {name for name in info.graph_inputs if name in last_use}
    cuts: dict[int, str] = {}
    for index, node in enumerate(info.nodes):
        live = {name for name in live if last_use.get(name, -1) > index}
        for name in node.output:
            if name and last_use.get(name, -1) > index and not info.is_constant(name):
                live.add(name)
        if len(live) == 1 and index < end - 1:
            cuts[index] = next(iter(live))
    return cuts
