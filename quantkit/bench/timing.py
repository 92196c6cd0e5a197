"""Latency and throughput measured the way trtexec does, with repeats to expose noise.

One *run* of a runner at one batch size (:func:`time_runner`):

1. warm-up: infer until at least ``warmup_ms`` have passed (at least one call,
   because a first call allocates and is never representative);
2. timed phase: infer until at least ``min_iterations`` calls were made **and**
   at least ``duration_s`` seconds have passed;
3. latency of each call = the runner's :meth:`~quantkit.backends.base.Runner.last_inference_time`;
   throughput = batch size x calls / wall time of the timed phase (first start to last end),
   like trtexec's "Throughput" over "Total Host Walltime".

:func:`benchmark` repeats runs ``repeats`` times. Within a repeat, every batch
size runs the FP32 reference and the INT8 model back to back, the order flipping
on every repeat (ABBA), so slow drift - thermal throttling, a neighbour's job -
hits both equally. Each repeat gives one throughput per model and one paired
INT8/FP32 ratio; the median, min and max over repeats are reported, so a noisy
machine shows as a wide spread instead of a false result.

Percentiles follow trtexec exactly (TensorRT ``samples/common/sampleReporting.cpp``,
``findPercentile`` and ``findMedian``), see :func:`trtexec_percentile`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from quantkit.backends.base import Runner

PERCENTILES = (90, 95, 99)  # trtexec's default --percentile list; p50 is its median
NOISE_THRESHOLD = 0.10  # (max - min) / median of throughput over repeats above this: flagged noisy


def trtexec_percentile(sorted_values: Sequence[float], percentile: float) -> float:
    """The ``percentile``-th percentile as trtexec computes it (nearest rank, from the top).

    With ``n`` values sorted ascending::

        exclude = int((1 - percentile / 100) * n)      # evaluated in float32, truncated
        value   = sorted_values[max(n - 1 - exclude, 0)]

    trtexec's ``percentile`` is a C++ ``float``, so the expression is evaluated in
    single precision; we do the same with numpy float32 because it changes results
    at round sizes. For the values 1..100, p99 is 100 (float32:
    ``exclude = int(0.99999905) = 0``) and p90 is 90 (``int(10.000002) = 10``);
    double precision would give 99 and 91. For 1..10, p90 is 9, not 10.

    Args:
        sorted_values: ascending values (not checked).
        percentile: in [0, 100].

    Returns:
        The value; ``inf`` for an empty sequence (as trtexec).

    Raises:
        ValueError: percentile outside [0, 100].
    """
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    count = len(sorted_values)
    if count == 0:
        return math.inf
    p = np.float32(percentile)
    exclude = int((np.float32(1) - p / np.float32(100)) * np.float32(count))
    return float(sorted_values[max(count - 1 - exclude, 0)])


def trtexec_median(sorted_values: Sequence[float]) -> float:
    """trtexec's median: the middle value, or the mean of the two middle values for an even count."""
    count = len(sorted_values)
    if count == 0:
        return math.inf
    middle = count // 2
    if count % 2:
        return float(sorted_values[middle])
    return (float(sorted_values[middle - 1]) + float(sorted_values[middle])) / 2


@dataclass(frozen=True)
class LatencyStats:
    """Latency summary in milliseconds; ``cv_pct`` is the coefficient of variation (std / mean, %)."""

    count: int
    mean: float
    min: float
    max: float
    p50: float
    p90: float
    p95: float
    p99: float
    cv_pct: float

    @classmethod
    def from_ms(cls, latencies_ms: Sequence[float]) -> "LatencyStats":
        """Summarise latencies (ms). p50 is trtexec's median; p90/p95/p99 its percentiles."""
        if not latencies_ms:
            raise ValueError("no latencies to summarise")
        ordered = sorted(float(v) for v in latencies_ms)
        mean = math.fsum(ordered) / len(ordered)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in ordered) / len(ordered))
        return cls(
            count=len(ordered), mean=mean, min=ordered[0], max=ordered[-1],
            p50=trtexec_median(ordered),
            p90=trtexec_percentile(ordered, 90), p95=trtexec_percentile(ordered, 95),
            p99=trtexec_percentile(ordered, 99),
            cv_pct=(std / mean * 100) if mean > 0 else 0.0,
        )

    def to_json(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in ("mean", "min", "max", "p50", "p90", "p95", "p99", "cv_pct")}


@dataclass(frozen=True)
class Spread:
    """Median, min and max of one figure over repeats."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise ValueError("no values")
        return cls(float(statistics.median(values)), float(min(values)), float(max(values)))

    @property
    def relative_width(self) -> float:
        """(max - min) / median: 0 for identical repeats."""
        return (self.max - self.min) / self.median if self.median else math.inf

    def to_json(self) -> dict[str, float]:
        return {"median": self.median, "min": self.min, "max": self.max}


@dataclass(frozen=True)
class TimingSettings:
    """How long to measure (see the module doc). Defaults are trtexec's."""

    warmup_ms: float = 200
    duration_s: float = 3.0
    min_iterations: int = 10

    def __post_init__(self) -> None:
        if self.warmup_ms < 0 or self.duration_s < 0 or self.min_iterations < 1:
            raise ValueError(f"invalid timing settings {self}")


