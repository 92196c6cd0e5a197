"""Pad depthwise channel counts to a multiple of 16 for ONNX Runtime's uint8 depthwise kernel (CPU flavour).

ORT's NHWC uint8 depthwise convolution (MLAS, x86) runs 2-3x slower per channel when the channel
count is not a multiple of 16. Measured here, one QLinearConv between two 1x1 QLinearConvs, batch
32, 2 threads, microseconds per channel: 3x3 stride 1 at 28x28 -- 64: 5.3, 72: 12.8, 80: 4.1,
88: 13.2, 96: 5.8, 104: 12.3, 112: 5.7, 120: 13.9, 128: 5.3; 5x5 at 14x14 -- 120: 9.4, 128: 3.5.
MobileNetV3-Small has three such blocks (72, 88 and 120 channels): padding 88 -> 96 made that
block's depthwise conv 2.5x faster, the extra channels of the 1x1 convs around it cost 9 %.

The padding is exact. A *channel group* is the set of tensors that share one channel axis between
the dense convolutions that write it (the expansion conv, the squeeze-excite conv that writes the
gate) and the dense convolutions that read it (the projection, the squeeze-excite reduction),
passing only through ops that keep channels apart (depthwise conv, activations, pooling, the
squeeze-excite Mul). The writers get extra output channels with zero weights and bias, depthwise
convs extra zero kernels, the readers zero weights for the extra input channels -- so whatever the
extra channels hold, no real channel and no output sees it. Groups touching anything else (a
graph input or output, a residual Add, Concat, Reshape, shared weights) are left alone.

Only the CPU flavour is padded (TensorRT picks its own kernels). Tensor and node names are kept,
so ranges, exclusions and reports are unchanged; the probes of the sensitivity search run on the
unpadded model (they compare tensors with FP32 element by element).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

#: ORT's uint8 depthwise kernel is fast for channel counts that are a multiple of this (see the module doc).
CHANNEL_MULTIPLE = 16
#: Ops that keep channels apart: a padded channel never reaches a real one through them.
_CHANNELWISE = ("Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid", "LeakyRelu", "Identity",
                "GlobalAveragePool", "Mul")


@dataclass
class _Group:
    """One channel group: its tensors and how each node touching it must be padded."""

    channels: int
    tensors: set[str] = field(default_factory=set)
    writers: set[str] = field(default_factory=set)  # dense convs writing a group tensor: pad output channels
    readers: set[str] = field(default_factory=set)  # dense convs reading a group tensor: pad input channels
    depthwise: set[str] = field(default_factory=set)


def pad_depthwise_channels(model: onnx.ModelProto, multiple: int = CHANNEL_MULTIPLE
                           ) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
    """A copy of ``model`` whose depthwise convs have a multiple of ``multiple`` channels where that is exact.

    Returns:
        (the padded model -- ``model`` itself when nothing was padded --, depthwise node name ->
        (channels before, after)).
    """
    graph = _Graph(model)
    groups: list[_Group] = []
    seen: set[str] = set()
    for node in model.graph.node:
        channels = graph.depthwise_channels(node)
        if channels is None or channels % multiple == 0 or node.input[0] in seen:
            continue
        group = graph.channel_group(node.input[0], channels)
        if group is None:
            continue
        seen |= group.tensors
        groups.append(group)
    if not groups:
        return model, {}
    padded = copy.deepcopy(model)
    weights = {init.name: init for init in padded.graph.initializer}
    nodes = {node.name: node for node in padded.graph.node}
    report: dict[str, tuple[int, int]] = {}
    for group in groups:
        extra = -group.channels % multiple
        for name in group.writers:
            _pad(weights, nodes[name], axis=0, extra=extra)
        for name in group.readers:
            _pad(weights, nodes[name], axis=1, extra=extra, bias=False)
        for name in group.depthwise:
            node = nodes[name]
            _pad(weights, node, axis=0, extra=extra)
            for attr in node.attribute:
                if attr.name == "group":
                    attr.i = group.channels + extra
            report[name] = (group.channels, group.channels + extra)
        stale = group.tensors
        kept = [vi for vi in padded.graph.value_info if vi.name not in stale]
        del padded.graph.value_info[:]
        padded.graph.value_info.extend(kept)
    return onnx.shape_inference.infer_shapes(padded), report


def _pad(weights: dict[str, onnx.TensorProto], node: onnx.NodeProto, axis: int, extra: int, bias: bool = True) -> None:
    """Append ``extra`` zero slices to the node's weight on ``axis`` (and to its bias on axis 0)."""
    names = [node.input[1]] + ([node.input[2]] if bias and len(node.input) > 2 and node.input[2] else [])
    for index, name in enumerate(names):
        array = numpy_helper.to_array(weights[name])
        along = axis if index == 0 else 0
        shape = list(array.shape)
        shape[along] = extra
        grown = np.concatenate([array, np.zeros(shape, array.dtype)], axis=along)
        weights[name].CopyFrom(numpy_helper.from_array(grown, name))


