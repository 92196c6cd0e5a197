"""bench.json schema (checked by hand here, independently of report.validate_payload), renderers, environment."""

from __future__ import annotations

import json
import math

import pytest

from quantkit.bench import report, stage
from quantkit.ui import Console

NUMBER = (int, float)


def _is_float(value):
    return (isinstance(value, NUMBER) and not isinstance(value, bool)) or value in ("inf", "-inf", "nan")


def check_bench_json(payload):
    """A small hand-written checker of the documented schema (docs/bench.md)."""
    assert payload["schema"] == "quantkit.bench" and payload["schema_version"] == 1
    top = {"schema": str, "schema_version": int, "stage": str, "created": str, "passed": bool, "fingerprint": dict,
           "fingerprint_hash": str, "outputs": dict, "model": dict, "backend": str, "settings": dict,
           "environment": dict, "data": str, "timing": list, "accuracy": dict, "gates": list, "notes": list}
    for key, kind in top.items():
        assert isinstance(payload[key], kind), key
    assert payload["comparison"] is None or isinstance(payload["comparison"], dict)
    for key in ("fp32", "int8"):
        assert set(payload["model"][key]) == {"path", "sha256"}
    assert set(payload["settings"]) == {"batch_sizes", "warmup_ms", "duration_s", "min_iterations", "repeats",
                                        "threads"}
    cpu = payload["environment"]["cpu"]
    assert isinstance(cpu["model"], str) and isinstance(cpu["vnni"], bool) and isinstance(cpu["amx"], bool)
    assert isinstance(cpu["flags"], list) and isinstance(cpu["physical_cores"], int)
    assert {"versions", "providers", "threads", "os", "python"} <= set(payload["environment"])
    for row in payload["timing"]:
        assert isinstance(row["batch_size"], int) and isinstance(row["noisy"], bool)
        assert all(_is_float(row["speedup"][k]) for k in ("median", "min", "max"))
        for variant in ("fp32", "int8"):
            data = row[variant]
            assert set(data["latency_ms"]) == {"mean", "min", "max", "p50", "p90", "p95", "p99", "cv_pct"}
            assert all(_is_float(v) for v in data["latency_ms"].values())
            assert len(data["repeats"]) == payload["settings"]["repeats"]
            assert data["iterations"] == sum(r["iterations"] for r in data["repeats"])
    for out in payload["accuracy"]["outputs"]:
        for key in ("cosine", "cosine_min_sample", "max_abs_err", "mean_abs_err", "snr_db"):
            assert _is_float(out[key]), key
        assert out["top1_agreement"] is None or _is_float(out["top1_agreement"])
    for gate in payload["gates"]:
        assert set(gate) == {"expr", "metric", "op", "threshold", "batch_size", "value", "passed", "detail"}


@pytest.fixture
def payload(bench_setup):
    cfg, ws = bench_setup(gates=["cosine>=0.9", "top1_drop<=5"])
    stage.run_bench(cfg, ws, Console(verbosity=-1))
    return json.loads((ws.root / "bench.json").read_text())


def test_bench_json_matches_the_documented_schema(payload):
    check_bench_json(payload)
    assert report.validate_payload(payload) == []
    assert set(payload["outputs"]) == {"bench.md"}


def test_validator_reports_missing_keys_and_wrong_types(payload):
    del payload["timing"][0]["int8"]["latency_ms"]["p99"]
    payload["settings"]["repeats"] = "three"
    payload["accuracy"]["outputs"][0]["snr_db"] = "infinite"
    problems = report.validate_payload(payload)
    assert any("$.timing[0].int8.latency_ms: required key 'p99' is missing" == p for p in problems)
    assert any(p.startswith("$.settings.repeats: expected integer") for p in problems)
    assert any(p.startswith("$.accuracy.outputs[0].snr_db") for p in problems)


def test_non_finite_numbers_become_strings():
    assert report.jsonable({"a": [math.inf, -math.inf, 1.5], "b": math.nan}) == {"a": ["inf", "-inf", 1.5],
                                                                                 "b": "nan"}
    assert "Infinity" not in report.dumps({"x": math.inf})


def test_markdown_and_terminal_render_from_the_payload(payload):
    markdown = report.to_markdown(payload)
    assert "| batch | FP32 p50 ms | INT8 p50 ms |" in markdown
    assert "| `cosine>=0.9` |" in markdown and "✅ pass" in markdown
    assert "| top-1 | 90.00 % |" in markdown
    table = report.terminal_table(payload)
    assert table.splitlines()[1].split()[:3] == ["batch", "FP32", "p50"]
    assert "PASS  top1_drop<=5" in table


CPUINFO_X86 = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 fma avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8 amx_bf16
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""
CPUINFO_ARM = """processor\t: 0
Features\t: fp asimd asimddp i8mm
"""


def test_cpu_info_reads_model_and_int8_flags():
    x86 = report.cpu_info(CPUINFO_X86)
    assert x86["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert x86["vnni"] and x86["amx"]
    assert {"avx512_vnni", "amx_int8", "amx_tile"} <= set(x86["flags"]) and "sse" not in x86["flags"]
    arm = report.cpu_info(CPUINFO_ARM)
    assert arm["vnni"] and not arm["amx"] and arm["flags"] == ["asimddp", "i8mm"]


def test_environment_records_threads_versions_and_providers():
    env = report.environment(threads=3, providers={"int8": ["CPUExecutionProvider"]}, cpuinfo_text=CPUINFO_X86)
    assert env["threads"] == {"intra_op": 3, "inter_op": 1}
    assert "onnxruntime" in env["versions"] and "CPUExecutionProvider" in env["providers"]["available"]
    assert env["providers"]["int8"] == ["CPUExecutionProvider"]
