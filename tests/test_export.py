"""Export: PyTorch -> ONNX with parity, ONNX normalisation, manifests, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from quantkit.artifacts import ModelWorkspace  # noqa: E402
from quantkit.config import load_config  # noqa: E402
from quantkit.errors import ConfigError, ModelError, ParityError  # noqa: E402
from quantkit.export import export_fingerprint, export_model  # noqa: E402
from quantkit.ui import Console  # noqa: E402

FACTORY_SOURCE = '''
import torch

class Tiny(torch.nn.Module):
    def __init__(self, channels=4):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.fc = torch.nn.Linear(channels * 64, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))

def build(channels=4):
    return Tiny(channels)
'''


@pytest.fixture
def tiny_config(tmp_path, make_config, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "tiny_factory", raising=False)  # each test has its own copy
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "tiny_factory.py").write_text(FACTORY_SOURCE)
    return make_config({"model.factory": "tiny_factory:build", "model.kwargs": {"channels": 4},
                        "export.parity": {"atol": 1e-4, "rtol": 1e-3, "samples": 3}})


def test_torch_export_has_dynamic_batch_parity_and_manifest(tmp_path, tiny_config):
    cfg = load_config(tiny_config)
    ws = ModelWorkspace(tmp_path / "art", cfg.name)
    result = export_model(cfg, ws, Console(verbosity=-1))
    model = onnx.load(str(ws.onnx_model))
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param == "batch"
    assert [o.name for o in model.graph.output] == ["logits"]
    assert {p.batch_size for p in result.parity} == {1, 3}
    assert all(p.max_abs < 1e-4 for p in result.parity)
    assert result.op_histogram["Conv"] == 1
    session = ort.InferenceSession(str(ws.onnx_model), providers=["CPUExecutionProvider"])
    assert session.run(None, {"input": np.zeros((5, 1, 8, 8), np.float32)})[0].shape == (5, 3)
    manifest = json.loads(ws.export_manifest.read_text())
    assert manifest["stage"] == "export"
    assert manifest["fingerprint"] == json.loads(json.dumps(export_fingerprint(cfg)))
    assert ws.staleness("export.json", export_fingerprint(cfg)) is None


def test_parity_failure_reports_max_differences(tmp_path, tiny_config, make_config):
    path = make_config({"model.factory": "tiny_factory:build",
                        "export.parity": {"atol": 0.0, "rtol": 0.0, "samples": 3}})
    cfg = load_config(path)
    ws = ModelWorkspace(tmp_path / "art", cfg.name)
    try:
        export_model(cfg, ws, Console(verbosity=-1))
    except ParityError as exc:
        assert "output 'logits' differs between PyTorch and ONNX Runtime" in str(exc)
        assert "max abs" in str(exc) and "atol 0" in str(exc)
        assert not ws.onnx_model.exists()  # nothing half-validated is left behind
    else:  # bit-exact float results are possible but then the comparison itself must hold
        pytest.skip("ONNX Runtime matched PyTorch bit for bit")


def test_interrupted_export_leaves_no_model(tmp_path, tiny_config, monkeypatch):
    import quantkit.export as export_module

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "_compare", interrupt)
    cfg = load_config(tiny_config)
    ws = ModelWorkspace(tmp_path / "art", cfg.name)
    with pytest.raises(KeyboardInterrupt):
        export_model(cfg, ws, Console(verbosity=-1))
    assert list(ws.root.iterdir()) == []


def test_factory_edit_and_weights_make_export_stale(tmp_path, tiny_config):
    cfg = load_config(tiny_config)
    ws = ModelWorkspace(tmp_path / "art", cfg.name)
    export_model(cfg, ws, Console(verbosity=-1))
    (tmp_path / "tiny_factory.py").write_text(FACTORY_SOURCE + "\n# edited\n")
    reason = ws.staleness("export.json", export_fingerprint(cfg))
    assert reason and "factory_sha256" in reason


def test_weights_that_do_not_fit_are_a_model_error(tmp_path, tiny_config, make_config):
    weights = tmp_path / "w.pt"
    torch.save({"unrelated.weight": torch.zeros(1)}, weights)
    cfg = load_config(make_config({"model.factory": "tiny_factory:build", "model.weights": str(weights)}))
    with pytest.raises(ModelError, match=r"w.pt: weights do not fit the model: missing \['conv.weight'"):
        export_model(cfg, ModelWorkspace(tmp_path / "art", cfg.name), Console(verbosity=-1))


def test_missing_factory_module_is_a_config_error(tmp_path, make_config):
    cfg = load_config(make_config({"model.factory": "no_such_module_xyz:build"}))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        export_model(cfg, ModelWorkspace(tmp_path / "art", cfg.name), Console(verbosity=-1))


def test_existing_onnx_is_checked_and_normalised_not_reexported(tmp_path, tiny_config, make_config):
    cfg = load_config(tiny_config)
    first = ModelWorkspace(tmp_path / "a", cfg.name)
    export_model(cfg, first, Console(verbosity=-1))
    model = onnx.load(str(first.onnx_model))
    del model.graph.value_info[:]  # strip inferred shapes: normalisation must restore them
    source = tmp_path / "given.onnx"
    onnx.save(model, str(source))
    onnx_cfg = load_config(make_config({"model.source": "onnx", "model.factory": None, "model.path": str(source)}))
    ws = ModelWorkspace(tmp_path / "b", onnx_cfg.name)
    result = export_model(onnx_cfg, ws, Console(verbosity=-1))
    assert result.parity == [] and result.source == "onnx"
    assert len(onnx.load(str(ws.onnx_model)).graph.value_info) > 0


def test_onnx_source_that_disagrees_with_declared_inputs(tmp_path, tiny_config, make_config):
    cfg = load_config(tiny_config)
    first = ModelWorkspace(tmp_path / "a", cfg.name)
    export_model(cfg, first, Console(verbosity=-1))
    bad = make_config({"model.source": "onnx", "model.factory": None, "model.path": str(first.onnx_model),
                       "model.inputs": [{"name": "image", "shape": ["batch", 1, 8, 8]}]})
    with pytest.raises(ConfigError, match=r"has no input 'image'; it has \['input'\]"):
        export_model(load_config(bad), ModelWorkspace(tmp_path / "b", "x"), Console(verbosity=-1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits_cnn", "tiny_encoder"])
def test_reference_configs_export(tmp_path, name):
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs" / f"{name}.yaml")
    result = export_model(cfg, ModelWorkspace(tmp_path, cfg.name), Console(verbosity=-1))
    assert max(p.max_abs for p in result.parity) < cfg.export.parity.atol