@dataclass
class TimingRun:
    """One measured run of one runner at one batch size."""

    batch_size: int
    iterations: int
    warmup_iterations: int
    warmup_s: float
    wall_s: float
    latencies_ms: list[float] = field(repr=False)

    @property
    def throughput(self) -> float:
        """Items per second over the timed phase's wall time."""
        return self.batch_size * self.iterations / self.wall_s if self.wall_s > 0 else math.inf

    @property
    def latency(self) -> LatencyStats:
        return LatencyStats.from_ms(self.latencies_ms)

    def to_json(self) -> dict:
        return {
            "iterations": self.iterations,
            "warmup_iterations": self.warmup_iterations,
            "warmup_s": self.warmup_s,
            "wall_s": self.wall_s,
            "throughput": self.throughput,
            "latency_ms": self.latency.to_json(),
        }


def time_runner(runner: Runner, feed: Mapping[str, np.ndarray], batch_size: int, settings: TimingSettings,
                clock: Callable[[], float] = time.perf_counter) -> TimingRun:
    """Warm up, then time ``runner`` on ``feed`` (see the module doc).

    Args:
        runner: an active runner.
        feed: one batch of ``batch_size`` items.
        batch_size: items per call (for throughput).
        settings: warm-up, duration and minimum iterations.
        clock: seconds, monotonic (injectable for tests).

    Returns:
        The run, with every timed call's latency.
    """
    start = clock()
    warmups = 0
    while True:
        runner.infer(feed, check_inputs=warmups == 0)
        warmups += 1
        now = clock()
        if (now - start) * 1000 >= settings.warmup_ms:
            break
    warmup_s = now - start
    latencies: list[float] = []
    begin = clock()
    while True:
        runner.infer(feed, check_inputs=False)
        seconds = runner.last_inference_time()
        latencies.append(seconds * 1000 if seconds is not None else math.nan)
        now = clock()
        if len(latencies) >= settings.min_iterations and now - begin >= settings.duration_s:
            break
    return TimingRun(batch_size, len(latencies), warmups, warmup_s, now - begin, latencies)


@dataclass
class VariantTiming:
    """All repeats of one model (``fp32`` or ``int8``) at one batch size."""

    runs: list[TimingRun] = field(default_factory=list)

    @property
    def latency(self) -> LatencyStats:
        """Latency over every timed call of every repeat."""
        return LatencyStats.from_ms([ms for run in self.runs for ms in run.latencies_ms])

    @property
    def throughput(self) -> Spread:
        return Spread.of([run.throughput for run in self.runs])

    @property
    def iterations(self) -> int:
        return sum(run.iterations for run in self.runs)

    def to_json(self) -> dict:
        return {
            "iterations": self.iterations,
            "latency_ms": self.latency.to_json(),
            "throughput": self.throughput.to_json(),
            "repeats": [run.to_json() for run in self.runs],
        }


@dataclass
class BatchTiming:
    """FP32 and INT8 timings at one batch size."""

    batch_size: int
    variants: dict[str, VariantTiming] = field(default_factory=dict)

    def speedup(self, candidate: str = "int8", reference: str = "fp32") -> Spread:
        """Paired throughput ratio per repeat (candidate / reference in the same repeat)."""
        pairs = zip(self.variants[candidate].runs, self.variants[reference].runs)
        return Spread.of([c.throughput / r.throughput for c, r in pairs])

    @property
    def noisy(self) -> bool:
        """True when any model's throughput varied by more than NOISE_THRESHOLD over repeats."""
        return any(v.throughput.relative_width > NOISE_THRESHOLD for v in self.variants.values())

    def to_json(self) -> dict:
        payload = {"batch_size": self.batch_size, "noisy": self.noisy}
        payload.update({name: variant.to_json() for name, variant in self.variants.items()})
        if {"fp32", "int8"} <= set(self.variants):
            payload["speedup"] = self.speedup().to_json()
        return payload


def benchmark(runners: Mapping[str, Runner], feeds: Mapping[int, Mapping[str, np.ndarray]],
              settings: TimingSettings, repeats: int,
              on_run: Callable[[str, int, TimingRun], None] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> list[BatchTiming]:
    """Time every runner at every batch size, ``repeats`` times, interleaved.

    Args:
        runners: name -> active runner, in the order of the first repeat (e.g. fp32, int8).
        feeds: batch size -> feed of that many items.
        settings: per-run warm-up, duration and minimum iterations.
        repeats: how many times to repeat everything (>= 1).
        on_run: called after each run (name, batch size, run), e.g. to advance a progress bar.
        clock: injectable for tests.

    Returns:
        One :class:`BatchTiming` per batch size, in the order of ``feeds``.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    results = {size: BatchTiming(size, {name: VariantTiming() for name in runners}) for size in feeds}
    order = list(runners)
    for repeat in range(repeats):
        names = order if repeat % 2 == 0 else order[::-1]  # ABBA: drift hits every model alike
        for size, feed in feeds.items():
            for name in names:
                run = time_runner(runners[name], feed, size, settings, clock)
                results[size].variants[name].runs.append(run)
                if on_run is not None:
                    on_run(name, size, run)
    return list(results.values())
