"""Which nodes to keep in float: score candidate models on the final outputs, then choose greedily.

* :class:`OutputScorer` runs a candidate Q/DQ model (serialized in memory, never written to disk)
  on fixed evaluation batches and compares its first output with FP32's, which is computed once.
* :func:`search_fallback` takes a function ``float set -> Score`` and a ranking (from the local
  pass, :mod:`quantkit.qdq.sensitivity_metrics`), and returns the smallest set it finds that
  meets ``metric >= target`` within ``cap`` nodes:

  1. the all-INT8 model (empty set); if it meets the budget, nothing is kept in float;
  2. leave-one-out for the ``candidates`` leading nodes of the ranking (all-INT8 but that node);
  3. greedy forward steps: try adding each of the ``beam`` best remaining nodes (by their
     leave-one-out result) and the graph neighbours of the nodes already chosen -- two adjacent
     float nodes also drop the Q/DQ pair between them, which leave-one-out cannot see -- and keep
     the one with the highest output cosine, even when that is lower than before (a float region
     often pays only once it is complete); stop when the budget is met or the cap is reached;
  4. if the budget is met, drop every chosen node whose removal still meets it; if not, keep the
     state of the greedy path with the best budget figure (fewest nodes on ties) if it beats the
     all-INT8 figure by at least ``min_gain`` -- else none: float nodes cost speed, and a gain
     within the evaluation set's noise does not pay for it.

Steps are chosen by output cosine even when the budget is on top-1 agreement. On a few dozen
samples agreement moves in steps of 1/N and, near FP32, mostly by a handful of near-tie samples:
choosing the node that happens to flip one of them back fits the noise of the evaluation set (a
held-out half showed it: 0.95 on the samples chosen on, lower on the others). Cosine moves smoothly
with the error that eventually flips the argmax; the budget only decides when to stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from quantkit.bench.accuracy import OutputComparator, is_classifier_output
from quantkit.errors import ConfigError

METRICS = ("top1_agreement", "cosine")


@dataclass(frozen=True)
class Score:
    """A candidate model's first output against FP32 on the evaluation batches.

    ``error`` is set (and the figures are NaN) when ONNX Runtime refused the model.
    """

    cosine: float
    top1_agreement: float | None
    snr_db: float
    error: str | None = None

    def value(self, metric: str) -> float:
        """The figure the budget is on; -inf for a failed model."""
        if self.error is not None:
            return -math.inf
        value = self.cosine if metric == "cosine" else self.top1_agreement
        return -math.inf if value is None or math.isnan(value) else value

    def meets(self, metric: str, target: float) -> bool:
        return self.value(metric) >= target

    def to_json(self) -> dict:
        def clean(value):
            return round(value, 6) if isinstance(value, float) and math.isfinite(value) else None
        payload = {"cosine": clean(self.cosine), "top1_agreement": clean(self.top1_agreement),
                   "snr_db": clean(self.snr_db)}
        if self.error is not None:
            payload["error"] = self.error
        return payload


@dataclass(frozen=True)
class EvalBatch:
    """One batch of inputs; ``size`` real samples, the rest padding."""

    inputs: Mapping[str, np.ndarray]
    size: int


class OutputScorer:
    """Scores candidate models on fixed batches against the FP32 model's first output.

    Args:
        reference: the FP32 model; run once here, its outputs kept.
        batches: the evaluation batches.
        threads: ORT intra-op threads (sessions use ORT_ENABLE_ALL, as deployed).
    """

    def __init__(self, reference: onnx.ModelProto, batches: Sequence[EvalBatch], threads: int = 2):
        self.batches = list(batches)
        self.threads = threads
        self.evaluations = 0
        session = _session(reference, threads)
        self.output_name = session.get_outputs()[0].name
        self.references = [session.run([self.output_name], dict(b.inputs))[0][:b.size] for b in self.batches]

    @property
    def classifier(self) -> bool:
        """Whether the first output is [N, C] (top-1 agreement is defined)."""
        return bool(self.references) and is_classifier_output(self.references[0])

    def score(self, model: onnx.ModelProto) -> Score:
        """Run ``model`` (serialized in memory) on every batch; a model ORT refuses scores as an error."""
        self.evaluations += 1
        comparator = OutputComparator(self.output_name)
        try:
            session = _session(model, self.threads)
            for batch, reference in zip(self.batches, self.references):
                output = session.run([self.output_name], dict(batch.inputs))[0]
                comparator.update(reference, output[:batch.size])
        except Exception as exc:  # noqa: BLE001 - ORT raises its own types; a refused candidate is a result
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return Score(math.nan, None, math.nan, error=message[:300])
        result = comparator.result()
        return Score(result.cosine, result.top1_agreement, result.snr_db)


def check_metric(metric: str, scorer: OutputScorer) -> None:
    """Top-1 agreement needs an [N, C] first output.

    Raises:
        ConfigError: it does not have one.
    """
    if metric not in METRICS:
        raise ConfigError(f"unknown sensitivity metric {metric!r}", hint=f"one of {', '.join(METRICS)}")
    if metric == "top1_agreement" and not scorer.classifier:
        shape = list(scorer.references[0].shape) if scorer.references else []
        raise ConfigError(f"build.fallback.auto.metric top1_agreement needs a first output shaped [N, C]; "
                          f"{scorer.output_name!r} is {shape}", hint="use metric: cosine")


@dataclass
class SearchResult:
    """What :func:`search_fallback` tried and chose.

    Attributes:
        baseline: the all-INT8 score (empty float set).
        chosen: nodes to keep in float, in the order they were added.
        final: the score with ``chosen`` in float.
        met: whether ``final`` meets the budget.
        leave_one_out: node -> score with only that node in float (the tested candidates).
        steps: the greedy steps and pruning, for the report.
    """

    baseline: Score
    chosen: list[str]
    final: Score
    met: bool
    leave_one_out: dict[str, Score] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)


def search_fallback(score_set: Callable[[Sequence[str]], Score], ranked: Sequence[str], *, metric: str,
                    target: float, cap: int, candidates: int, neighbours: Mapping[str, Sequence[str]] | None = None,
                    beam: int = 4, max_neighbours: int = 4, min_gain: float = 0.0,
                    on_step: Callable[[str], None] | None = None) -> SearchResult:
    """The smallest float set found that meets ``metric >= target`` within ``cap`` nodes (module doc).

    Args:
        score_set: float set -> score of the model with those nodes in float, the rest INT8.
        ranked: candidate nodes, most fragile first (local pass).
        metric / target: the budget.
        cap: the most nodes that may be kept in float.
        candidates: how many leading nodes of ``ranked`` get the leave-one-out test.
        neighbours: node -> adjacent candidate nodes (tried next to a chosen node); none by default.
        beam: how many of the best remaining leave-one-out nodes each greedy step tries.
        max_neighbours: how many neighbours of the chosen set each step tries at most.
        min_gain: when the budget cannot be met, the least rise of the budget's figure over all-INT8
            that keeps a set (:func:`significant_gain`); 0: any rise.
        on_step: called with a line of text after each decision (progress for the terminal).

    Returns:
        A :class:`SearchResult`; when the budget cannot be met, ``chosen`` is the best set found
        within the cap and ``met`` is False.
    """
    say = on_step or (lambda text: None)
    baseline = score_set([])
    result = SearchResult(baseline, [], baseline, baseline.meets(metric, target))
    if result.met or cap <= 0:
        return result
    tested = list(ranked[:candidates])
    for node in tested:
        result.leave_one_out[node] = score_set([node])
    order = sorted((n for n in tested if result.leave_one_out[n].error is None),
                   key=lambda n: _key(result.leave_one_out[n], metric), reverse=True)
    current: list[str] = []
    current_score = baseline
    path = [([], baseline)]
    while len(current) < cap and not current_score.meets(metric, target):
        trials = _step_trials(current, order, neighbours or {}, beam, max_neighbours)
        if not trials:
            break
        scores = {node: result.leave_one_out[node] if not current and node in result.leave_one_out
                  else score_set(current + [node]) for node in trials}
        best = max(trials, key=lambda n: _key(scores[n], metric))
        if scores[best].error is not None:
            break
        # a step that does not raise the cosine is still taken: gains often come only once a whole
        # stage is in float (its Q/DQ pairs all gone); the final choice is made on the path below
        result.steps.append({"action": "add", "tried": len(trials), "node": best, "score": scores[best].to_json()})
        current = current + [best]
        current_score = scores[best]
        path.append((current, current_score))
        say(f"+ {best} -> {describe_score(current_score)} ({len(current)}/{cap})")
    if current_score.meets(metric, target):
        current, current_score = _prune(score_set, current, current_score, metric, target, result.steps, say)
    else:
        # best effort: the best budget figure on the way, with the fewest nodes -- never nodes in
        # float that did not improve the figure the budget is on by more than its noise
        current, current_score = max(path, key=lambda state: (state[1].value(metric), -len(state[0])))
        gain = current_score.value(metric) - baseline.value(metric)
        if current and not gain >= min_gain - 1e-12:
            result.steps.append({"action": "keep_none", "node": None, "score": current_score.to_json(),
                                 "gain": round(gain, 6), "min_gain": round(min_gain, 6)})
            say(f"best set ({len(current)} nodes) gains {gain:+.4f} {metric}, less than {min_gain:.4f}: none kept")
            current, current_score = [], baseline
    result.chosen, result.final = list(current), current_score
    result.met = current_score.meets(metric, target)
    return result


def significant_gain(metric: str, samples: int) -> float:
    """The least rise of ``metric`` over all-INT8 worth float nodes when the budget cannot be met.

    Top-1 agreement moves in steps of one sample: two samples more must agree. One flip is within
    the noise of any evaluation set (ResNet-18: a 3-node set gained one of 64 photos on the samples it
    was chosen on and lost six of 32 held out, at half the INT8 speed). The cosine moves smoothly: any
    rise counts.
    """
    if metric == "top1_agreement" and samples > 0:
        return 2.0 / samples
    return 0.0


def _prune(score_set, current: list[str], score: Score, metric: str, target: float, steps: list[dict],
           say: Callable[[str], None]) -> tuple[list[str], Score]:
    """Drop every node whose removal still meets the budget (earliest choices first)."""
    for node in list(current):
        if len(current) == 1:
            break
        rest = [n for n in current if n != node]
        trial = score_set(rest)
        dropped = trial.meets(metric, target)
        steps.append({"action": "drop", "node": node, "score": trial.to_json(), "accepted": dropped})
        if dropped:
            current, score = rest, trial
            say(f"- {node}: not needed ({describe_score(trial)})")
    return current, score


def _key(score: Score, metric: str) -> tuple:
    """Order of preference: higher cosine, then the budget's figure (module doc)."""
    if score.error is not None:
        return (-math.inf, -math.inf)
    return (score.cosine, score.value(metric))


