"""The ONNX Runtime (CPU) INT8 build: the CPU Q/DQ flavour plus a speed guard.

The guard times FP32 against INT8 in ONNX Runtime during the build (2 threads,
ORT_ENABLE_ALL, at ``build.profile.opt`` and ``build.profile.min``, interleaved, medians) and,
where INT8 does not clearly pay at every one of those batch sizes (slowest ratio below
:data:`SEARCH_BELOW`), tries keeping resolution stages on the input side in float
(:func:`quantkit.qdq.placement.input_side_regions`) -- on CPU the first stages (few channels,
full resolution, the first Q on the biggest tensor, a layout change) are where INT8 pays least.
The candidate with the best slowest-batch speedup wins if it beats the all-INT8 model by
:data:`MIN_GAIN`; its nodes become *automatic* fallbacks. A later build with the same
fingerprint reuses that choice instead of searching again. If the result is still slower than
FP32 at some batch size the build says so.

Sessions run with ONNX Runtime's defaults (worker threads spin while waiting for work, as in
deployment and in ``quantkit bench``). With two sessions alive on a 2-core machine the session
timed last keeps spinning for a moment and steals cores from the next one, so fast models are
timed in short blocks whose first runs are not counted (:func:`compare_many`). Turning spinning
off instead was tried and rejected: it is stable but biased -- it costs small models a thread
wake-up per op (digits CNN: INT8 0.98x FP32 without spinning, 1.65x with it).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx

from quantkit.qdq import TensorRange
from quantkit.qdq.cpu import write_cpu_qdq
from quantkit.qdq.placement import input_side_regions
from quantkit.ui import Console

#: Seconds of interleaved timing per comparison (at least 3 rounds are run regardless).
GUARD_BUDGET_S = 0.5
#: Models slower than this are timed one run at a time; faster ones in blocks of about BLOCK_S.
SINGLE_RUN_S = 0.1
BLOCK_S = 0.1
#: Runs at the start of a block that are not counted (the previous session's threads still spin).
BLOCK_DROP = 2
#: Float regions are only tried when INT8 does not clearly pay at every timed batch size (slowest
#: INT8/FP32 ratio below this). The search decides by timing; a clear win rarely flips between runs
#: and the choice is reused by later builds with the same fingerprint (see ``reuse``), so builds
#: stay byte-reproducible in a workdir.
SEARCH_BELOW = 1.25
#: A float region is kept only if it makes the slowest batch size at least this much faster. A clear
#: margin: on this shared host a region worth 1.05-1.10x (the digits CNN's stem) flipped between
#: builds, MobileNetV3-Small's stem + first block (1.2-1.3x) did not.
MIN_GAIN = 1.15
#: Rounds (one block per session each) the float-region search times at least, per batch size: with 3
#: candidates, FP32 and the all-INT8 model a round is ~0.5 s, and a median over fewer rounds let one
#: noisy burst on this shared host pick the wrong candidate.
SEARCH_ROUNDS = 7
#: Candidates whose slowest-batch speedups lie within this fraction of the best are tied; the geometric
#: mean over the batch sizes breaks the tie (see ``_best_candidate``).
TIE = 0.05
#: Ops in ORT's optimized graph that are integer kernels (what the Q/DQ pairs fused into).
_FUSED_PREFIXES = ("QLinear",)
_FUSED_OPS = ("QGemm", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention", "ConvInteger",
              "MatMulInteger", "NhwcMaxPool")


@dataclass(frozen=True)
class Timing:
    """FP32 against INT8 in ONNX Runtime, as measured by the guard (first batch size = profile opt)."""

    fp32_ms: float
    int8_ms: float
    speedup: float  # median over pairs of fp32 / int8
    batch: int
    threads: int
    pairs: int
    by_batch: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # batch -> fp32, int8, x
    reused: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"fp32_ms": round(self.fp32_ms, 3), "int8_ms": round(self.int8_ms, 3),
                "speedup": round(self.speedup, 3), "batch": self.batch, "threads": self.threads,
                "pairs": self.pairs, "statistic": "median of interleaved runs",
                "by_batch": {str(b): {"fp32_ms": round(f, 3), "int8_ms": round(i, 3), "speedup": round(x, 3)}
                             for b, (f, i, x) in self.by_batch.items()},
                "region_reused": self.reused}


@dataclass(frozen=True)
class GuardStep:
    """One float region the guard tried."""

    region_end: str
    region_nodes: int
    before_ms: float  # all-INT8 at the first batch size
    after_ms: float  # with the region in float, same batch size
    gain: float  # slowest-batch speedup with the region / without it
    accepted: bool
    speedups: dict[int, float] = field(default_factory=dict)  # batch -> speedup vs FP32 with the region

    def to_json(self) -> dict[str, Any]:
        return {"region_end": self.region_end, "region_nodes": self.region_nodes,
                "before_ms": round(self.before_ms, 3), "after_ms": round(self.after_ms, 3),
                "gain": round(self.gain, 3), "accepted": self.accepted,
                "speedup_vs_fp32": {str(b): round(x, 3) for b, x in self.speedups.items()}}


@dataclass
class CpuArtifact:
    """The CPU flavour as built, with what the guard measured and decided."""

    model: onnx.ModelProto
    quantized: list[str]
    automatic: list[str] = field(default_factory=list)
    timing: Timing | None = None
    steps: list[GuardStep] = field(default_factory=list)
    optimized_ops: dict[str, int] = field(default_factory=dict)

    @property
    def fused_ops(self) -> dict[str, int]:
        return {op: n for op, n in self.optimized_ops.items() if _is_fused(op)}

    @property
    def unfused_qdq(self) -> dict[str, int]:
        return {op: n for op, n in self.optimized_ops.items() if op in ("QuantizeLinear", "DequantizeLinear")}


def build_cpu_artifact(model: onnx.ModelProto, ranges: Mapping[str, TensorRange], nodes: Sequence[str],
                       float_nodes: Iterable[str], feeds: Mapping[str, np.ndarray] | None, console: Console, *,
                       threads: int = 2, budget_s: float | None = None, max_regions: int = 3,
                       extra_feeds: Sequence[Mapping[str, np.ndarray]] = (), search: bool = True,
                       reuse: Sequence[str] | None = None) -> CpuArtifact:
    """Write the CPU flavour and run the speed guard.

    Args:
        model: the FP32 model.
        ranges: calibrated ranges.
        nodes: the nodes to quantize (after exclusions).
        float_nodes: nodes excluded by the user (they read float tensors where possible).
        feeds: one batch at ``build.profile.opt`` to time with; None skips the guard.
        console: where the guard reports.
        threads: ORT intra-op threads for timing (2 by default, as in the benchmarks).
        budget_s: time per comparison (default :data:`GUARD_BUDGET_S`).
        max_regions: how many float regions the guard tries at most.
        extra_feeds: batches at other sizes that must not lose either (``build.profile.min``).
        search: look for float regions when INT8 does not clearly pay (False: time and report only,
            ``build.speed_guard: measure``).
        reuse: the nodes an earlier build with the same fingerprint kept in float automatically;
            given, the guard times that placement instead of searching again (reproducible builds).

    Returns:
        The artifact; ``timing`` is None when the guard did not run.
    """
    float_nodes = list(float_nodes)
    budget_s = GUARD_BUDGET_S if budget_s is None else budget_s
    artifact = CpuArtifact(write_cpu_qdq(model, ranges, nodes, float_nodes), list(nodes))
    if feeds is None:
        artifact.optimized_ops = optimized_op_histogram(artifact.model, threads)
        return artifact
    if reuse:
        artifact.model, artifact.quantized, artifact.automatic = _with_float_region(
            model, ranges, nodes, float_nodes, reuse)
        moved = artifact.automatic
        console.info(f"speed guard: {len(moved)} nodes kept in float as by the previous build with the same "
                     "inputs (build.json; delete it to search again)")
    batches = [dict(feeds)] + [dict(extra) for extra in extra_feeds]
    fp32 = _session(model, threads)
    full = _session(artifact.model, threads)
    measured = {_batch_size(f): compare(fp32, full, f, budget_s) for f in batches}
    for batch, (fp32_ms, int8_ms, speedup, _) in measured.items():
        console.info(f"speed guard (ONNX Runtime, {threads} threads, batch {batch}): FP32 {fp32_ms:.2f} ms, "
                     f"INT8 {int8_ms:.2f} ms ({speedup:.2f}x)")
    slowest = min(row[2] for row in measured.values())
    regions = (input_side_regions(model, artifact.quantized, limit=max_regions)
               if search and reuse is None and slowest < SEARCH_BELOW else [])
    if regions:
        chosen = _try_regions(model, ranges, nodes, float_nodes, regions, fp32, full, batches, threads, budget_s,
                              artifact, console)
        if chosen is not None:
            best_model, best_nodes, best_session, moved = chosen
            artifact.model, artifact.quantized, artifact.automatic = best_model, best_nodes, moved
            measured = {_batch_size(f): compare(fp32, best_session, f, budget_s) for f in batches}
            shown = ", ".join(f"batch {b}: {row[2]:.2f}x" for b, row in measured.items())
            console.info(f"speed guard result: {shown}, {len(moved)} nodes kept in float automatically")
    first = _batch_size(batches[0])
    fp32_ms, int8_ms, speedup, pairs = measured[first]
    artifact.timing = Timing(fp32_ms, int8_ms, speedup, first, threads, pairs,
                             {b: (row[0], row[1], row[2]) for b, row in measured.items()}, reused=bool(reuse))
    for batch, (fp32_ms, int8_ms, speedup, _) in measured.items():
        if speedup < 1.0:
            console.warn(f"the INT8 CPU artifact is slower than FP32 at batch {batch} "
                         f"({int8_ms:.2f} ms vs {fp32_ms:.2f} ms, {speedup:.2f}x); it is written anyway, "
                         "see build.json (consider --exclude for the slow layers or the FP32 model)")
    artifact.optimized_ops = optimized_op_histogram(artifact.model, threads)
    return artifact


def _with_float_region(model, ranges, nodes: Sequence[str], float_nodes: list[str], region: Iterable[str]):
    """The CPU flavour with ``region`` moved to float: (model, nodes still quantized, nodes moved)."""
    region_set = set(region)
    kept = [name for name in nodes if name not in region_set]
    moved = [name for name in nodes if name in region_set]
    return write_cpu_qdq(model, ranges, kept, float_nodes + moved), kept, moved


def _batch_size(feeds: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(feeds.values())).shape[0])


def _try_regions(model, ranges, nodes, float_nodes, regions, fp32, full, batches, threads, budget_s, artifact,
                 console):
    """Time every float-prefix candidate against FP32 and the full INT8 model, one round robin per batch size.

    A candidate's score is its speedup over FP32 at the batch size where it gains least; the gains
    of nested prefixes are not monotonic (a boundary inside a stage can cost more than it saves),
    so all candidates are timed and the best one wins if it beats the all-INT8 score by
    :data:`MIN_GAIN`.

    Returns:
        (model, quantized nodes, session, nodes moved to float) of the winner, or None.
    """
    trials = []
    for region in regions:
        trial_model, trial_nodes, moved = _with_float_region(model, ranges, nodes, float_nodes, region)
        trials.append((region[-1], trial_model, trial_nodes, _session(trial_model, threads), moved))
    sessions = [fp32, full] + [t[3] for t in trials]
    per_batch = []  # (batch, medians, speedups vs FP32)
    for feeds in batches:
        medians, speedups, _ = compare_many(sessions, feeds, budget_s * len(trials), min_rounds=SEARCH_ROUNDS)
        per_batch.append((_batch_size(feeds), medians, speedups))
    scores = [min(speedups[index] for _, _, speedups in per_batch) for index in range(len(sessions))]
    best = _best_candidate(scores[2:], [[row[index + 2] for _, _, row in per_batch] for index in range(len(trials))])
    winner = best if scores[best + 2] >= scores[1] * MIN_GAIN else None
    _, medians, _ = per_batch[0]
    for index, (end, _, _, _, moved) in enumerate(trials):
        accepted = index == winner
        gain = scores[index + 2] / scores[1]
        speedups = {batch: speedups[index + 2] for batch, _, speedups in per_batch}
        artifact.steps.append(GuardStep(end, len(moved), medians[1], medians[index + 2], gain, accepted, speedups))
        shown = ", ".join(f"{x:.2f}x" for x in speedups.values())
        console.info(f"  float up to {end!r} ({len(moved)} nodes): {shown} FP32 at batch "
                     f"{', '.join(str(b) for b in speedups)} ({gain:.2f}x the all-INT8 model) - "
                     f"{'chosen' if accepted else 'not chosen'}")
    if winner is None:
        return None
    end, trial_model, trial_nodes, session, moved = trials[winner]
    return trial_model, trial_nodes, session, moved


def _best_candidate(scores: Sequence[float], speedups: Sequence[Sequence[float]]) -> int:
    """Index of the winning candidate: the best slowest-batch speedup, where candidates within
    :data:`TIE` of it count as tied and the geometric mean over all batch sizes decides.

    Slowest-batch scores of neighbouring prefixes often differ by less than the host's noise
    (MobileNetV3 at batch 1: stem + first block 1.12x, up to the third block 1.12-1.13x) while one
    is clearly better at the other batch size (1.32x against 1.18x at batch 32); without the
    tie-break, noise at batch 1 picked the prefix that is slower at 32.
    """
    top = max(scores)
    tied = [index for index, score in enumerate(scores) if score >= top * (1 - TIE)]
    return max(tied, key=lambda index: (math.prod(speedups[index]) ** (1 / len(speedups[index])), -index))


def compare(a, b, feeds: Mapping[str, np.ndarray], budget_s: float, min_rounds: int = 3,
            max_rounds: int = 200) -> tuple[float, float, float, int]:
    """Time two sessions on the same feeds, interleaved (see :func:`compare_many`).

    Returns:
        (median ms of a, median ms of b, median over rounds of a/b, rounds run).
    """
    medians, gains, rounds = compare_many([a, b], feeds, budget_s, min_rounds, max_rounds)
    return medians[0], medians[1], gains[1], rounds


def compare_many(sessions: Sequence, feeds: Mapping[str, np.ndarray], budget_s: float, min_rounds: int = 3,
                 max_rounds: int = 200) -> tuple[list[float], list[float], int]:
    """Time several sessions round-robin, one block of runs each per round, the order rotating.

    A block is one run for models slower than :data:`SINGLE_RUN_S`, else enough runs to last
    about :data:`BLOCK_S`, of which the first :data:`BLOCK_DROP` are not counted: the session
    timed before keeps its worker threads spinning for a moment after its last run, and those
    first runs absorb that. Drift over the comparison hits every session alike.

    Returns:
        (median ms per session, median over rounds of first/other per session (1.0 for the first),
        rounds run).
    """
    feeds = dict(feeds)
    estimate = min(_run_seconds(session, feeds) for session in sessions)  # also the untimed first run
    for session in sessions:
        session.run(None, feeds)
    runs = 1 if estimate >= SINGLE_RUN_S else max(BLOCK_DROP + 1, min(400, math.ceil(BLOCK_S / max(estimate, 1e-6))))
    drop = 0 if runs == 1 else BLOCK_DROP
    times: list[list[float]] = [[] for _ in sessions]
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - start < budget_s):
        shift = rounds % len(sessions)
        order = list(range(len(sessions)))
        for index in order[shift:] + order[:shift]:
            block = [_run_seconds(sessions[index], feeds) * 1e3 for _ in range(runs)]
            times[index].append(statistics.median(block[drop:]))
        rounds += 1
    gains = [statistics.median(a / b for a, b in zip(times[0], column)) for column in times]
    return [statistics.median(column) for column in times], gains, rounds


def _run_seconds(session, feeds: Mapping[str, np.ndarray]) -> float:
    tick = time.perf_counter()
    session.run(None, feeds)
    return time.perf_counter() - tick


def optimized_op_histogram(model: onnx.ModelProto, threads: int = 2) -> dict[str, int]:
    """Op types of the graph ONNX Runtime actually runs (ORT_ENABLE_ALL), most frequent first.

    The optimized model is written to a temporary file only to be counted: it is specific to
    this machine's CPU and never shipped.
    """
    with tempfile.TemporaryDirectory(prefix="quantkit-ort-") as tmp:
        path = Path(tmp) / "optimized.onnx"
        _session(model, threads, optimized_path=path)
        optimized = onnx.load(str(path), load_external_data=False)
    return dict(Counter(node.op_type for node in optimized.graph.node).most_common())


def output_cosine(reference, candidate, feeds: Mapping[str, np.ndarray]) -> float:
    """Mean per-sample cosine similarity of the first output of two models (sessions or ModelProtos)."""
    ref_session = reference if hasattr(reference, "run") else _session(reference, 2)
    cand_session = candidate if hasattr(candidate, "run") else _session(candidate, 2)
    ref = np.asarray(ref_session.run(None, dict(feeds))[0], dtype=np.float64)
    out = np.asarray(cand_session.run(None, dict(feeds))[0], dtype=np.float64)
    ref, out = ref.reshape(len(ref), -1), out.reshape(len(out), -1)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(out, axis=1)
    cosines = np.where(norms > 0, np.sum(ref * out, axis=1) / np.maximum(norms, 1e-30), 1.0)
    return float(np.mean(cosines))


def _session(model: onnx.ModelProto, threads: int, optimized_path: Path | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # the "optimized model is hardware specific" warning is expected
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _is_fused(op: str) -> bool:
    return op.startswith(_FUSED_PREFIXES) or op in _FUSED_OPS
