"""Stage 1: PyTorch (or an existing ONNX file) -> ``model.onnx`` with a parity check.

PyTorch models are exported with the TorchScript-based ``torch.onnx.export``
(``dynamo=False``): it is fast, needs no extra packages and names nodes and
tensors the way TensorRT users know (``/layer1/layer1.0/conv1/Conv``), which is
what calibration caches key on. The batch axis (and any declared dynamic axis)
stays dynamic. An existing ONNX model is checked and shape-inferred, not
re-exported. Either way the result runs through ONNX Runtime on real samples
before it is moved into place.
"""

from __future__ import annotations

import collections
import importlib
import importlib.metadata
import importlib.util
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.artifacts import Manifest, ModelWorkspace, atomic_path, library_versions, sha256_file
from quantkit.config import Config
from quantkit.data import Dataset, open_dataset
from quantkit.errors import ConfigError, DataError, ModelError, NotAvailableError, ParityError
from quantkit.ui import Console, human_size

MANIFEST = "export.json"


@dataclass(frozen=True)
class OutputParity:
    """How one output of the ONNX model compares with PyTorch."""

    name: str
    max_abs: float
    max_rel: float
    batch_size: int


@dataclass
class ExportResult:
    path: Path
    size: int
    op_histogram: dict[str, int]
    seconds: float
    parity: list[OutputParity] = field(default_factory=list)
    source: str = "torch"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "size": self.size,
            "op_histogram": self.op_histogram,
            "seconds": round(self.seconds, 3),
            "source": self.source,
            "parity": [vars(p) for p in self.parity],
        }


def export_fingerprint(cfg: Config, ws: ModelWorkspace | None = None) -> dict[str, Any]:
    """Everything ``model.onnx`` depends on, cheap to compute (no torch import); ``ws`` is unused."""
    model = cfg.model
    fingerprint: dict[str, Any] = {
        "model": model.model_dump(mode="json"),
        "export": cfg.export.model_dump(mode="json"),
        "weights_sha256": sha256_file(Path(model.weights)) if model.weights else None,
        "onnx_sha256": sha256_file(Path(model.path)) if model.path else None,
        "factory_sha256": _factory_file_hash(model.factory, _config_dir(cfg)) if model.factory else None,
        "torch": _dist_version("torch") if model.source != "onnx" else None,
        "torchvision": _dist_version("torchvision") if model.source == "torchvision" else None,
    }
    if cfg.export.reestimate_batchnorm:
        fingerprint["batchnorm_data"] = _batchnorm_dataset(cfg).fingerprint()
    return fingerprint


def export_model(cfg: Config, ws: ModelWorkspace, console: Console) -> ExportResult:
    """Write ``model.onnx`` and ``export.json`` for ``cfg``.

    Returns:
        What was written, with parity figures for PyTorch sources.

    Raises:
        ModelError / ParityError / DataError / NotAvailableError: see the messages.
    """
    start = time.perf_counter()
    fingerprint = export_fingerprint(cfg)
    if cfg.model.source == "onnx":
        parity = _normalise_onnx(cfg, ws, console)
    else:
        parity = _export_torch(cfg, ws, console)
    import onnx

    model = onnx.load(str(ws.onnx_model), load_external_data=False)
    histogram = dict(collections.Counter(node.op_type for node in model.graph.node).most_common())
    result = ExportResult(ws.onnx_model, ws.onnx_model.stat().st_size, histogram,
                          time.perf_counter() - start, parity, cfg.model.source)
    ws.write_manifest(MANIFEST, Manifest(
        stage="export",
        fingerprint=fingerprint,
        outputs={ws.onnx_model.name: sha256_file(ws.onnx_model)},
        versions=library_versions("torch", "torchvision"),
        details=result.to_json(),
    ))
    return result


def describe(result: ExportResult) -> str:
    """One summary line for the terminal."""
    ops = ", ".join(f"{op}×{n}" for op, n in list(result.op_histogram.items())[:8])
    more = ", …" if len(result.op_histogram) > 8 else ""
    text = (f"wrote {result.path} ({human_size(result.size)}, {sum(result.op_histogram.values())} nodes: "
            f"{ops}{more}) in {result.seconds:.1f} s")
    if result.parity:
        worst_abs = max(p.max_abs for p in result.parity)
        worst_rel = max(p.max_rel for p in result.parity)
        text += f"; parity vs PyTorch: max abs {worst_abs:.2e}, max rel {worst_rel:.2e}"
    return text


