"""Explicit FP16 for chosen ONNX nodes: FP16 initializers and Cast nodes, as ModelOpt AutoCast does.

TensorRT 11 has no FP16 builder flag and no per-layer precision: a strongly typed network
runs each layer in the type of its tensors. So "run these nodes in FP16" has to be written
into the graph. For every chosen node:

* float32 initializers it reads become FP16 initializers (``<name>__fp16``; values beyond
  the FP16 range are clipped to +-65504 and counted);
* float32 activations it reads go through one ``Cast(to=FLOAT16)`` per tensor
  (``<name>__fp16``), shared by all chosen consumers - unless they come from another chosen
  node, which already produces them in FP16;
* its float32 outputs are produced in FP16 (``<name>__fp16``) and cast back to float32 under
  the original name for every consumer that stays in FP32 and for graph outputs, so graph
  inputs and outputs keep their types (AutoCast's ``keep_io_types``).

Which inputs and outputs change is read from the operator schema, not guessed: only the
type parameters that are bound to float32 in this node *and* allow float16 are converted
(so ``Resize``'s ``scales``, always float32, stays float32). Nodes whose type is set by an
attribute (Cast, ConstantOfShape ...) or that are part of quantization (Q/DQ) are refused.
Pure ONNX: runs and is tested on CPU.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quantkit.errors import ConfigError, ModelError

FP16_MAX = 65504.0
SUFFIX_FP16 = "__fp16"

# ops whose output type comes from an attribute or that belong to quantization
_REFUSED_OPS = {
    "Cast", "CastLike", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "QuantizeLinear",
    "DequantizeLinear", "DynamicQuantizeLinear", "If", "Loop", "Scan",
}
_FLOAT16 = "tensor(float16)"


@dataclass
class FP16Report:
    """What :func:`convert_nodes_to_fp16` changed.

    Attributes:
        nodes: the converted nodes, in graph order.
        casts_to_fp16: Cast nodes added in front of converted nodes.
        casts_to_fp32: Cast nodes added after them (for FP32 consumers and graph outputs).
        initializers: float32 initializers copied to FP16.
        clipped: initializer name -> number of values clipped to the FP16 range.
    """

    nodes: list[str] = field(default_factory=list)
    casts_to_fp16: int = 0
    casts_to_fp32: int = 0
    initializers: list[str] = field(default_factory=list)
    clipped: dict[str, int] = field(default_factory=dict)


@dataclass
class _Change:
    """Per converted node: which input / output positions turn FP16."""

    inputs: list[int]
    outputs: list[int]


def convert_nodes_to_fp16(model: onnx.ModelProto, node_names: Sequence[str]) -> tuple[onnx.ModelProto, FP16Report]:
    """A copy of ``model`` where the named top-level nodes compute in FP16.

    Args:
        model: a valid, topologically sorted ONNX model (float32 where it matters).
        node_names: ONNX node names to convert; an empty list returns an unchanged copy.

    Returns:
        The converted model (checked with ONNX shape inference in strict mode) and a report.

    Raises:
        ConfigError: a name matches no top-level node (with close matches), or names a node
            that cannot be converted (a Cast, a Q/DQ node, no float32 tensor ...).
        ModelError: the converted model fails ONNX type checking.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    report = FP16Report()
    if not node_names:
        return result, report
    graph = result.graph
    types = _tensor_types(result)
    opset = _default_opset(result)
    wanted = _find_nodes(graph, node_names)
    changes = {name: _plan_node(node, types, opset) for name, node in wanted.items()}
    _rewrite(graph, wanted, changes, report)
    try:
        onnx.shape_inference.infer_shapes(result, check_type=True, strict_mode=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises several error types
        raise ModelError(f"FP16 conversion produced an invalid model: {exc}") from None
    return result, report


def convert_file(source: Path, destination: Path, node_names: Sequence[str]) -> FP16Report:
    """:func:`convert_nodes_to_fp16` from one ONNX file to another (written atomically)."""
    from quantkit.artifacts import atomic_path

    converted, report = convert_nodes_to_fp16(onnx.load(str(source)), node_names)
    with atomic_path(destination) as tmp:
        onnx.save(converted, str(tmp))
    return report


# ---------------------------------------------------------------------------- analysis


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor name the graph knows (after shape inference)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"cannot infer tensor types before FP16 conversion: {exc}") from None
    graph = inferred.graph
    types = {init.name: init.data_type for init in graph.initializer}
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    return types


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ModelError("the model imports no default-domain opset")


def _find_nodes(graph: onnx.GraphProto, names: Iterable[str]) -> dict[str, onnx.NodeProto]:
    by_name: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        by_name.setdefault(node.name, []).append(node)
    found = {}
    for name in dict.fromkeys(names):
        nodes = by_name.get(name, [])
        if not nodes:
            close = difflib.get_close_matches(name, [n for n in by_name if n], n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"FP16 node {name!r} is not a top-level node of the model{hint}")
        if len(nodes) > 1:
            raise ConfigError(f"FP16 node name {name!r} is used by {len(nodes)} nodes; node names must be unique")
        found[name] = nodes[0]
    return found


def _formal(params: Sequence, index: int):
    """The schema parameter for actual position ``index`` (the last one repeats when variadic)."""
    if index < len(params):
        return params[index]
    last = params[-1] if params else None
    if last is not None and last.option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return last
    return None


