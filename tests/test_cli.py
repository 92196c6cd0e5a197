"""The command line through Click's CliRunner: help, version, exit codes, workdir, errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from quantkit import __version__
from quantkit.cli import cli

COMMANDS = ["validate", "export", "calibrate", "build-engine", "bench", "run", "sensitivity"]


def invoke(*args, env=None):
    return CliRunner().invoke(cli, list(args), env=env)


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and __version__ in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.output and f"quantkit {command} configs/" in result.output


def test_unknown_command_and_missing_argument_are_usage_errors():
    assert invoke("calibrat").exit_code == 2
    assert invoke("export").exit_code == 2


def test_missing_config_file_is_exit_2_without_traceback(tmp_path):
    result = invoke("export", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "config file not found" in result.output and "Traceback" not in result.output


def test_validate_prints_the_merged_config(make_config):
    result = invoke("validate", str(make_config()))
    assert result.exit_code == 0
    assert "trt_cache_version: 101601" in result.output  # a default, filled in


def test_validate_json(make_config):
    import json

    result = CliRunner().invoke(cli, ["validate", "--json", str(make_config())])
    assert json.loads(result.stdout)["calibration"]["batch_size"] == 4


def test_verbose_and_quiet_exclude_each_other(make_config):
    assert invoke("-v", "-q", "validate", str(make_config())).exit_code == 2


def test_runtime_errors_exit_1_and_debug_shows_the_traceback(make_config, monkeypatch):
    import quantkit.export as export_module

    def boom(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(export_module, "export_model", boom)
    plain = invoke("export", str(make_config()))
    assert plain.exit_code == 1
    assert "internal error: RuntimeError: simulated bug (rerun with --debug" in plain.output
    assert "Traceback" not in plain.output
    debug = invoke("--debug", "export", str(make_config()))
    assert debug.exit_code == 1 and "Traceback" in debug.output


def test_workdir_from_environment(tmp_path, make_config, monkeypatch):
    pytest.importorskip("torch")
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    result = invoke("-q", "export", str(make_config()), env={"QUANTKIT_WORKDIR": str(tmp_path / "wd")})
    assert result.exit_code == 0, result.output
    assert (tmp_path / "wd" / "tiny" / "model.onnx").is_file()
    assert (tmp_path / "wd" / "tiny" / "export.json").is_file()
