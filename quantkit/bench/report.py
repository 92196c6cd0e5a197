"""bench.json (versioned schema), bench.md (CI job summary) and the terminal table.

The JSON payload is the single source: the Markdown and the terminal table are
rendered from it, gates and ``--compare`` read it. Non-finite numbers (an SNR of
identical outputs is infinite) are written as the strings ``"inf"``, ``"-inf"``
and ``"nan"`` because JSON has no such numbers. :data:`BENCH_SCHEMA` is a JSON
Schema (draft 2020-12 subset) of the file; :func:`validate_payload` checks a
payload against it without third-party packages. docs/bench.md describes every
field.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from quantkit.artifacts import canonical_json, library_versions

if TYPE_CHECKING:  # pragma: no cover
    from quantkit.bench.stage import BenchResult

SCHEMA_NAME = "quantkit.bench"
SCHEMA_VERSION = 1

# CPU flags that matter for INT8 on CPU (x86: /proc/cpuinfo "flags"; Arm: "Features")
INT8_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
                  "amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "asimddp", "i8mm", "sve")
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "asimddp")

# --------------------------------------------------------------------------- environment


def cpu_info(cpuinfo_text: str | None = None) -> dict[str, Any]:
    """CPU model, core counts and the INT8-relevant flags of this machine.

    Args:
        cpuinfo_text: the content of /proc/cpuinfo (read when None; tests pass their own).
    """
    from quantkit.backends.onnxruntime.runner import physical_cores

    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo_text = ""
    fields: dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    model = (fields.get("model name") or fields.get("Hardware") or fields.get("cpu model")
             or platform.processor() or platform.machine() or "unknown")
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "model": model,
        "physical_cores": physical_cores(),
        "logical_cores": os.cpu_count() or 1,
        "flags": sorted(flag for flag in INT8_CPU_FLAGS if flag in flags),
        "vnni": any(flag in flags for flag in _VNNI_FLAGS),
        "amx": "amx_int8" in flags,
    }


def environment(*, threads: int, providers: Mapping[str, list[str]], cpuinfo_text: str | None = None) -> dict:
    """Everything that shapes a timing: CPU, OS, library versions, providers, threads."""
    try:
        import onnxruntime

        available = list(onnxruntime.get_available_providers())
    except ImportError:
        available = []
    return {
        "cpu": cpu_info(cpuinfo_text),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "versions": library_versions(),
        "providers": {"available": available, **{name: list(p) for name, p in providers.items()}},
        "threads": {"intra_op": threads, "inter_op": 1},
    }


# --------------------------------------------------------------------------- payload


def build_payload(result: "BenchResult") -> dict[str, Any]:
    """The bench.json content (without ``outputs``, which the stage fills after writing bench.md)."""
    from quantkit.artifacts import fingerprint_hash

    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "stage": "bench",
        "created": result.created,
        "passed": result.passed,
        "fingerprint": result.fingerprint,
        "fingerprint_hash": fingerprint_hash(result.fingerprint),
        "outputs": {},
        "model": {
            "name": result.model_name,
            "config": result.config_path,
            "fp32": {"path": str(result.fp32_path), "sha256": result.fp32_sha256},
            "int8": {"path": str(result.int8_path), "sha256": result.int8_sha256},
        },
        "backend": result.backend,
        "settings": dict(result.settings),
        "environment": result.environment,
        "data": result.data_path,
        "timing": [row.to_json() for row in result.timing],
        "accuracy": result.accuracy.to_json(),
        "gates": [gate.to_json() for gate in result.gates],
        "comparison": result.comparison.to_json() if result.comparison else None,
        "notes": list(result.notes),
    }


def jsonable(value: Any) -> Any:
    """Replace non-finite floats by "inf"/"-inf"/"nan" (recursively); JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def dumps(payload: Mapping[str, Any]) -> str:
    """bench.json text: sorted keys, two-space indent, non-finite numbers as strings."""
    return canonical_json(jsonable(payload), indent=2) + "\n"