class _Graph:
    """Producers, readers, weights and channel counts of the FP32 graph, for finding channel groups."""

    def __init__(self, model: onnx.ModelProto):
        inferred = onnx.shape_inference.infer_shapes(model)
        self.model = model
        self.producer = {out: node for node in model.graph.node for out in node.output if out}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in model.graph.node:
            for name in node.input:
                if name:
                    self.readers.setdefault(name, []).append(node)
        self.weights = {init.name: init for init in model.graph.initializer}
        uses: dict[str, int] = {}
        for node in model.graph.node:
            for name in node.input:
                uses[name] = uses.get(name, 0) + 1
        self.uses = uses
        self.boundary = {vi.name for vi in model.graph.input} | {vi.name for vi in model.graph.output}
        self.channels: dict[str, int] = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            dims = vi.type.tensor_type.shape.dim
            if len(dims) >= 2 and dims[1].HasField("dim_value"):
                self.channels[vi.name] = dims[1].dim_value

    def depthwise_channels(self, node: onnx.NodeProto) -> int | None:
        """The channel count of a depthwise Conv (group == channels, one input channel per kernel), else None."""
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in self.weights:
            return None
        shape = tuple(self.weights[node.input[1]].dims)
        group = next((attr.i for attr in node.attribute if attr.name == "group"), 1)
        if len(shape) != 4 or shape[1] != 1 or group != shape[0] or group < 2:
            return None
        return group

    def _dense_conv(self, node: onnx.NodeProto) -> bool:
        """A group-1 Conv whose weight (and bias) are initializers used by this node only."""
        if node.op_type != "Conv" or next((a.i for a in node.attribute if a.name == "group"), 1) != 1:
            return False
        params = [name for name in node.input[1:] if name]
        return bool(params) and all(name in self.weights and self.uses.get(name) == 1 for name in params)

    def channel_group(self, start: str, channels: int) -> _Group | None:
        """The channel group of tensor ``start`` (module doc), or None when it cannot be padded exactly."""
        group = _Group(channels)
        pending = [start]
        while pending:
            tensor = pending.pop()
            if tensor in group.tensors:
                continue
            if tensor in self.boundary or self.channels.get(tensor) != channels:
                return None
            group.tensors.add(tensor)
            producer = self.producer.get(tensor)
            if producer is None:
                return None
            if not self._visit(producer, tensor, group, pending, as_reader=False):
                return None
            for reader in self.readers.get(tensor, []):
                if not self._visit(reader, tensor, group, pending, as_reader=True):
                    return None
        return group if group.writers and group.readers and group.depthwise else None

    def _visit(self, node: onnx.NodeProto, tensor: str, group: _Group, pending: list[str], as_reader: bool) -> bool:
        """Record how ``node`` (writing or reading ``tensor``) joins the group; False when it cannot."""
        if not node.name:
            return False  # padding is applied by node name
        if self.depthwise_channels(node) == group.channels:
            if node.input[1] in self.weights and self.uses.get(node.input[1]) == 1 and all(
                    name in self.weights and self.uses.get(name) == 1 for name in node.input[2:] if name):
                group.depthwise.add(node.name)
                pending += [node.input[0], node.output[0]]
                return True
            return False
        if self._dense_conv(node):
            if as_reader and node.input[0] == tensor:
                group.readers.add(node.name)
                return True
            if not as_reader and node.output[0] == tensor:
                group.writers.add(node.name)
                return True
            return False
        if node.op_type in _CHANNELWISE and len(node.output) == 1:
            activations = [name for name in node.input if name and name not in self.weights]
            if node.op_type == "Mul" and len(activations) != 2:
                return False
            if node.op_type == "Clip":
                activations = activations[:1]  # min/max inputs are scalars
            pending += activations + [node.output[0]]
            return True
        return False