# --------------------------------------------------------------------------- torch


def _export_torch(cfg: Config, ws: ModelWorkspace, console: Console) -> list[OutputParity]:
    torch = _import_torch()
    module = build_torch_module(cfg)
    dataset = _calibration_dataset(cfg)
    if cfg.export.reestimate_batchnorm:
        reestimate_batchnorm(module, _batchnorm_dataset(cfg), cfg.export.reestimate_batchnorm, cfg.calibration.batch_size, console)
    module.eval()
    samples = _parity_batch(dataset, cfg.export.parity.samples)
    example = tuple(torch.from_numpy(samples[spec.name]) for spec in cfg.model.inputs)
    with torch.no_grad():
        reference = _as_outputs(module(*example))
    output_names = cfg.model.outputs or (["output"] if len(reference) == 1 else
                                         [f"output_{i}" for i in range(len(reference))])
    if len(output_names) != len(reference):
        raise ConfigError(f"model.outputs names {len(output_names)} outputs but the model returns {len(reference)}")
    dynamic_axes = {spec.name: spec.dynamic_axes for spec in cfg.model.inputs if spec.dynamic_axes}
    if cfg.model.inputs[0].dynamic_batch:
        dynamic_axes.update({name: {0: cfg.model.inputs[0].shape[0]} for name in output_names})
    console.detail(f"exporting with opset {cfg.export.opset}, dynamic axes {dynamic_axes}")
    with atomic_path(ws.onnx_model) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice is ours to own
            try:
                torch.onnx.export(
                    module, example, str(tmp), dynamo=False, opset_version=cfg.export.opset,
                    input_names=[spec.name for spec in cfg.model.inputs], output_names=output_names,
                    dynamic_axes=dynamic_axes, do_constant_folding=True,
                )
            except Exception as exc:  # noqa: BLE001 - torch raises many types; the user needs the message
                raise ModelError(f"torch.onnx.export failed: {type(exc).__name__}: {_first_line(exc)}") from exc
        _check_and_normalise(tmp, cfg.export.simplify, console)
        parity = _compare(tmp, module, samples, cfg, output_names)
    return parity


def build_torch_module(cfg: Config):
    """Instantiate the configured PyTorch module (factory or torchvision arch), weights loaded."""
    torch = _import_torch()
    model = cfg.model
    torch.manual_seed(model.seed)
    if model.source == "torchvision":
        module = _torchvision_module(model.arch)
    else:
        module = _call_factory(model.factory, model.kwargs, _config_dir(cfg))
    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"model.factory {model.factory!r} returned {type(module).__name__}, not a torch.nn.Module")
    if model.weights:
        _load_weights(module, Path(model.weights))
    return module.eval()


def _torchvision_module(arch: str):
    try:
        import torchvision
    except ImportError:
        raise NotAvailableError("source 'torchvision' needs torchvision: pip install 'quantkit[export]'") from None
    available = torchvision.models.list_models(module=torchvision.models)
    if arch not in available:
        import difflib

        close = difflib.get_close_matches(arch, available, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"model.arch: torchvision has no classification model {arch!r}{hint}")
    # weights=None: seeded random init; pretrained weights would download at run time, which we never do
    return torchvision.models.get_model(arch, weights=None)


def _call_factory(factory: str, kwargs: dict[str, Any], search_dir: Path | None = None):
    module_name, _, attr = factory.partition(":")
    if search_dir is not None and str(search_dir) not in sys.path:
        sys.path.insert(0, str(search_dir))  # a factory module may sit next to the config file
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model.factory: cannot import module {module_name!r} ({exc})") from None
    target = getattr(module, attr, None)
    if not callable(target):
        raise ConfigError(f"model.factory: module {module_name!r} has no callable {attr!r}")
    try:
        return target(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"model.kwargs do not fit {factory}: {exc}") from None