# --------------------------------------------------------------------------- schema

_FLOAT = {"anyOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}
_FLOAT_OR_NULL = {"anyOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}, {"type": "null"}]}
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_STRS = {"type": "array", "items": _STR}


def _obj(required: Mapping[str, Any], optional: Mapping[str, Any] | None = None) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


_LATENCY = _obj({key: _FLOAT for key in ("mean", "min", "max", "p50", "p90", "p95", "p99", "cv_pct")})
_SPREAD = _obj({key: _FLOAT for key in ("median", "min", "max")})
_RUN = _obj({"iterations": _INT, "warmup_iterations": _INT, "warmup_s": _FLOAT, "wall_s": _FLOAT,
             "throughput": _FLOAT, "latency_ms": _LATENCY})
_VARIANT = _obj({"iterations": _INT, "latency_ms": _LATENCY, "throughput": _SPREAD,
                 "repeats": {"type": "array", "items": _RUN, "minItems": 1}})
_TIMING_ROW = _obj({"batch_size": {"type": "integer", "minimum": 1}, "noisy": {"type": "boolean"},
                    "fp32": _VARIANT, "int8": _VARIANT, "speedup": _SPREAD})
_OUTPUT = _obj({"name": _STR, "shape": {"type": "array", "items": {"type": ["integer", "null"]}},
                "elements": _INT, "cosine": _FLOAT, "cosine_min_sample": _FLOAT, "max_abs_err": _FLOAT,
                "mean_abs_err": _FLOAT, "snr_db": _FLOAT, "top1_agreement": _FLOAT_OR_NULL})
_TOPK = _obj({"top1": _FLOAT, "top5": _FLOAT_OR_NULL})
_LABELS = {"anyOf": [{"type": "null"}, _obj({"output": _STR, "samples": _INT, "fp32": _TOPK, "int8": _TOPK,
                                              "top1_drop": _FLOAT, "top5_drop": _FLOAT_OR_NULL})]}
_GATE = _obj({"expr": _STR, "metric": _STR, "op": {"enum": ["<=", ">=", "<", ">", "=="]}, "threshold": _FLOAT,
              "batch_size": {"type": ["integer", "null"]}, "value": _FLOAT_OR_NULL,
              "passed": {"type": "boolean"}, "detail": _STR})
_COMPARE_ITEM = _obj({"metric": _STR, "batch_size": {"type": ["integer", "null"]}, "old": _FLOAT_OR_NULL,
                      "new": _FLOAT_OR_NULL, "change": _FLOAT_OR_NULL, "relative": {"type": "boolean"},
                      "status": {"enum": ["ok", "improved", "regressed", "noisy", "missing"]}})
_COMPARISON = {"anyOf": [{"type": "null"}, _obj({
    "baseline": _STR, "tolerance": _FLOAT, "items": {"type": "array", "items": _COMPARE_ITEM},
    "regressions": _INT, "notes": _STRS})]}
_ARTIFACT = _obj({"path": _STR, "sha256": _STR})

BENCH_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": f"{SCHEMA_NAME} version {SCHEMA_VERSION}",
    **_obj({
        "schema": {"const": SCHEMA_NAME},
        "schema_version": {"type": "integer", "minimum": 1},
        "stage": {"const": "bench"},
        "created": _STR,
        "passed": {"type": "boolean"},
        "fingerprint": {"type": "object"},
        "fingerprint_hash": _STR,
        "outputs": {"type": "object", "additionalProperties": _STR},
        "model": _obj({"name": _STR, "config": {"type": ["string", "null"]}, "fp32": _ARTIFACT, "int8": _ARTIFACT}),
        "backend": _STR,
        "settings": _obj({"batch_sizes": {"type": "array", "items": {"type": "integer", "minimum": 1},
                                          "minItems": 1},
                          "warmup_ms": _FLOAT, "duration_s": _FLOAT, "min_iterations": _INT,
                          "repeats": {"type": "integer", "minimum": 1}, "threads": {"type": "integer", "minimum": 1}}),
        "environment": _obj({
            "cpu": _obj({"model": _STR, "physical_cores": _INT, "logical_cores": _INT, "flags": _STRS,
                         "vnni": {"type": "boolean"}, "amx": {"type": "boolean"}}),
            "os": _STR, "python": _STR,
            "versions": {"type": "object", "additionalProperties": _STR},
            "providers": {"type": "object", "additionalProperties": _STRS},
            "threads": _obj({"intra_op": _INT, "inter_op": _INT}),
        }),
        "data": _STR,
        "timing": {"type": "array", "items": _TIMING_ROW},
        "accuracy": _obj({"samples": _INT, "batch_size": _INT, "outputs": {"type": "array", "items": _OUTPUT},
                          "labels": _LABELS, "notes": _STRS}),
        "gates": {"type": "array", "items": _GATE},
        "comparison": _COMPARISON,
        "notes": _STRS,
    }),
}

_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate_payload(payload: Any, schema: Mapping[str, Any] = BENCH_SCHEMA) -> list[str]:
    """Problems of ``payload`` against ``schema`` ("path: problem"), empty when valid.

    Supports the keywords the bench schema uses: type, const, enum, anyOf,
    required, properties, additionalProperties, items, minItems, minimum.
    """
    problems: list[str] = []
    _validate(payload, schema, "$", problems)
    return problems


def _validate(value: Any, schema: Mapping[str, Any], path: str, problems: list[str]) -> None:
    if "anyOf" in schema:
        if not any(not validate_payload(value, option) for option in schema["anyOf"]):
            problems.append(f"{path}: {_short(value)} matches none of the allowed forms")
        return
    if "const" in schema and value != schema["const"]:
        problems.append(f"{path}: expected {schema['const']!r}, got {_short(value)}")
        return
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: expected one of {schema['enum']}, got {_short(value)}")
        return
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_JSON_TYPES[t](value) for t in types):
            problems.append(f"{path}: expected {' or '.join(types)}, got {_short(value)}")
            return
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        problems.append(f"{path}: {value} is below the minimum {schema['minimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: required key {key!r} is missing")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                _validate(item, properties[key], f"{path}.{key}", problems)
            elif extra is False:
                problems.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, Mapping):
                _validate(item, extra, f"{path}.{key}", problems)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{path}: needs at least {schema['minItems']} items, got {len(value)}")
        if "items" in schema:
            for index, item in enumerate(value):
                _validate(item, schema["items"], f"{path}[{index}]", problems)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- rendering


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def fmt_ms(value: Any) -> str:
    value = _num(value)
    if value is None or math.isnan(value):
        return "n/a"
    if value < 1:
        return f"{value:.3g}"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def fmt_rate(value: Any) -> str:
    value = _num(value)
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def fmt_float(value: Any, digits: int = 4) -> str:
    value = _num(value)
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def fmt_speedup(spread: Mapping[str, Any], plain: bool = False) -> str:
    median, low, high = (_num(spread[k]) for k in ("median", "min", "max"))
    times = "x" if plain else "×"
    dash = "-" if plain else "–"
    return f"{median:.2f}{times} [{low:.2f}{dash}{high:.2f}]"


