"""Gates and baseline comparison, both evaluated on a bench.json payload.

Working on the JSON payload (not on in-memory objects) means the same code
judges a fresh run and an old ``bench.json``, and what CI sees in the file is
exactly what was gated.

Gate values (see :data:`quantkit.gates.GATE_METRICS` for the names):

* ``speedup``: per batch size, the median over repeats of INT8/FP32 throughput
  measured in the same repeat; without ``@N`` the lowest over batch sizes.
* ``p99_ms``: INT8 p99 latency over all repeats; without ``@N`` the highest.
* ``cosine``/``snr_db``: the lowest over outputs; ``max_abs_err``/``mean_abs_err``:
  the highest; ``top1_agreement``: the lowest over [N, C] outputs.
* ``top1``/``top5``: INT8 accuracy in percent; ``*_drop``: FP32 minus INT8, in points.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from quantkit.errors import UsageError
from quantkit.gates import Gate, parse_gate

# --compare: metric -> (higher is better, relative tolerance?, default tolerance)
PERF_TOLERANCE = 0.10  # relative: 10 %
ACCURACY_TOLERANCES = {"top1": 0.5, "top5": 0.5, "top1_agreement": 0.005, "cosine": 0.001}  # absolute


def parse_cli_gates(texts: Iterable[str | Gate]) -> list[Gate]:
    """Parse gate expressions given on the command line.

    Raises:
        UsageError: (exit 2) with parse_gate's reason.
    """
    gates = []
    for text in texts:
        if isinstance(text, Gate):
            gates.append(text)
            continue
        try:
            gates.append(parse_gate(text))
        except ValueError as exc:
            raise UsageError(f"--gate: {exc}") from None
    return gates


def check_gate_batches(gates: Sequence[Gate], batch_sizes: Sequence[int]) -> None:
    """A ``metric@N`` gate needs N among the measured batch sizes.

    Raises:
        UsageError: naming the gate and the measured sizes.
    """
    for gate in gates:
        if gate.batch_size is not None and gate.batch_size not in batch_sizes:
            raise UsageError(f"gate {gate.text!r} names batch size {gate.batch_size}, but the bench measures "
                             f"{list(batch_sizes)}; add it to bench.batch_sizes or --batch-sizes")


def _to_float(value: Any) -> float | None:
    """JSON number or the strings 'inf'/'-inf'/'nan' -> float; None stays None."""
    if value is None:
        return None
    return float(value)


def metric_value(payload: Mapping[str, Any], gate: Gate) -> tuple[float | None, str]:
    """The value a gate is checked against, or (None, why it is not available)."""
    metric = gate.metric
    if metric in ("speedup", "p99_ms"):
        timing = payload.get("timing") or []
        rows = [row for row in timing if gate.batch_size in (None, row["batch_size"])]
        if not rows:
            return None, "no timing for that batch size"
        if metric == "speedup":
            values = [_to_float(row["speedup"]["median"]) for row in rows]
            return min(values), ""
        return max(_to_float(row["int8"]["latency_ms"]["p99"]) for row in rows), ""
    accuracy = payload.get("accuracy") or {}
    if metric in ("top1", "top5", "top1_drop", "top5_drop"):
        labels = accuracy.get("labels")
        if not labels:
            return None, "no accuracy against labels (no labels in the data, or no [N, C] output)"
        value = labels["int8"][metric] if metric in ("top1", "top5") else labels[metric]
        if value is None:
            return None, "top-5 needs more than 5 classes"
        return _to_float(value), ""
    outputs = accuracy.get("outputs") or []
    if not outputs:
        return None, "no outputs compared"
    if metric == "top1_agreement":
        values = [_to_float(o["top1_agreement"]) for o in outputs if o.get("top1_agreement") is not None]
        if not values:
            return None, "no output is shaped [N, C]"
        return min(values), ""
    values = [_to_float(o[metric]) for o in outputs]
    pick = min if metric in ("cosine", "snr_db") else max
    if any(math.isnan(v) for v in values):
        return math.nan, ""
    return pick(values), ""


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float | None
    passed: bool
    detail: str = ""

    def to_json(self) -> dict:
        return {
            "expr": self.gate.text,
            "metric": self.gate.metric,
            "op": self.gate.op,
            "threshold": self.gate.threshold,
            "batch_size": self.gate.batch_size,
            "value": self.value,
            "passed": self.passed,
            "detail": self.detail,
        }

    def line(self) -> str:
        mark = "PASS" if self.passed else "FAIL"
        value = "n/a" if self.value is None else format_number(self.value)
        extra = f" ({self.detail})" if self.detail else ""
        return f"{mark}  {self.gate.text}  (value {value}){extra}"


def evaluate_gates(gates: Sequence[Gate], payload: Mapping[str, Any]) -> list[GateResult]:
    """Check each gate against the payload; an unavailable or NaN value fails the gate."""
    results = []
    for gate in gates:
        value, why = metric_value(payload, gate)
        if value is None:
            results.append(GateResult(gate, None, False, f"not available: {why}"))
        elif math.isnan(value):
            results.append(GateResult(gate, value, False, "value is NaN"))
        else:
            results.append(GateResult(gate, value, gate.check(value)))
    return results


def format_number(value: float) -> str:
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


# --------------------------------------------------------------------------- --compare


@dataclass(frozen=True)
class CompareItem:
    """One metric, old vs new. ``status``: ok, improved, regressed, noisy (worse beyond the
    tolerance, but the repeat spreads overlap, so not counted) or missing."""

    metric: str
    batch_size: int | None
    old: float | None
    new: float | None
    change: float | None  # relative for timing figures, absolute otherwise
    relative: bool
    status: str

    def to_json(self) -> dict:
        return dict(vars(self))

    def line(self) -> str:
        where = f"@{self.batch_size}" if self.batch_size is not None else ""
        if self.change is None:
            return f"{self.status.upper():9} {self.metric}{where}: old {self.old}, new {self.new}"
        change = f"{self.change * 100:+.1f}%" if self.relative else f"{self.change:+.4g}"
        return (f"{self.status.upper():9} {self.metric}{where}: {format_number(self.old)} -> "
                f"{format_number(self.new)} ({change})")


@dataclass
class Comparison:
    baseline: str
    tolerance: float
    items: list[CompareItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[CompareItem]:
        return [item for item in self.items if item.status == "regressed"]

    def to_json(self) -> dict:
        return {"baseline": self.baseline, "tolerance": self.tolerance, "items": [i.to_json() for i in self.items],
                "regressions": len(self.regressions), "notes": list(self.notes)}


def load_baseline(path: str | Path) -> dict:
    """Read and check an old bench.json for ``--compare``.

    Raises:
        UsageError: missing, unreadable, not a bench.json, or a newer schema.
    """
    from quantkit.bench.report import SCHEMA_NAME, SCHEMA_VERSION, validate_payload

    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--compare: cannot read {path} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UsageError(f"--compare: {path} is not JSON ({exc})") from None
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA_NAME:
        raise UsageError(f"--compare: {path} is not a quantkit bench.json (no \"schema\": \"{SCHEMA_NAME}\")")
    version = payload.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UsageError(f"--compare: {path} has schema_version {version!r}; this quantkit reads up to "
                         f"{SCHEMA_VERSION}")
    problems = validate_payload(payload)
    if problems:
        raise UsageError(f"--compare: {path} does not match the bench.json schema: {problems[0]}"
                         + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return payload


def compare_payloads(new: Mapping[str, Any], old: Mapping[str, Any], *, baseline: str = "",
                     tolerance: float = PERF_TOLERANCE) -> Comparison:
    """Compare a run with a baseline run.

    Timing figures (INT8 throughput, speedup, INT8 p99 latency; per batch size
    measured in both) regress when worse by more than ``tolerance`` (relative)
    *and* the two runs' ranges over repeats do not overlap; with overlapping
    ranges the change is within the machine's noise and marked ``noisy``.
    Accuracy figures (INT8 top-1/top-5 in points, lowest top-1 agreement and
    cosine) regress when worse by more than :data:`ACCURACY_TOLERANCES` (absolute).
    """
    comparison = Comparison(baseline, tolerance)
    comparison.notes += _comparability_notes(new, old)
    old_rows = {row["batch_size"]: row for row in old.get("timing", [])}
    for row in new.get("timing", []):
        size = row["batch_size"]
        if size not in old_rows:
            comparison.notes.append(f"batch size {size} is not in the baseline")
            continue
        before = old_rows[size]
        comparison.items += [
            _timing_item("throughput", size, _repeat_values(before["int8"], "throughput"),
                         _repeat_values(row["int8"], "throughput"), True, tolerance),
            _timing_item("speedup", size, _speedups(before), _speedups(row), True, tolerance),
            _timing_item("p99_ms", size, _repeat_values(before["int8"], "p99"),
                         _repeat_values(row["int8"], "p99"), False, tolerance),
        ]
    for metric, tol in ACCURACY_TOLERANCES.items():
        gate = Gate(metric, ">=", 0.0)
        old_value, _ = metric_value(old, gate)
        new_value, _ = metric_value(new, gate)
        if old_value is None and new_value is None:
            continue
        comparison.items.append(_accuracy_item(metric, old_value, new_value, tol))
    return comparison


def _comparability_notes(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    notes = []
    checks = [
        ("model", lambda p: p.get("model", {}).get("name")),
        ("backend", lambda p: p.get("backend")),
        ("CPU", lambda p: p.get("environment", {}).get("cpu", {}).get("model")),
        ("threads", lambda p: p.get("settings", {}).get("threads")),
    ]
    for what, get in checks:
        if get(new) != get(old):
            notes.append(f"{what} differs from the baseline ({get(old)!r} -> {get(new)!r}): "
                         "timings may not be comparable")
    return notes


def _repeat_values(variant: Mapping[str, Any], key: str) -> list[float]:
    if key == "throughput":
        return [float(r["throughput"]) for r in variant["repeats"]]
    return [float(r["latency_ms"][key]) for r in variant["repeats"]]


def _speedups(row: Mapping[str, Any]) -> list[float]:
    return [i["throughput"] / f["throughput"] for i, f in zip(row["int8"]["repeats"], row["fp32"]["repeats"])]


def _timing_item(metric: str, size: int, old: list[float], new: list[float], higher_better: bool,
                 tolerance: float) -> CompareItem:
    import statistics

    old_mid, new_mid = statistics.median(old), statistics.median(new)
    change = (new_mid - old_mid) / old_mid if old_mid else math.inf
    worse = -change if higher_better else change
    if worse > tolerance:
        overlap = min(old) <= max(new) if higher_better else min(new) <= max(old)
        status = "noisy" if overlap else "regressed"
    elif worse < -tolerance:
        status = "improved"
    else:
        status = "ok"
    return CompareItem(metric, size, old_mid, new_mid, change, True, status)


def _accuracy_item(metric: str, old: float | None, new: float | None, tolerance: float) -> CompareItem:
    if old is None or new is None:
        return CompareItem(metric, None, old, new, None, False, "missing")
    change = new - old
    if math.isnan(new) or change < -tolerance:
        status = "regressed"
    elif change > tolerance:
        status = "improved"
    else:
        status = "ok"
    return CompareItem(metric, None, old, new, change, False, status)
