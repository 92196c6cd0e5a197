"""Config validation: each bad config fails with a precise message (and exit code 2 via the CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.cli import cli
from quantkit.config import load_config
from quantkit.errors import ConfigError

BAD_CONFIGS = [
    # (edits, expected fragment of the message)
    ({"calibration.methd": "entropy"}, "calibration.methd: unknown key (did you mean 'method'?)"),
    ({"bulid": {}}, "bulid: unknown key (did you mean 'build'?)"),
    ({"model.inputs": [{"name": "input", "shape": ["batch", 1, 8, 8], "dtyp": "float32"}]},
     "model.inputs[0].dtyp: unknown key (did you mean 'dtype'?)"),
    ({"calibration.batch_size": "32"}, "calibration.batch_size: Input should be a valid integer"),
    ({"calibration.batch_size": 0}, "calibration.batch_size: Input should be greater than or equal to 1"),
    ({"calibration.method": "kl"}, "calibration.method: Input should be 'entropy', 'minmax', 'percentile' or 'mse'"),
    ({"calibration.data": "does/not/exist"}, "calibration.data: path does not exist"),
    ({"model.weights": "missing.pt"}, "model.weights: path does not exist"),
    ({"model.source": "onnx"}, "source 'onnx' needs model.path"),
    ({"model.arch": "resnet18"}, "model.arch does not apply to source 'torch'"),
    ({"model.factory": "not a factory"}, "must look like 'package.module:callable'"),
    ({"build.profile": {"min": 8, "opt": 4, "max": 16}}, "need min <= opt <= max, got 8/4/16"),
    ({"bench.batch_sizes": [1, 64]}, "bench.batch_sizes [64] lie outside build.profile [1, 8]"),
    ({"bench.gates": ["top1_dorp<=0.5"]}, "names unknown metric 'top1_dorp'; did you mean 'top1_drop'?"),
    ({"bench.gates": ["speedup >> 2"]}, "does not parse"),
    ({"bench.labels": "none", "bench.gates": ["top1_drop<=0.5"]}, "needs labels but bench.labels is 'none'"),
    ({"calibration.preprocess": {"color": "rgb"}}, "has 1 channels at axis 1 (nchw) but preprocess.color 'rgb' gives 3"),
    ({"calibration.preprocess": {"color": "gray", "center_crop": 10}},
     "preprocessing produces 10x10 images but input 'input' expects 8x8"),
    ({"build.backend": "tensorrt", "calibration.batch_size": 3},
     "calibration.batch_size (3) must equal build.profile.opt (4)"),
    ({"name": "../escape"}, "name: name must be letters, digits"),
    ({"export.opset": 11}, "export.opset: Input should be greater than or equal to 13"),
    ({"model.inputs": [{"name": "input", "shape": [2, 1, 8, 8]}]}, "has a fixed batch of 2"),
    ({"model.inputs": [{"name": "a", "shape": ["batch", 1, 8, 8]}, {"name": "a", "shape": ["batch", 4]}]},
     "input names must be unique"),
    ({"export.reestimate_batchnorm": 8, "model.source": "onnx", "model.factory": None, "model.path": "config.yaml"},
     "export.reestimate_batchnorm needs a PyTorch model"),
    ({"model": None}, "model: required key is missing"),
    ({"export.batchnorm_data": "no/such/photos"}, "export.batchnorm_data: path does not exist"),
]


@pytest.mark.parametrize("edits, fragment", BAD_CONFIGS, ids=[f[1][:40] for f in BAD_CONFIGS])
def test_bad_config_is_a_one_line_error_with_exit_code_2(make_config, edits, fragment):
    path = make_config(edits)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert fragment in str(info.value)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2
    first_error = [line for line in result.output.splitlines() if line.startswith("error:")][0]
    assert fragment in first_error
    assert "Traceback" not in result.output


def test_unknown_key_error_names_its_line(make_config):
    text = make_config().read_text().replace("  batch_size: 4", "  batch_size: 4\n  max_sampels: 10")
    path = make_config(text=text)
    line = text.splitlines().index("  max_sampels: 10") + 1
    with pytest.raises(ConfigError, match=rf"config.yaml:{line}: calibration.max_sampels: unknown key "
                                          r"\(did you mean 'max_samples'\?\)"):
        load_config(path)


def test_duplicate_key_is_an_error(make_config):
    text = make_config().read_text() + "name: again\n"
    with pytest.raises(ConfigError, match="duplicate key 'name'"):
        load_config(make_config(text=text))


def test_invalid_yaml_names_line(make_config):
    with pytest.raises(ConfigError, match=r"config.yaml:3: invalid YAML: expected .,. or .\]."):
        load_config(make_config(text="name: x\nmodel: [unclosed\n"))


def test_empty_and_missing_files(tmp_path, make_config):
    with pytest.raises(ConfigError, match="config file is empty"):
        load_config(make_config(text=""))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_override_is_validated_and_named(make_config):
    with pytest.raises(ConfigError, match=r"\(set on the command line\): calibration.batch_size"):
        load_config(make_config(), {"calibration.batch_size": -1})


def test_overrides_win_and_defaults_fill_in(make_config):
    cfg = load_config(make_config(), {"calibration.method": "minmax", "export.opset": None})
    assert cfg.calibration.method == "minmax"
    assert cfg.export.opset == 17  # None overrides are ignored
    assert cfg.calibration.trt_cache_version == 101601


def test_relative_paths_resolve_against_the_config_dir(make_config, gray_dir):
    path = make_config({"calibration.data": gray_dir.name})
    assert load_config(path).calibration.data == str(gray_dir.resolve())


def test_all_shipped_configs_are_valid():
    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        cfg = load_config(path)
        assert cfg.name == path.stem