def _plan_node(node: onnx.NodeProto, types: dict[str, int], opset: int) -> _Change:
    where = f"FP16 node {node.name!r} ({node.op_type})"
    if node.domain not in ("", "ai.onnx"):
        raise ConfigError(f"{where}: custom-domain operators cannot be converted")
    if node.op_type in _REFUSED_OPS:
        raise ConfigError(f"{where}: this operator's type is fixed by an attribute or by quantization; "
                          "choose the compute node next to it")
    schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    # type parameters bound to float32 in this node
    bound: set[str] = set()
    for params, names in ((schema.inputs, node.input), (schema.outputs, node.output)):
        for index, name in enumerate(names):
            formal = _formal(params, index)
            if name and formal is not None and types.get(name) == TensorProto.FLOAT and formal.type_str in allowed:
                bound.add(formal.type_str)
    blocked = sorted(t for t in bound if _FLOAT16 not in allowed[t])
    if blocked:
        raise ConfigError(f"{where}: type parameter(s) {blocked} do not allow float16 in opset {opset}")
    if not bound:
        raise ConfigError(f"{where}: has no float32 tensor to convert")

    def positions(params: Sequence, names: Sequence[str]) -> list[int]:
        chosen = []
        for index, name in enumerate(names):
            formal = _formal(params, index)
            if name and formal is not None and formal.type_str in bound and types.get(name) == TensorProto.FLOAT:
                chosen.append(index)
        return chosen

    outputs = positions(schema.outputs, node.output)
    if not outputs:  # e.g. Shape: reads floats, computes integers - nothing to run in FP16
        raise ConfigError(f"{where}: computes no float32 output, so there is nothing to run in FP16")
    return _Change(inputs=positions(schema.inputs, node.input), outputs=outputs)


# ---------------------------------------------------------------------------- rewriting


def _rewrite(graph: onnx.GraphProto, wanted: dict[str, onnx.NodeProto], changes: dict[str, _Change],
             report: FP16Report) -> None:
    initializers = {init.name: init for init in graph.initializer}
    graph_inputs = {info.name for info in graph.input}
    graph_outputs = {info.name for info in graph.output}
    converted_ids = {id(node) for node in wanted.values()}

    # tensors whose FP16 version a converted node produces directly
    fp16_produced = {node.output[i] for name, node in wanted.items() for i in changes[name].outputs}
    # consumers that stay in FP32, per tensor
    fp32_consumers: dict[str, int] = {}
    for node in graph.node:
        if id(node) not in converted_ids:
            for name in node.input:
                fp32_consumers[name] = fp32_consumers.get(name, 0) + 1
            _count_subgraph_inputs(node, fp32_consumers)

    new_nodes: list[onnx.NodeProto] = []
    made_fp16: set[str] = set()
    new_initializers: list[onnx.TensorProto] = []
    for node in graph.node:
        if id(node) not in converted_ids:
            new_nodes.append(node)
            continue
        change = changes[node.name]
        for index in change.inputs:
            source = node.input[index]
            target = source + SUFFIX_FP16
            if source not in fp16_produced and source not in made_fp16:
                if source in initializers and source not in graph_inputs:
                    new_initializers.append(_fp16_initializer(initializers[source], target, report))
                else:
                    new_nodes.append(helper.make_node("Cast", [source], [target], name=f"{source}__cast_fp16",
                                                      to=TensorProto.FLOAT16))
                    report.casts_to_fp16 += 1
                made_fp16.add(source)
            node.input[index] = target
        casts_back = []
        for index in change.outputs:
            original = node.output[index]
            node.output[index] = original + SUFFIX_FP16
            if fp32_consumers.get(original) or original in graph_outputs:
                casts_back.append(helper.make_node("Cast", [original + SUFFIX_FP16], [original],
                                                   name=f"{original}__cast_fp32", to=TensorProto.FLOAT))
        new_nodes.append(node)
        new_nodes.extend(casts_back)
        report.casts_to_fp32 += len(casts_back)
        report.nodes.append(node.name)

    # drop float32 initializers that only converted nodes read
    unused = {name for name in made_fp16 if name in initializers and not fp32_consumers.get(name)
              and name not in graph_outputs}
    kept = [init for init in graph.initializer if init.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_initializers)
    del graph.node[:]
    graph.node.extend(new_nodes)


def _count_subgraph_inputs(node: onnx.NodeProto, counts: dict[str, int]) -> None:
    """Outer-scope tensors read inside If/Loop/Scan bodies count as FP32 consumers."""
    for attribute in node.attribute:
        for subgraph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            for inner in subgraph.node:
                for name in inner.input:
                    counts[name] = counts.get(name, 0) + 1
                _count_subgraph_inputs(inner, counts)


def _fp16_initializer(init: onnx.TensorProto, name: str, report: FP16Report) -> onnx.TensorProto:
    values = numpy_helper.to_array(init).astype(np.float32)
    outside = int(np.count_nonzero(np.abs(values) > FP16_MAX))
    if outside:
        report.clipped[init.name] = outside
        values = np.clip(values, -FP16_MAX, FP16_MAX)
    report.initializers.append(init.name)
    return numpy_helper.from_array(values.astype(np.float16), name)