def _load_weights(module, path: Path) -> None:
    torch = _import_torch()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle, zip and torch errors alike
        raise ModelError(f"{path}: cannot load weights with torch.load(weights_only=True): {_first_line(exc)}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelError(f"{path}: expected a state_dict, got {type(state).__name__}")
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ModelError(
            f"{path}: weights do not fit the model: missing {result.missing_keys[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )


def reestimate_batchnorm(module, dataset: Dataset, samples: int, batch_size: int, console: Console) -> None:
    """Re-estimate BatchNorm running statistics on real data (cumulative average).

    Seeded random weights give activations unlike a trained network's; resetting the
    running statistics on real images makes the activations, and so calibration
    and INT8 error, realistic.
    """
    torch = _import_torch()
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        raise ConfigError("export.reestimate_batchnorm: the model has no BatchNorm layers")
    module.eval()
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative moving average over all batches
        norm.train()
    seen = 0
    with console.progress(samples, "re-estimating BatchNorm", unit="img") as bar, torch.no_grad():
        for batch in dataset.batches(batch_size):
            take = min(batch.size, samples - seen)
            module(*(torch.from_numpy(batch.inputs[k][:take]) for k in batch.inputs))
            seen += take
            bar.update(take)
            if seen >= samples:
                break
    module.eval()
    if seen < samples:
        console.warn(f"BatchNorm re-estimated on {seen} samples (asked for {samples}; the data has no more)")


def _compare(onnx_path: Path, module, samples: dict[str, np.ndarray], cfg: Config,
             output_names: list[str]) -> list[OutputParity]:
    """Run the same inputs through PyTorch and ONNX Runtime at two batch sizes."""
    torch = _import_torch()
    session = _ort_session(onnx_path)
    tol = cfg.export.parity
    count = len(next(iter(samples.values())))
    sizes = sorted({count, 1}) if cfg.model.inputs[0].dynamic_batch else [count]
    results = []
    for size in sizes:
        feed = {name: array[:size] for name, array in samples.items()}
        with torch.no_grad():
            expected = _as_outputs(module(*(torch.from_numpy(feed[s.name]) for s in cfg.model.inputs)))
        actual = session.run(output_names, feed)
        for name, want, got in zip(output_names, expected, actual):
            want = want.detach().cpu().numpy()
            if want.shape != got.shape:
                raise ParityError(f"output {name!r}: ONNX Runtime shape {list(got.shape)} != PyTorch {list(want.shape)} "
                                  f"at batch {size}")
            diff = np.abs(want.astype(np.float64) - got.astype(np.float64))
            rel = diff / np.maximum(np.abs(want.astype(np.float64)), 1e-12)
            parity = OutputParity(name, float(diff.max(initial=0.0)), float(rel.max(initial=0.0)), size)
            if not np.allclose(got, want, atol=tol.atol, rtol=tol.rtol):
                raise ParityError(
                    f"output {name!r} differs between PyTorch and ONNX Runtime at batch {size}: "
                    f"max abs {parity.max_abs:.3e}, max rel {parity.max_rel:.3e} "
                    f"(tolerance atol {tol.atol:g}, rtol {tol.rtol:g}; set export.parity to change)"
                )
            results.append(parity)
    return results


def _as_outputs(value) -> list:
    if isinstance(value, (tuple, list)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]


# --------------------------------------------------------------------------- onnx


def _normalise_onnx(cfg: Config, ws: ModelWorkspace, console: Console) -> list[OutputParity]:
    """Check an existing ONNX model against the config, shape-infer it and smoke-run it."""
    import onnx

    source = Path(cfg.model.path)
    try:
        model = onnx.load(str(source))
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors have many types
        raise ModelError(f"{source}: not a readable ONNX model ({_first_line(exc)})") from None
    _check_declared_io(source, model, cfg)
    with atomic_path(ws.onnx_model) as tmp:
        onnx.save(model, str(tmp))
        _check_and_normalise(tmp, simplify=False, console=console)
        session = _ort_session(tmp)
        feed = _parity_batch(_calibration_dataset(cfg), cfg.export.parity.samples)
        for name, value in zip([o.name for o in session.get_outputs()], session.run(None, feed)):
            if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                raise ModelError(f"{source}: output {name!r} has NaN/Inf on the calibration samples")
    return []


def _check_declared_io(source: Path, model, cfg: Config) -> None:
    import onnx

    initializers = {init.name for init in model.graph.initializer}
    graph_inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    for spec in cfg.model.inputs:
        if spec.name not in graph_inputs:
            raise ConfigError(f"model.inputs: {source} has no input {spec.name!r}; it has {sorted(graph_inputs)}")
        tensor_type = graph_inputs[spec.name].type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if np.dtype(dtype) != np.dtype(spec.dtype):
            raise ConfigError(f"model.inputs: input {spec.name!r} of {source} is {np.dtype(dtype)}, config says {spec.dtype}")
        dims = tensor_type.shape.dim
        if len(dims) != len(spec.shape):
            raise ConfigError(f"model.inputs: input {spec.name!r} of {source} has rank {len(dims)}, "
                              f"config shape {spec.shape} has {len(spec.shape)}")
        for axis, (dim, want) in enumerate(zip(dims, spec.shape)):
            if isinstance(want, str) and dim.HasField("dim_value"):
                raise ConfigError(f"model.inputs: axis {axis} of {spec.name!r} is fixed to {dim.dim_value} in "
                                  f"{source}, config declares it dynamic ({want!r})")
            if isinstance(want, int) and dim.HasField("dim_value") and dim.dim_value != want:
                raise ConfigError(f"model.inputs: axis {axis} of {spec.name!r} is {dim.dim_value} in {source}, "
                                  f"config says {want}")
    missing = extra_inputs = sorted(set(graph_inputs) - {s.name for s in cfg.model.inputs})
    if extra_inputs:
        raise ConfigError(f"model.inputs: {source} also has input(s) {missing} that the config does not declare")
    if cfg.model.outputs:
        names = [o.name for o in model.graph.output]
        if list(cfg.model.outputs) != names:
            raise ConfigError(f"model.outputs: {source} has outputs {names}, config says {cfg.model.outputs}")


def _check_and_normalise(path: Path, simplify: bool, console: Console) -> None:
    """onnx.checker, optional onnxslim simplification, shape inference; rewrites ``path``."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001 - ValidationError and shape inference errors
        raise ModelError(f"the ONNX model fails onnx.checker: {_first_line(exc)}") from None
    model = onnx.load(str(path))
    if simplify:
        model = _simplify(model, console)
    model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=False, data_prop=True)
    onnx.save(model, str(path))


def _simplify(model, console: Console):
    try:
        import onnxslim
    except ImportError:
        raise NotAvailableError("export.simplify needs onnxslim: pip install 'quantkit[export]' "
                                "(or set export.simplify: false)") from None
    before = len(model.graph.node)
    try:
        simplified = onnxslim.slim(model)
    except Exception as exc:  # noqa: BLE001 - a failed optimisation must not lose the export
        console.warn(f"onnxslim failed ({_first_line(exc)}); keeping the unsimplified model")
        return model
    console.detail(f"onnxslim: {before} -> {len(simplified.graph.node)} nodes")
    return simplified


def _ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        raise ModelError(f"ONNX Runtime cannot load the model: {_first_line(exc)}") from None


# --------------------------------------------------------------------------- helpers


def _calibration_dataset(cfg: Config) -> Dataset:
    cal = cfg.calibration
    return open_dataset(cal.data, cfg.model.inputs, fmt=cal.format, preprocess=cal.preprocess,
                        max_samples=cal.max_samples, on_bad_file=cal.on_bad_file)


def _batchnorm_dataset(cfg: Config) -> Dataset:
    """The data for BatchNorm re-estimation: export.batchnorm_data, else the calibration data."""
    cal = cfg.calibration
    path = cfg.export.batchnorm_data or cal.data
    return open_dataset(path, cfg.model.inputs, fmt=cal.format, preprocess=cal.preprocess, on_bad_file=cal.on_bad_file)


def _parity_batch(dataset: Dataset, count: int) -> dict[str, np.ndarray]:
    """The first ``count`` real samples as one batch."""
    for batch in dataset.batches(count):
        return {name: array[: batch.size] for name, array in batch.inputs.items()}
    raise DataError(f"{dataset.root}: no usable samples for the parity check")


def _import_torch():
    try:
        import torch
    except ImportError:
        raise NotAvailableError("export from PyTorch needs torch: pip install 'quantkit[export]'") from None
    return torch


def _config_dir(cfg: Config) -> Path | None:
    return cfg.source_path.parent.resolve() if cfg.source_path else None


def _factory_file_hash(factory: str, search_dir: Path | None) -> str | None:
    """Hash of the factory's module source, so code edits make model.onnx stale.

    Looks next to the config first (where _call_factory also looks), without importing.
    """
    module_name = factory.partition(":")[0]
    if search_dir is not None:
        relative = Path(*module_name.split("."))
        for candidate in (search_dir / relative.with_suffix(".py"), search_dir / relative / "__init__.py"):
            if candidate.is_file():
                return sha256_file(candidate)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    return sha256_file(Path(spec.origin))


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
