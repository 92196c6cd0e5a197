"""Per-node quantization error in one pass: FP32 graph against the all-INT8 CPU flavour.

The FP32 graph and a *probe* of the INT8 graph run on the same batches with the tensors of
interest exposed as graph outputs (the CPU flavour keeps the FP32 tensor names: ORT's quantizer
inserts ``T -> Q -> DQ -> T_DequantizeLinear_Output`` and points the readers at the DQ output).
For every quantizable node we look at the tensor *its readers see*: the DQ output after the
node's output Q (so its output rounding counts), else the raw tensor.

* ``snr_db`` / ``cosine``: that tensor against FP32 -- the error accumulated up to and including
  the node;
* ``local_snr_db``: the node's *own* error. The probe also holds a float twin of each node that
  reads what the INT8 node reads but uses the FP32 weights and no output rounding; the difference
  between the two is what this node adds (weights, output rounding, lookup tables), independent
  of the error it was given. The input Q/DQ is the producer's when the producer is a measured
  node (its output rounding); otherwise (graph input, a float op such as HardSigmoid, ...) it
  exists for this node and counts as its own: the twin reads the tensor before it;
* ``output_snr_db``: an estimate of the model output's SNR if this node were the only one
  quantized -- its own noise times the gain from its output to the model's output. With
  relative noise powers (|r - q|^2 / |r|^2) that add up along the graph, a node ``m`` passes on
  ``(accumulated_m - own_m) / accumulated_in_m`` of the noise it receives; chaining these factors
  downstream gives each node's gain. This is the local ranking: in a deep network a small error
  in an early layer can matter more than a large one near the output, because everything after
  it amplifies it.

The probe runs unoptimized (``DQ -> float op -> Q``): exposing intermediate tensors stops ORT's
fusions anyway, and the unfused graph computes the same values as the integer kernels up to
accumulation rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from quantkit.qdq.graph import DEQUANTIZE, QUANTIZE, consumers

#: Suffix of the float twins' tensors and of the FP32 weights added to the probe.
_TWIN = "__quantkit_float"
#: Activations ORT's quantizer folds into the producer's output Q (the producer then writes their output tensor).
_FOLDED_OPS = ("Relu", "Clip")
#: Relative noise below this counts as none (keeps the dB figures finite and readable).
_NOISE_FLOOR = 1e-12


@dataclass(frozen=True)
class NodeError:
    """How far one node's output in the INT8 graph is from FP32 (see the module doc).

    Attributes:
        name / op_type: the ONNX node.
        tensor: the FP32 tensor compared (the node's output, or the ReLU/Clip it folds into).
        snr_db / cosine: accumulated error of that tensor as its readers see it.
        local_snr_db: the node's own error, in dB below the signal.
        output_snr_db: estimated model-output SNR with only this node's error (lower = more fragile).
    """

    name: str
    op_type: str
    tensor: str
    snr_db: float
    cosine: float
    local_snr_db: float
    output_snr_db: float

    def to_json(self) -> dict:
        return {key: (_finite(value) if isinstance(value, float) else value) for key, value in vars(self).items()}


class _Pair:
    """Streaming sums for one reference/test tensor pair (float64)."""

    def __init__(self) -> None:
        self.ref2 = self.test2 = self.dot = self.noise2 = 0.0

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        r = np.asarray(ref, np.float64).ravel()
        t = np.asarray(test, np.float64).ravel()
        d = r - t
        self.ref2 += float(r @ r)
        self.test2 += float(t @ t)
        self.dot += float(r @ t)
        self.noise2 += float(d @ d)

    @property
    def noise(self) -> float:
        """Relative noise power |r - q|^2 / |r|^2 (0 for identical tensors)."""
        if self.noise2 == 0:
            return 0.0
        return self.noise2 / self.ref2 if self.ref2 > 0 else math.inf

    @property
    def cosine(self) -> float:
        if self.ref2 == 0 and self.test2 == 0:
            return 1.0
        if self.ref2 == 0 or self.test2 == 0:
            return 0.0
        return max(-1.0, min(1.0, self.dot / math.sqrt(self.ref2 * self.test2)))


def local_errors(model: onnx.ModelProto, qmodel: onnx.ModelProto, nodes: Sequence[str],
                 batches: Iterable[Mapping[str, np.ndarray]], threads: int = 2) -> list[NodeError]:
    """Per-node error of ``qmodel`` (the CPU flavour of ``model``) against ``model``.

    Args:
        model: the FP32 model.
        qmodel: its all-INT8 CPU flavour.
        nodes: FP32 node names to measure; a node whose tensors cannot be found in ``qmodel``
            (not quantized there) is left out.
        batches: input feeds; every batch runs once through the FP32 graph and the INT8 probe.
        threads: ORT intra-op threads.

    Returns:
        One :class:`NodeError` per measured node, in the order of ``nodes``.
    """
    seen = _seen_tensors(qmodel)
    probe = onnx.ModelProto()
    probe.CopyFrom(qmodel)
    twins = _add_float_twins(model, probe, nodes, seen)
    wanted = list(dict.fromkeys(tensor for tensor, _ in twins.values()))
    int8_outputs = list(dict.fromkeys([seen[t] for t in wanted] + [twin for _, twin in twins.values()]))
    fp32 = _probe_session(model, wanted, threads)
    int8 = _probe_session(probe, int8_outputs, threads)
    accumulated = {t: _Pair() for t in wanted}
    own = {name: _Pair() for name in twins}
    for feeds in batches:
        feeds = dict(feeds)
        refs = dict(zip(wanted, fp32.run(wanted, feeds)))
        tests = dict(zip(int8_outputs, int8.run(int8_outputs, feeds)))
        for tensor in wanted:
            accumulated[tensor].update(refs[tensor], tests[seen[tensor]])
        for name, (tensor, twin) in twins.items():
            own[name].update(tests[twin], tests[seen[tensor]])
        del refs, tests
    by_name = {node.name: node for node in model.graph.node}
    total = {name: accumulated[tensor].noise for name, (tensor, _) in twins.items()}
    mine = {name: pair.noise for name, pair in own.items()}
    gains = _output_gains(model, list(twins), total, mine)
    return [NodeError(name, by_name[name].op_type, tensor, _db(total[name]), accumulated[tensor].cosine,
                      _db(mine[name]), _db(mine[name] * gains[name])) for name, (tensor, _) in twins.items()]


def rank_by_local_error(errors: Sequence[NodeError]) -> list[str]:
    """Node names, most promising to keep in float first: lowest estimated output SNR (module doc),
    then lowest own SNR, then graph order."""
    order = {error.name: index for index, error in enumerate(errors)}
    return [e.name for e in sorted(errors, key=lambda e: (e.output_snr_db, e.local_snr_db, order[e.name]))]


def _output_gains(model: onnx.ModelProto, names: Sequence[str], total: Mapping[str, float],
                  own: Mapping[str, float]) -> dict[str, float]:
    """Node -> estimated factor from the relative noise at its output to the model output's.

    Node ``m`` passes on ``t_m = (total_m - own_m) / max(total of its measured producers)``; a
    node's gain is the largest product of these factors along a path to a node with no measured
    consumer (gain 1: its error is at, or close to, the output).
    """
    predecessors = _measured_predecessors(model, names)
    successors: dict[str, list[str]] = {name: [] for name in names}
    for node, sources in predecessors.items():
        for source in sources:
            successors[source].append(node)
    order = {node.name: index for index, node in enumerate(model.graph.node)}
    gains: dict[str, float] = {}
    for name in sorted(names, key=lambda n: order.get(n, 0), reverse=True):
        best = 1.0 if not successors[name] else 0.0
        for node in successors[name]:
            received = max(total[source] for source in predecessors[node])
            passed = max(total[node] - own[node], 0.0) / received if received > _NOISE_FLOOR else 0.0
            best = max(best, passed * gains[node])
        gains[name] = best
    return gains


def _measured_predecessors(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, list[str]]:
    """Node -> the measured nodes whose outputs reach its inputs through unmeasured nodes only."""
    measured = set(names)
    producer = {out: node for node in model.graph.node for out in node.output if out}
    by_name = {node.name: node for node in model.graph.node}
    result: dict[str, list[str]] = {}
    for name in names:
        found: list[str] = []
        stack = [t for t in by_name[name].input if t in producer]
        visited: set[str] = set()
        while stack:
            source = producer[stack.pop()]
            if source.name in visited:
                continue
            visited.add(source.name)
            if source.name in measured:
                found.append(source.name)
            else:
                stack += [t for t in source.input if t in producer]
        result[name] = found
    return result


def _add_float_twins(model: onnx.ModelProto, probe: onnx.ModelProto, nodes: Sequence[str],
                     seen: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Add a float twin of each node to ``probe`` (in place): same op and attributes, the inputs the
    INT8 graph feeds it (activations as seen, FP32 weights), no output rounding.

    Returns:
        node name -> (the FP32 tensor compared, the twin's tensor in ``probe``).
    """
    by_name = {node.name: node for node in model.graph.node}
    initializers = {init.name: init for init in model.graph.initializer}
    read_by = consumers(model)
    producer = {out: node.name for node in model.graph.node for out in node.output if out}
    q_producer = {out: node.name for node in probe.graph.node for out in node.output if out}
    measured = set(nodes)
    added: set[str] = set()
    twins: dict[str, tuple[str, str]] = {}
    for name in nodes:
        node = by_name.get(name)
        if node is None or not node.output or not node.output[0]:
            continue
        tensor = _folded_output(node.output[0], read_by, seen)
        chain = [node] + ([read_by[node.output[0]][0]] if tensor is not None and tensor != node.output[0] else [])
        inputs = [t for t in node.input if t and t not in initializers]
        if tensor is None or any(t not in seen for t in inputs):
            continue
        for link in chain:
            twin = onnx.NodeProto()
            twin.CopyFrom(link)
            twin.name = f"{link.name}{_TWIN}"
            for index, source in enumerate(link.input):
                if source in initializers:
                    if source not in added:
                        array = numpy_helper.to_array(initializers[source])
                        probe.graph.initializer.append(numpy_helper.from_array(array, source + _TWIN))
                        added.add(source)
                    twin.input[index] = source + _TWIN
                elif source and link is node:
                    twin.input[index] = _twin_input(source, producer, q_producer, measured, seen)
                elif source:
                    twin.input[index] = source + _TWIN  # the folded ReLU/Clip reads the twin's output
            for index, out in enumerate(link.output):
                if out:
                    twin.output[index] = out + _TWIN
            probe.graph.node.append(twin)
        twins[name] = (tensor, tensor + _TWIN)
    return twins


def _twin_input(tensor: str, producer: Mapping[str, str], q_producer: Mapping[str, str], measured: set[str],
                seen: Mapping[str, str]) -> str:
    """What a float twin reads: the INT8 graph's input as the node sees it, except that a Q/DQ the
    node's producer does not own (graph inputs, float or pass-through producers) counts as the
    node's own error -- keeping the node in float removes that Q/DQ too -- so the twin reads the
    tensor before it. A ReLU/Clip that ORT folded into its producer (the tensor is now written by
    another node, before clipping) belongs to that producer."""
    own_producer = producer.get(tensor)
    if own_producer in measured or tensor not in seen or q_producer.get(tensor) != own_producer:
        return seen.get(tensor, tensor)
    return tensor


def _seen_tensors(qmodel: onnx.ModelProto) -> dict[str, str]:
    """FP32 tensor name -> the tensor its readers see in the Q/DQ model (a DQ output, or itself)."""
    produced = {out for node in qmodel.graph.node for out in node.output if out}
    produced |= {vi.name for vi in qmodel.graph.input}
    read_by = consumers(qmodel)
    seen = {name: name for name in produced}
    for node in qmodel.graph.node:
        if node.op_type != QUANTIZE:
            continue
        # a DQ with other scale/zero point than its Q reinterprets the integers (the folded
        # hard-sigmoid of quantkit.qdq.cpu): it holds another tensor, not this one rounded
        dqs = [user for user in read_by.get(node.output[0], [])
               if user.op_type == DEQUANTIZE and list(user.input[1:]) == list(node.input[1:])]
        if dqs:
            seen[node.input[0]] = dqs[0].output[0]
    return seen


def _folded_output(tensor: str, read_by: Mapping[str, list], seen: Mapping[str, str]) -> str | None:
    """The node's output tensor in both graphs, following a ReLU/Clip that ORT's quantizer folded away."""
    if tensor in seen and seen[tensor] != tensor:
        return tensor
    readers = read_by.get(tensor, [])
    if len(readers) == 1 and readers[0].op_type in _FOLDED_OPS and readers[0].output[0] in seen:
        return readers[0].output[0]
    return tensor if tensor in seen else None


def _probe_session(model: onnx.ModelProto, tensors: Sequence[str], threads: int):
    import onnxruntime as ort

    from quantkit.qdq.graph import with_outputs

    probe = with_outputs(model, tensors)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _db(noise: float) -> float:
    """Relative noise power -> dB below the signal (inf for no noise)."""
    if noise <= _NOISE_FLOOR:
        return math.inf
    return -10.0 * math.log10(noise)


def _finite(value: float) -> float | None:
    """JSON has no inf/nan: None stands for 'no measurable noise' / 'undefined'."""
    return round(value, 6) if math.isfinite(value) else None
