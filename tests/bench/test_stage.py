"""The bench stage end to end on a tiny classifier: reports, gates, exit codes, bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from quantkit.artifacts import Manifest, sha256_file
from quantkit.bench import report, stage
from quantkit.bench.report import validate_payload
from quantkit.errors import (EXIT_GATE_FAILED, EXIT_RUNTIME, EXIT_USAGE, ConfigError, GateFailedError,
                             MissingArtifactError, StaleArtifactError, UsageError)
from quantkit.ui import Console


def test_run_writes_reports_and_passes(bench_setup, capsys):
    cfg, ws = bench_setup(gates=["top1_drop<=5", "cosine>=0.9", "speedup@4>=0.01"])
    result = stage.run_bench(cfg, ws, Console())
    assert result.passed and [g.passed for g in result.gates] == [True, True, True]
    payload = json.loads((ws.root / "bench.json").read_text())
    assert validate_payload(payload) == []
    assert payload["passed"] is True and payload["settings"]["batch_sizes"] == [1, 4]
    assert [row["batch_size"] for row in payload["timing"]] == [1, 4]
    assert payload["accuracy"]["labels"]["fp32"]["top1"] == pytest.approx(90.0)
    assert "| batch |" in (ws.root / "bench.md").read_text()
    out = capsys.readouterr().out
    assert "speedup" in out and "PASS  cosine>=0.9" in out
    assert "speedup" in stage.describe(result)
    # bench.json doubles as the stage manifest: `quantkit run` sees it as up to date
    assert ws.staleness(stage.MANIFEST, stage.bench_fingerprint(cfg, ws)) is None


def test_failed_gate_exits_3_after_writing_reports(bench_setup):
    cfg, ws = bench_setup(gates=["cosine>=0.9"])
    with pytest.raises(GateFailedError, match="speedup>=1000") as info:
        stage.run_bench(cfg, ws, Console(verbosity=-1), gates=["speedup>=1000"])
    assert info.value.exit_code == EXIT_GATE_FAILED == 3
    payload = json.loads((ws.root / "bench.json").read_text())
    assert payload["passed"] is False
    assert [(g["expr"], g["passed"]) for g in payload["gates"]] == [("cosine>=0.9", True), ("speedup>=1000", False)]
    assert "❌ fail" in (ws.root / "bench.md").read_text()
    # a failed bench is never "up to date"
    assert ws.staleness(stage.MANIFEST, stage.bench_fingerprint(cfg, ws)) is not None


def test_label_gate_without_labels_is_a_config_error_before_timing(bench_setup):
    cfg, ws = bench_setup(labels=False, gates=["top1_drop<=0.5"])
    with pytest.raises(ConfigError, match="need labels") as info:
        stage.run_bench(cfg, ws, Console(verbosity=-1))
    assert info.value.exit_code == EXIT_USAGE
    assert not (ws.root / "bench.json").exists()


def test_without_labels_accuracy_still_compares_outputs(bench_setup):
    cfg, ws = bench_setup(labels=False)
    result = stage.run_bench(cfg, ws, Console(verbosity=-1))
    assert result.accuracy.labels is None and result.accuracy.outputs[0].top1_agreement is not None


@pytest.mark.parametrize("gate, message", [("top1_drop <= half", "does not parse"),
                                           ("latency<=3", "unknown metric"),
                                           ("speedup@16>=1", "batch size 16")])
def test_bad_cli_gate_is_a_usage_error(bench_setup, gate, message):
    cfg, ws = bench_setup()
    with pytest.raises(UsageError, match=message) as info:
        stage.run_bench(cfg, ws, Console(verbosity=-1), gates=[gate])
    assert info.value.exit_code == EXIT_USAGE


def test_batch_sizes_outside_the_profile_are_a_usage_error(bench_setup):
    cfg, ws = bench_setup()
    with pytest.raises(UsageError, match=r"\[16\] lie outside .* \[1, 8\]") as info:
        stage.run_bench(cfg, ws, Console(verbosity=-1), batch_sizes=[1, 16])
    assert info.value.exit_code == EXIT_USAGE


def test_stale_int8_artifact_is_refused(bench_setup, monkeypatch):
    cfg, ws = bench_setup()
    monkeypatch.setattr(stage, "_build_fingerprint", lambda cfg, ws: {"test": "calibration data changed"})
    with pytest.raises(StaleArtifactError, match="INT8 artifact is stale") as info:
        stage.run_bench(cfg, ws, Console(verbosity=-1))
    assert info.value.exit_code == EXIT_RUNTIME


def test_modified_int8_artifact_is_refused(bench_setup):
    cfg, ws = bench_setup()
    shutil.copy(ws.onnx_model, ws.path("model.int8.onnx"))
    with pytest.raises(StaleArtifactError, match="modified after build.json"):
        stage.run_bench(cfg, ws, Console(verbosity=-1))


def test_missing_int8_artifact(bench_setup):
    cfg, ws = bench_setup()
    ws.path("model.int8.onnx").unlink()
    with pytest.raises(MissingArtifactError, match="INT8 artifact not found"):
        stage.run_bench(cfg, ws, Console(verbosity=-1))


def test_json_to_stdout_owns_stdout(bench_setup, capsys, tmp_path):
    cfg, ws = bench_setup()
    stage.run_bench(cfg, ws, Console(), json_path="-", markdown_path=tmp_path / "summary.md")
    captured = capsys.readouterr()
    payload = json.loads(captured.out)  # nothing but the JSON
    assert validate_payload(payload) == [] and "wrote" in captured.err
    assert (tmp_path / "summary.md").read_text() == (ws.root / "bench.md").read_text()


def test_quiet_prints_nothing_on_stdout(bench_setup, capsys, tmp_path):
    cfg, ws = bench_setup()
    stage.run_bench(cfg, ws, Console(verbosity=-1), json_path=tmp_path / "copy.json")
    captured = capsys.readouterr()
    assert captured.out == "" and "wrote" not in captured.err
    assert json.loads((tmp_path / "copy.json").read_text())["schema"] == "quantkit.bench"


def test_compare_with_a_faster_baseline_fails_with_exit_3(bench_setup, tmp_path):
    cfg, ws = bench_setup()
    first = stage.run_bench(cfg, ws, Console(verbosity=-1))
    # a baseline 100x slower in every figure: whatever the machine's noise, nothing regressed
    slower = json.loads(report.dumps(first.payload))
    for row in slower["timing"]:
        for run in row["int8"]["repeats"]:
            run["throughput"] /= 100  # also makes the baseline's INT8/FP32 speedup 100x lower
            run["latency_ms"] = {key: value * 100 for key, value in run["latency_ms"].items()}
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    assert stage.run_bench(cfg, ws, Console(verbosity=-1), compare=tmp_path / "slower.json").comparison.regressions == []
    baseline = json.loads(report.dumps(first.payload))
    for row in baseline["timing"]:
        for run in row["int8"]["repeats"]:
            run["throughput"] *= 100  # the baseline was 100x faster
    (tmp_path / "old.json").write_text(json.dumps(baseline))
    with pytest.raises(GateFailedError, match="throughput@1 regressed"):
        stage.run_bench(cfg, ws, Console(verbosity=-1), compare=tmp_path / "old.json")
    assert json.loads((ws.root / "bench.json").read_text())["comparison"]["regressions"] >= 1


def test_compare_with_an_unreadable_baseline_is_a_usage_error(bench_setup, tmp_path):
    cfg, ws = bench_setup()
    (tmp_path / "bad.json").write_text('{"schema": "something else"}')
    with pytest.raises(UsageError, match="not a quantkit bench.json"):
        stage.run_bench(cfg, ws, Console(verbosity=-1), compare=tmp_path / "bad.json")
    with pytest.raises(UsageError, match="cannot read"):
        stage.run_bench(cfg, ws, Console(verbosity=-1), compare=tmp_path / "missing.json")


def test_falls_back_to_calibration_data_with_a_warning(bench_setup, capsys):
    cfg, ws = bench_setup(bench_data=False)
    result = stage.run_bench(cfg, ws, Console(verbosity=-1))
    assert "calibration data" in capsys.readouterr().err
    assert result.data_path.endswith("calib.npz") and any("calibration data" in n for n in result.notes)
    assert stage.bench_fingerprint(cfg, ws)["data"]["sha"]  # computing the fingerprint stays silent
    assert capsys.readouterr().err == ""


def test_identical_models_give_infinite_snr_in_json(bench_setup):
    cfg, ws = bench_setup(gates=["snr_db>=100"])
    shutil.copy(ws.onnx_model, ws.path("model.int8.onnx"))
    ws.write_manifest("build.json", Manifest("build", {"test": "tiny classifier", "version": 1},
                                             {"model.int8.onnx": sha256_file(ws.path("model.int8.onnx"))}, {}, {}))
    result = stage.run_bench(cfg, ws, Console(verbosity=-1))
    assert result.passed
    output = json.loads((ws.root / "bench.json").read_text())["accuracy"]["outputs"][0]
    assert output["snr_db"] == "inf" and output["cosine"] == 1.0 and output["max_abs_err"] == 0.0


def test_parse_batch_sizes():
    assert stage.parse_batch_sizes("1,8, 32") == [1, 8, 32]
    for bad in ("", "1,x", "0,4"):
        with pytest.raises(UsageError):
            stage.parse_batch_sizes(bad)