def _cpu_line(payload: Mapping[str, Any]) -> str:
    env = payload["environment"]
    cpu = env["cpu"]
    features = f"VNNI {'yes' if cpu['vnni'] else 'no'}, AMX {'yes' if cpu['amx'] else 'no'}"
    threads = env["threads"]["intra_op"]
    return f"{cpu['model']} ({cpu['physical_cores']} cores, {features}), {threads} thread{'s' if threads != 1 else ''}"


def to_markdown(payload: Mapping[str, Any]) -> str:
    """bench.md: Markdown fit for a CI job summary (``cat bench.md >> $GITHUB_STEP_SUMMARY``)."""
    settings = payload["settings"]
    gates = payload["gates"]
    passed = sum(1 for g in gates if g["passed"])
    providers = ", ".join(payload["environment"]["providers"].get("int8", [])) or payload["backend"]
    status = "✅ passed" if payload["passed"] else "❌ failed"
    lines = [
        f"## quantkit bench: {payload['model']['name']} — {status}",
        "",
        f"INT8 vs FP32 on {payload['backend']} ({providers}); {_cpu_line(payload)}.",
        "",
        "| batch | FP32 p50 ms | INT8 p50 ms | FP32 p99 ms | INT8 p99 ms | FP32 items/s | INT8 items/s "
        "| speedup [min–max] |",
        "|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    for row in payload["timing"]:
        fp32, int8 = row["fp32"], row["int8"]
        noisy = " ⚠️ noisy" if row["noisy"] else ""
        lines.append(
            f"| {row['batch_size']} | {fmt_ms(fp32['latency_ms']['p50'])} | {fmt_ms(int8['latency_ms']['p50'])} "
            f"| {fmt_ms(fp32['latency_ms']['p99'])} | {fmt_ms(int8['latency_ms']['p99'])} "
            f"| {fmt_rate(fp32['throughput']['median'])} | {fmt_rate(int8['throughput']['median'])} "
            f"| {fmt_speedup(row['speedup'])}{noisy} |")
    accuracy = payload["accuracy"]
    lines += ["", f"Accuracy on {accuracy['samples']} samples (INT8 vs FP32 outputs):", "",
              "| output | cosine | SNR dB | max abs err | mean abs err | top-1 agreement |",
              "|:---|---:|---:|---:|---:|---:|"]
    for out in accuracy["outputs"]:
        agreement = out["top1_agreement"]
        lines.append(f"| `{out['name']}` | {fmt_float(out['cosine'], 6)} | {fmt_float(out['snr_db'], 4)} "
                     f"| {fmt_float(out['max_abs_err'])} | {fmt_float(out['mean_abs_err'])} "
                     f"| {'—' if agreement is None else f'{float(agreement) * 100:.2f} %'} |")
    labels = accuracy["labels"]
    if labels:
        lines += ["", f"| against labels (`{labels['output']}`) | FP32 | INT8 | drop (points) |",
                  "|:---|---:|---:|---:|"]
        for key in ("top1", "top5"):
            if labels["fp32"][key] is not None:
                lines.append(f"| {key.replace('top', 'top-')} | {float(labels['fp32'][key]):.2f} % "
                             f"| {float(labels['int8'][key]):.2f} % | {float(labels[key + '_drop']):+.2f} |")
    if gates:
        lines += ["", f"Gates: {passed}/{len(gates)} passed", "", "| gate | value | result |", "|:---|---:|:---|"]
        for gate in gates:
            value = "n/a" if gate["value"] is None else fmt_float(gate["value"])
            mark = "✅ pass" if gate["passed"] else "❌ fail"
            detail = f" ({gate['detail']})" if gate["detail"] else ""
            lines.append(f"| `{gate['expr']}` | {value} | {mark}{detail} |")
    comparison = payload.get("comparison")
    if comparison:
        lines += ["", f"Compared with `{comparison['baseline']}` (tolerance {comparison['tolerance'] * 100:.0f} %): "
                  f"{comparison['regressions']} regression(s)", "",
                  "| metric | batch | baseline | now | change | status |", "|:---|---:|---:|---:|---:|:---|"]
        for item in comparison["items"]:
            change = "n/a" if item["change"] is None else (
                f"{float(item['change']) * 100:+.1f} %" if item["relative"] else f"{float(item['change']):+.4g}")
            lines.append(f"| {item['metric']} | {item['batch_size'] or ''} | {fmt_float(item['old'])} "
                         f"| {fmt_float(item['new'])} | {change} | {item['status']} |")
        lines += [f"- {note}" for note in comparison["notes"]]
    if payload["notes"]:
        lines += [""] + [f"- {note}" for note in payload["notes"]]
    versions = payload["environment"]["versions"]
    lines += ["", f"<sub>Per run: warm-up ≥ {settings['warmup_ms']} ms, then ≥ {settings['min_iterations']} "
                  f"iterations and ≥ {settings['duration_s']} s; {settings['repeats']} repeats, FP32 and INT8 "
                  "interleaved; latency p50 = median, p90/p95/p99 as trtexec; speedup = median [min–max] over "
                  "repeats. " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "</sub>", ""]
    return "\n".join(lines)


def terminal_table(payload: Mapping[str, Any]) -> str:
    """A compact plain-text summary for the terminal."""
    rows = [("batch", "FP32 p50", "INT8 p50", "INT8 p99", "FP32 items/s", "INT8 items/s", "speedup [min-max]")]
    for row in payload["timing"]:
        fp32, int8 = row["fp32"], row["int8"]
        rows.append((str(row["batch_size"]), fmt_ms(fp32["latency_ms"]["p50"]) + " ms",
                     fmt_ms(int8["latency_ms"]["p50"]) + " ms", fmt_ms(int8["latency_ms"]["p99"]) + " ms",
                     fmt_rate(fp32["throughput"]["median"]), fmt_rate(int8["throughput"]["median"]),
                     fmt_speedup(row["speedup"], plain=True) + ("  noisy" if row["noisy"] else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"{payload['model']['name']}: INT8 vs FP32 on {payload['backend']}, {_cpu_line(payload)}"]
    for r in rows:
        lines.append("  ".join(cell.rjust(w) if i < len(r) - 1 else cell for i, (cell, w) in
                               enumerate(zip(r, widths))).rstrip())
    accuracy = payload["accuracy"]
    parts = []
    for out in accuracy["outputs"]:
        text = (f"{out['name']}: cosine {fmt_float(out['cosine'], 6)}, SNR {fmt_float(out['snr_db'], 3)} dB, "
                f"max abs {fmt_float(out['max_abs_err'], 3)}")
        if out["top1_agreement"] is not None:
            text += f", top-1 agreement {float(out['top1_agreement']) * 100:.2f}%"
        parts.append(text)
    lines.append(f"accuracy ({accuracy['samples']} samples): " + "; ".join(parts))
    labels = accuracy["labels"]
    if labels:
        text = (f"labels: top-1 {float(labels['fp32']['top1']):.2f}% -> {float(labels['int8']['top1']):.2f}% "
                f"(drop {float(labels['top1_drop']):+.2f})")
        if labels["fp32"]["top5"] is not None:
            text += (f", top-5 {float(labels['fp32']['top5']):.2f}% -> {float(labels['int8']['top5']):.2f}%")
        lines.append(text)
    for gate in payload["gates"]:
        value = "n/a" if gate["value"] is None else fmt_float(gate["value"])
        detail = f" ({gate['detail']})" if gate["detail"] else ""
        lines.append(f"{'PASS' if gate['passed'] else 'FAIL'}  {gate['expr']}  value {value}{detail}")
    comparison = payload.get("comparison")
    if comparison:
        flagged = [i for i in comparison["items"] if i["status"] in ("regressed", "noisy")]
        lines.append(f"vs {comparison['baseline']}: {comparison['regressions']} regression(s)"
                     + ("" if flagged else ", nothing worse than the tolerance"))
        for item in flagged:
            where = f"@{item['batch_size']}" if item["batch_size"] is not None else ""
            change = (f"{float(item['change']) * 100:+.1f}%" if item["relative"] else f"{float(item['change']):+.4g}")
            lines.append(f"  {item['status'].upper()}  {item['metric']}{where}: {fmt_float(item['old'])} -> "
                         f"{fmt_float(item['new'])} ({change})")
    return "\n".join(lines)
