"""``quantkit bench``: FP32 vs INT8 latency, throughput and accuracy, gates and reports.

Modules: :mod:`~quantkit.bench.timing` (trtexec-style measurement),
:mod:`~quantkit.bench.accuracy` (output and label metrics),
:mod:`~quantkit.bench.gates` (gates and ``--compare``),
:mod:`~quantkit.bench.report` (bench.json schema, bench.md, terminal table) and
:mod:`~quantkit.bench.stage` (the stage function the CLI calls).
"""

from quantkit.bench.stage import MANIFEST, BenchResult, bench_fingerprint, describe, run_bench

__all__ = ["MANIFEST", "BenchResult", "bench_fingerprint", "describe", "run_bench"]
