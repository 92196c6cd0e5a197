"""Timing: trtexec's percentile definition, the warm-up/duration loop, interleaved repeats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantkit.backends.base import Runner, TensorSpec
from quantkit.bench.timing import (LatencyStats, Spread, TimingSettings, benchmark, time_runner, trtexec_median,
                                   trtexec_percentile)

ONE_TO_100 = [float(v) for v in range(1, 101)]
ONE_TO_10 = [float(v) for v in range(1, 11)]


# Expected values worked out by hand from TensorRT samples/common/sampleReporting.cpp:
#   exclude = int((1 - p/100) * n) in float32;  value = sorted[max(n - 1 - exclude, 0)]
@pytest.mark.parametrize("values, percentile, expected", [
    # n=100, p99: 0.99f = 0.99000001; 1 - 0.99f = 0.0099999905; *100 = 0.99999905 -> 0 -> index 99
    (ONE_TO_100, 99, 100.0),
    # n=100, p95: 1 - 0.95f = 0.050000012; *100 = 5.0000012 -> 5 -> index 94
    (ONE_TO_100, 95, 95.0),
    # n=100, p90: 1 - 0.9f = 0.10000002; *100 = 10.000002 -> 10 -> index 89 (double math would give 91)
    (ONE_TO_100, 90, 90.0),
    # n=100, p50: 0.5 * 100 = 50 -> index 49
    (ONE_TO_100, 50, 50.0),
    # n=10, p90: 1.0000002 -> 1 -> index 8 (double math: 0.99999999 -> 0 -> index 9 = 10)
    (ONE_TO_10, 90, 9.0),
    # n=10, p99: 0.099999905 -> 0 -> the maximum
    (ONE_TO_10, 99, 10.0),
    # p0 excludes everything: index clamps to 0
    (ONE_TO_10, 0, 1.0),
    (ONE_TO_10, 100, 10.0),
    ([7.0], 99, 7.0),
])
def test_percentile_matches_trtexec(values, percentile, expected):
    assert trtexec_percentile(values, percentile) == expected


def test_percentile_edge_cases():
    assert trtexec_percentile([], 99) == math.inf
    with pytest.raises(ValueError):
        trtexec_percentile([1.0], 101)


def test_median_is_trtexec_median():
    assert trtexec_median([1.0, 2.0, 3.0]) == 2.0
    assert trtexec_median([1.0, 2.0, 3.0, 10.0]) == 2.5  # mean of the two middle values
    assert trtexec_median(ONE_TO_100) == 50.5
    assert trtexec_median([]) == math.inf


def test_latency_stats_on_known_values():
    stats = LatencyStats.from_ms([4.0, 1.0, 3.0, 2.0])  # unsorted on purpose
    assert (stats.count, stats.min, stats.max, stats.mean, stats.p50) == (4, 1.0, 4.0, 2.5, 2.5)
    assert stats.p99 == 4.0 and stats.p90 == 4.0 and stats.p95 == 4.0
    assert stats.cv_pct == pytest.approx(math.sqrt(1.25) / 2.5 * 100)


def test_spread_relative_width():
    spread = Spread.of([90.0, 100.0, 120.0])
    assert (spread.median, spread.min, spread.max) == (100.0, 90.0, 120.0)
    assert spread.relative_width == pytest.approx(0.3)


class FakeRunner(Runner):
    """Each infer advances a fake clock by ``step`` seconds and reports that as its time."""

    def __init__(self, name, clock, step, log):
        super().__init__(name)
        self.clock, self.step, self.log = clock, step, log

    def _activate_impl(self):
        pass

    def _deactivate_impl(self):
        pass

    def _input_specs_impl(self):
        return [TensorSpec("x", ("batch", 2), np.dtype(np.float32))]

    def _output_names_impl(self):
        return ["y"]

    def _infer_impl(self, feed):
        self.clock.now += self.step
        self._report_inference_time(self.step)
        self.log.append(self.name)
        return {"y": feed["x"]}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_runner_warms_up_then_meets_iterations_and_duration():
    clock, log = FakeClock(), []
    feed = {"x": np.zeros((4, 2), np.float32)}
    with FakeRunner("a", clock, 0.01, log) as runner:
        run = time_runner(runner, feed, 4, TimingSettings(warmup_ms=50, duration_s=0.2, min_iterations=3), clock)
    assert run.warmup_iterations == 5 and run.warmup_s >= 0.05
    assert run.iterations == 20 and run.wall_s == pytest.approx(0.2)  # duration dominates
    assert run.throughput == pytest.approx(4 * 20 / 0.2)
    assert run.latency.p50 == pytest.approx(10.0)  # ms, from last_inference_time()


def test_time_runner_min_iterations_dominates_and_one_warmup_at_zero():
    clock, log = FakeClock(), []
    with FakeRunner("a", clock, 0.5, log) as runner:
        run = time_runner(runner, {"x": np.zeros((1, 2), np.float32)}, 1,
                          TimingSettings(warmup_ms=0, duration_s=0.1, min_iterations=4), clock)
    assert run.warmup_iterations == 1 and run.iterations == 4


def test_benchmark_interleaves_models_abba_and_pairs_speedups():
    clock, log = FakeClock(), []
    runners = {"fp32": FakeRunner("fp32", clock, 0.02, log), "int8": FakeRunner("int8", clock, 0.01, log)}
    feeds = {1: {"x": np.zeros((1, 2), np.float32)}, 2: {"x": np.zeros((2, 2), np.float32)}}
    settings = TimingSettings(warmup_ms=0, duration_s=0, min_iterations=2)
    seen = []
    for runner in runners.values():
        runner.activate()
    rows = benchmark(runners, feeds, settings, repeats=2, on_run=lambda n, b, r: seen.append((n, b)), clock=clock)
    assert seen == [("fp32", 1), ("int8", 1), ("fp32", 2), ("int8", 2),   # repeat 1: A B
                    ("int8", 1), ("fp32", 1), ("int8", 2), ("fp32", 2)]   # repeat 2: B A
    assert [row.batch_size for row in rows] == [1, 2]
    speedup = rows[0].speedup()
    assert speedup.median == pytest.approx(2.0) and speedup.min == pytest.approx(2.0)
    assert not rows[0].noisy
    payload = rows[1].to_json()
    assert set(payload) == {"batch_size", "noisy", "fp32", "int8", "speedup"}
    assert len(payload["int8"]["repeats"]) == 2
