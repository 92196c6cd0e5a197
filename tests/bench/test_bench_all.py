"""scripts/bench_all.py: the docs/benchmarks.md table between the markers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_all.py"


@pytest.fixture(scope="module")
def bench_all():
    spec = importlib.util.spec_from_file_location("bench_all", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_splice_replaces_only_between_markers(bench_all):
    doc = f"# Benchmarks\n\nintro\n\n{bench_all.START}\nold table\n{bench_all.END}\n\nfooter\n"
    new = bench_all.splice(doc, f"{bench_all.START}\nnew\n{bench_all.END}")
    assert new == f"# Benchmarks\n\nintro\n\n{bench_all.START}\nnew\n{bench_all.END}\n\nfooter\n"


def test_splice_appends_a_section_without_markers_and_refuses_a_broken_one(bench_all):
    new = bench_all.splice("# Benchmarks\n", f"{bench_all.START}\nx\n{bench_all.END}")
    assert new.startswith("# Benchmarks\n\n## FP32 vs INT8") and new.rstrip().endswith(bench_all.END)
    with pytest.raises(SystemExit):
        bench_all.splice(f"{bench_all.START}\nno end", "x")


def test_main_benchmarks_a_config_and_writes_the_table(bench_all, bench_setup, tmp_path):
    cfg, ws = bench_setup(gates=["speedup>=1000"])  # fails: still tabulated, marked
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{bench_all.START}\n{bench_all.END}\n\nkept\n")
    code = bench_all.main(["-q", "--workdir", str(ws.root.parent), "--doc", str(doc), str(cfg.source_path)])
    text = doc.read_text()
    assert code == 0 and text.endswith("\n\nkept\n")
    assert "| tiny | 1 |" in text and "|  | 4 |" in text and "❌ 0/1" in text
    assert "Machine: **" in text and "Command: `python scripts/bench_all.py -q --workdir" in text


def test_main_without_artifacts_leaves_the_document_alone(bench_all, bench_setup, tmp_path):
    cfg, ws = bench_setup()
    ws.path("model.int8.onnx").unlink()
    doc = tmp_path / "benchmarks.md"
    doc.write_text("unchanged\n")
    assert bench_all.main(["-q", "--workdir", str(ws.root.parent), "--doc", str(doc), str(cfg.source_path)]) == 1
    assert doc.read_text() == "unchanged\n"


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_bad_repeats_is_a_usage_error(bench_all, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_all.main(["--repeats", value])
    assert exit_info.value.code == 2 and "--repeats" in capsys.readouterr().err
