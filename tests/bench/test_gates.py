"""Gate parsing and evaluation, and --compare regression detection, on hand-made payloads."""

from __future__ import annotations

import math

import pytest

from quantkit.bench.gates import (check_gate_batches, compare_payloads, evaluate_gates, metric_value,
                                  parse_cli_gates)
from quantkit.errors import EXIT_USAGE, UsageError
from quantkit.gates import parse_gate


def _latency(p99):
    return {"mean": 1.0, "min": 0.5, "max": p99, "p50": 1.0, "p90": 1.5, "p95": 1.8, "p99": p99, "cv_pct": 5.0}


def _variant(throughputs, p99s):
    return {
        "iterations": 10 * len(throughputs),
        "latency_ms": _latency(max(p99s)),
        "throughput": {"median": sorted(throughputs)[len(throughputs) // 2], "min": min(throughputs),
                       "max": max(throughputs)},
        "repeats": [{"iterations": 10, "warmup_iterations": 1, "warmup_s": 0.2, "wall_s": 1.0, "throughput": t,
                     "latency_ms": _latency(p)} for t, p in zip(throughputs, p99s)],
    }


def make_payload(int8=(200.0, 204.0, 196.0), fp32=(100.0, 100.0, 100.0), p99=(2.0, 2.1, 2.0), *,
                 batch=8, top1=(90.0, 89.5), cosine=0.999, agreement=0.98, snr="inf"):
    ratios = sorted(i / f for i, f in zip(int8, fp32))
    return {
        "model": {"name": "m"}, "backend": "onnxruntime", "settings": {"threads": 2},
        "environment": {"cpu": {"model": "cpu"}},
        "timing": [{"batch_size": 1, "noisy": False, "fp32": _variant(fp32, p99), "int8": _variant(int8, p99),
                    "speedup": {"median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1]}},
                   {"batch_size": batch, "noisy": False, "fp32": _variant(fp32, p99),
                    "int8": _variant([t * 1.5 for t in int8], [p * 3 for p in p99]),
                    "speedup": {"median": 3.0, "min": 2.9, "max": 3.1}}],
        "accuracy": {
            "samples": 100, "batch_size": 8,
            "outputs": [{"name": "logits", "cosine": cosine, "snr_db": snr, "max_abs_err": 0.5,
                         "mean_abs_err": 0.01, "top1_agreement": agreement},
                        {"name": "features", "cosine": 0.9999, "snr_db": 41.0, "max_abs_err": 0.7,
                         "mean_abs_err": 0.02, "top1_agreement": None}],
            "labels": {"output": "logits", "samples": 100, "fp32": {"top1": top1[0], "top5": 99.0},
                       "int8": {"top1": top1[1], "top5": 98.0}, "top1_drop": top1[0] - top1[1], "top5_drop": 1.0},
        },
    }


# ------------------------------------------------------------------ parsing


def test_cli_gate_that_does_not_parse_is_a_usage_error():
    with pytest.raises(UsageError, match="does not parse") as info:
        parse_cli_gates(["top1_drop <= half"])
    assert info.value.exit_code == EXIT_USAGE == 2


def test_cli_gate_with_unknown_metric_suggests_a_name():
    with pytest.raises(UsageError, match="did you mean 'top1_drop'"):
        parse_cli_gates(["top1_dorp<=0.5"])


def test_gate_batch_must_be_measured():
    gates = parse_cli_gates(["speedup@32>=1.5", "p99_ms<=5"])
    check_gate_batches(gates, [1, 32])
    with pytest.raises(UsageError, match="batch size 32"):
        check_gate_batches(gates, [1, 8])


# ------------------------------------------------------------------ evaluation


@pytest.mark.parametrize("expr, value, passed", [
    ("top1_drop<=0.5", 0.5, True),
    ("top1_drop<0.5", 0.5, False),
    ("top1>=90", 89.5, False),
    ("top5>=98", 98.0, True),
    ("top5_drop<=1", 1.0, True),
    ("cosine>=0.999", 0.999, True),          # lowest over outputs
    ("max_abs_err<=0.6", 0.7, False),         # highest over outputs
    ("mean_abs_err<=0.05", 0.02, True),
    ("snr_db>=40", 41.0, True),               # "inf" (identical) for logits, 41 for features -> 41
    ("top1_agreement>=0.99", 0.98, False),    # only [N, C] outputs count
    ("speedup>=2.5", 2.0, False),             # lowest over batch sizes
    ("speedup@8>=2.5", 3.0, True),
    ("p99_ms<=5", 6.3, False),                # highest over batch sizes
    ("p99_ms@1<=5", 2.1, True),
])
def test_gate_values_and_verdicts(expr, value, passed):
    [result] = evaluate_gates([parse_gate(expr)], make_payload())
    assert result.value == pytest.approx(value)
    assert result.passed is passed
    assert result.to_json()["expr"] == expr


def test_unavailable_or_nan_values_fail_the_gate():
    payload = make_payload()
    payload["accuracy"]["labels"] = None
    [result] = evaluate_gates([parse_gate("top1_drop<=0.5")], payload)
    assert not result.passed and result.value is None and "labels" in result.detail
    payload = make_payload(cosine=math.nan)
    [result] = evaluate_gates([parse_gate("cosine>=0.9")], payload)
    assert not result.passed and "NaN" in result.detail


def test_top5_unavailable_with_few_classes():
    payload = make_payload()
    payload["accuracy"]["labels"]["int8"]["top5"] = None
    value, why = metric_value(payload, parse_gate("top5>=90"))
    assert value is None and "more than 5 classes" in why


# ------------------------------------------------------------------ --compare


def _status(comparison, metric, batch=None):
    return next(i.status for i in comparison.items if i.metric == metric and i.batch_size == batch)


def test_compare_identical_runs_has_no_regressions():
    comparison = compare_payloads(make_payload(), make_payload(), baseline="old.json")
    assert comparison.regressions == [] and comparison.notes == []
    assert {i.status for i in comparison.items} == {"ok"}


def test_compare_flags_a_clear_throughput_regression():
    old = make_payload(int8=(200.0, 204.0, 196.0))
    new = make_payload(int8=(150.0, 152.0, 149.0))  # -25 %, spreads far apart
    comparison = compare_payloads(new, old, tolerance=0.10)
    assert _status(comparison, "throughput", 1) == "regressed"
    assert _status(comparison, "speedup", 1) == "regressed"
    assert _status(comparison, "p99_ms", 1) == "ok"
    assert comparison.to_json()["regressions"] == len(comparison.regressions) >= 2


def test_compare_noisy_machine_is_not_a_regression():
    old = make_payload(int8=(200.0, 120.0, 210.0))   # wide spread: a noisy machine
    new = make_payload(int8=(170.0, 160.0, 205.0))   # median -15 %, but the ranges overlap
    comparison = compare_payloads(new, old, tolerance=0.10)
    assert _status(comparison, "throughput", 1) == "noisy"
    assert not [i for i in comparison.regressions if i.metric == "throughput"]


def test_compare_latency_regression_and_improvement():
    old = make_payload(p99=(2.0, 2.0, 2.0))
    comparison = compare_payloads(make_payload(p99=(3.0, 3.1, 3.0)), old)
    assert _status(comparison, "p99_ms", 1) == "regressed"
    comparison = compare_payloads(make_payload(p99=(1.0, 1.0, 1.1)), old)
    assert _status(comparison, "p99_ms", 1) == "improved"


def test_compare_accuracy_regressions_use_absolute_tolerances():
    old = make_payload(top1=(90.0, 89.5), cosine=0.999)
    new = make_payload(top1=(90.0, 88.0), cosine=0.9985)  # top-1 -1.5 points; cosine -0.0005 (< 0.001)
    comparison = compare_payloads(new, old)
    assert _status(comparison, "top1") == "regressed"
    assert _status(comparison, "cosine") == "ok"


def test_compare_notes_when_runs_are_not_comparable():
    old = make_payload()
    old["environment"]["cpu"]["model"] = "other cpu"
    old["timing"] = old["timing"][:1]
    comparison = compare_payloads(make_payload(), old)
    assert any("CPU differs" in note for note in comparison.notes)
    assert any("batch size 8 is not in the baseline" in note for note in comparison.notes)