def _step_trials(current: Sequence[str], order: Sequence[str], neighbours: Mapping[str, Sequence[str]], beam: int,
                 max_neighbours: int) -> list[str]:
    """The nodes one greedy step tries: the best remaining by leave-one-out, plus neighbours of the set."""
    chosen = set(current)
    trials = [node for node in order if node not in chosen][:beam]
    near: list[str] = []
    for node in reversed(current):  # neighbours of the most recent choices first
        near += [n for n in neighbours.get(node, ()) if n not in chosen and n not in trials and n not in near]
    return trials + near[:max_neighbours]


def describe_score(score: Score) -> str:
    """A short human-readable form of a score."""
    if score.error is not None:
        return f"failed ({score.error})"
    agreement = "" if score.top1_agreement is None else f"top-1 agreement {score.top1_agreement:.3f}, "
    return f"{agreement}cosine {score.cosine:.4f}"


def adjacent_nodes(model: onnx.ModelProto, names: Sequence[str], hops: int = 2) -> dict[str, list[str]]:
    """Node -> the nodes of ``names`` it connects to through at most ``hops - 1`` other nodes (either way).

    Other nodes are those not in ``names`` (ReLU, HardSigmoid, Flatten ...): a Conv followed by a
    ReLU and the next Conv are neighbours. Nearest first, then graph order.
    """
    wanted = set(names)
    producer = {out: node for node in model.graph.node for out in node.output if out}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for tensor in node.input:
            if tensor:
                readers.setdefault(tensor, []).append(node)
    order = {node.name: index for index, node in enumerate(model.graph.node)}
    by_name = {node.name: node for node in model.graph.node}
    result: dict[str, list[str]] = {}
    for name in names:
        found: dict[str, int] = {}
        frontier = [by_name[name]] if name in by_name else []
        for distance in range(1, hops + 1):
            following = []
            for node in frontier:
                linked = [r for out in node.output for r in readers.get(out, [])]
                linked += [producer[t] for t in node.input if t in producer]
                for other in linked:
                    if other.name == name or other.name in found:
                        continue
                    if other.name in wanted:
                        found[other.name] = distance
                    else:
                        following.append(other)
            frontier = following
        result[name] = sorted(found, key=lambda n: (found[n], order.get(n, 0)))
    return result


def _session(model: onnx.ModelProto, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 4  # a refused candidate is reported as a result, not as ORT log noise
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
