"""Per-model YAML configs, validated strictly into typed objects before any work.

Unknown keys fail with a "did you mean" hint and the YAML line; wrong types,
missing files and impossible combinations fail up front with
:class:`~quantkit.errors.ConfigError` (exit code 2). CLI options override YAML
keys through dotted paths (``calibration.batch_size``) before validation, so an
override is checked exactly like the file.

Relative paths in a config are resolved against the config file's directory.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SerializationInfo, ValidationError, ValidationInfo,
                      field_serializer, field_validator, model_validator)

from quantkit.errors import ConfigError
from quantkit.gates import Gate, parse_gate

# The header version TensorRT 10.16.1 writes (major*10000 + minor*100 + patch):
# a cache whose header does not match the running TensorRT is silently ignored.
DEFAULT_TRT_CACHE_VERSION = 101601

DType = Literal["float32", "float16", "int64", "int32", "int8", "uint8", "bool"]
FLOAT_DTYPES = ("float32", "float16")
CalibMethod = Literal["entropy", "minmax", "percentile", "mse"]
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Section(BaseModel):
    # strict: YAML already gives typed values, so "32" for an int is a mistake, not a coercion.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _resolve_path(value: str | None, info: ValidationInfo, must_exist: bool = True) -> str | None:
    """Resolve ``value`` against the config's directory and check it exists."""
    if value is None:
        return None
    base = Path((info.context or {}).get("base_dir", "."))
    path = (base / value).resolve()
    if must_exist and not path.exists():
        raise ValueError(f"path does not exist: {path}")
    return str(path)


class InputSpec(_Section):
    """One model input.

    ``shape`` lists every dimension; a string marks a dynamic axis and names it
    (``[batch, 3, 224, 224]``). The first axis is the batch axis.
    """

    name: str = Field(min_length=1)
    shape: list[int | str] = Field(min_length=1)
    dtype: DType = "float32"

    @field_validator("shape")
    @classmethod
    def _dims_positive(cls, shape: list[int | str]) -> list[int | str]:
        for dim in shape:
            if isinstance(dim, int) and dim < 1:
                raise ValueError(f"dimension {dim} must be >= 1 (or a name for a dynamic axis)")
            if isinstance(dim, str) and not dim.isidentifier():
                raise ValueError(f"dynamic axis name {dim!r} must be an identifier")
        return shape

    @property
    def dynamic_batch(self) -> bool:
        return isinstance(self.shape[0], str)

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}

    def sample_shape(self) -> list[int | str]:
        """The shape without the batch axis."""
        return self.shape[1:]


class ModelSection(_Section):
    """Where the model comes from and what its inputs are."""

    source: Literal["torch", "torchvision", "onnx"]
    factory: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: str | None = None
    arch: str | None = None
    seed: int = 0
    path: str | None = None
    inputs: list[InputSpec] = Field(min_length=1)
    outputs: list[str] | None = None

    @field_validator("weights", "path")
    @classmethod
    def _existing_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _resolve_path(value, info)

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str | None) -> str | None:
        if value is not None and not _FACTORY_RE.match(value):
            raise ValueError(f"factory {value!r} must look like 'package.module:callable'")
        return value

    @model_validator(mode="after")
    def _source_fields(self) -> "ModelSection":
        needs = {"torch": ["factory"], "torchvision": ["arch"], "onnx": ["path"]}
        forbids = {
            "torch": ["arch", "path"],
            "torchvision": ["factory", "path"],
            "onnx": ["factory", "arch", "weights"],
        }
        for key in needs[self.source]:
            if getattr(self, key) is None:
                raise ValueError(f"source {self.source!r} needs model.{key}")
        for key in forbids[self.source]:
            if getattr(self, key) is not None:
                raise ValueError(f"model.{key} does not apply to source {self.source!r}")
        if self.kwargs and self.source != "torch":
            raise ValueError(f"model.kwargs does not apply to source {self.source!r}")
        names = [spec.name for spec in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"input names must be unique, got {names}")
        return self


class ParitySection(_Section):
    """How closely the ONNX export must match PyTorch (numpy.allclose semantics)."""

    atol: float = Field(default=1e-4, ge=0)
    rtol: float = Field(default=1e-3, ge=0)
    samples: int = Field(default=4, ge=1)


class ExportSection(_Section):
    opset: int = Field(default=17, ge=13, le=21)
    simplify: bool = True
    parity: ParitySection = Field(default_factory=ParitySection)
    reestimate_batchnorm: int = Field(default=0, ge=0)
    batchnorm_data: str | None = None

    @field_validator("batchnorm_data")
    @classmethod
    def _existing_bn_data(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _resolve_path(value, info)


class PreprocessSection(_Section):
    """Image preprocessing, shared by calibration and benchmarking."""

    resize: int | list[int] | None = None
    center_crop: int | list[int] | None = None
    interpolation: Literal["nearest", "bilinear", "bicubic"] = "bilinear"
    color: Literal["rgb", "bgr", "gray"] = "rgb"
    scale: float = Field(default=1 / 255, gt=0)
    mean: list[float] | None = None
    std: list[float] | None = None
    layout: Literal["nchw", "nhwc"] = "nchw"

    @field_validator("resize", "center_crop")
    @classmethod
    def _size(cls, value: int | list[int] | None) -> int | list[int] | None:
        sizes = [value] if isinstance(value, int) else value or []
        if isinstance(value, list) and len(value) != 2:
            raise ValueError("expected a size N or [height, width]")
        if any(size < 1 for size in sizes):
            raise ValueError("sizes must be >= 1")
        return value

    @field_validator("std")
    @classmethod
    def _std_nonzero(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and any(s == 0 for s in value):
            raise ValueError("std values must be non-zero")
        return value

    @property
    def channels(self) -> int:
        return 1 if self.color == "gray" else 3


class MethodOverride(_Section):
    method: CalibMethod
    percentile: float | None = Field(default=None, gt=0, le=100)


class CalibrationSection(_Section):
    data: str
    format: Literal["auto", "images", "numpy"] = "auto"
    preprocess: PreprocessSection = Field(default_factory=PreprocessSection)
    batch_size: int = Field(default=32, ge=1)
    max_samples: int | None = Field(default=None, ge=1)
    remainder: Literal["keep", "drop", "pad"] = "keep"
    on_bad_file: Literal["error", "skip"] = "error"
    method: CalibMethod = "entropy"
    percentile: float = Field(default=99.99, gt=0, le=100)
    overrides: dict[str, MethodOverride] = Field(default_factory=dict)
    trt_cache_version: int = Field(default=DEFAULT_TRT_CACHE_VERSION, ge=1)
    memory_limit_mb: int = Field(default=1024, ge=16)

    @field_validator("data")
    @classmethod
    def _existing_data(cls, value: str, info: ValidationInfo) -> str:
        return _resolve_path(value, info)


class ProfileSection(_Section):
    """Batch sizes of the optimization profile (TensorRT) and the allowed bench range."""

    min: int = Field(default=1, ge=1)
    opt: int = Field(default=8, ge=1)
    max: int = Field(default=32, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "ProfileSection":
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}/{self.opt}/{self.max}")
        return self


class AutoFallbackSection(_Section):
    """``build.fallback.auto``: keep the nodes whose quantization hurts most in float (docs/sensitivity.md).

    The search measures on the evaluation data (``bench.data``) and picks the smallest set of
    nodes that meets ``metric >= target`` against FP32, at most ``max_nodes`` nodes or
    ``max_fraction`` of the quantizable nodes (10 % when neither is set).
    """

    enabled: bool = True
    metric: Literal["top1_agreement", "cosine"] = "top1_agreement"
    target: float = Field(default=0.99, gt=0, le=1)
    max_fraction: float | None = Field(default=None, gt=0, le=1)
    max_nodes: int | None = Field(default=None, ge=1)
    candidates: int = Field(default=16, ge=1)
    samples: int | None = Field(default=64, ge=1)
    holdout: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _combinations(self) -> "AutoFallbackSection":
        if self.max_fraction is not None and self.max_nodes is not None:
            raise ValueError("max_nodes and max_fraction both cap the fallback set: set one of them")
        if self.holdout and self.samples is not None:
            held = round(self.samples * self.holdout)
            if held < 1 or held >= self.samples:
                raise ValueError(f"holdout {self.holdout:g} of {self.samples} samples leaves no samples to "
                                 f"{'report on' if held < 1 else 'select on'}")
        return self

    def cap(self, quantizable: int) -> int:
        """The most nodes the search may keep in float, out of ``quantizable``."""
        if self.max_nodes is not None:
            return self.max_nodes
        fraction = 0.10 if self.max_fraction is None else self.max_fraction
        return int(math.floor(fraction * quantizable + 1e-9))

    def search_settings(self) -> dict[str, Any]:
        """What the search's result depends on (``enabled`` does not change it)."""
        return self.model_dump(mode="json", exclude={"enabled"})


class FallbackSection(_Section):
    """``build.fallback`` in its mapping form: patterns plus the automatic search."""

    nodes: list[str] = Field(default_factory=list)
    auto: AutoFallbackSection | None = None


class BuildSection(_Section):
    backend: Literal["auto", "onnxruntime", "tensorrt"] = "auto"
    # a list of patterns (the original form) or {nodes: [...], auto: {...}}
    fallback: FallbackSection = Field(default_factory=FallbackSection)
    workspace_mb: int = Field(default=2048, ge=1)
    profile: ProfileSection = Field(default_factory=ProfileSection)
    # search: time FP32 vs INT8 and keep input-side stages in float where that clearly pays;
    # measure: time and report only (placement from config + calibration alone); off: no timing
    speed_guard: Literal["search", "measure", "off"] = "search"

    @field_validator("fallback", mode="before")
    @classmethod
    def _list_form(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {"nodes": value}
        if value is None or not isinstance(value, (dict, FallbackSection)):
            raise ValueError("expected a list of node patterns or a mapping {nodes: [...], auto: {...}}")
        return value

    @field_serializer("fallback")
    def _dump_fallback(self, value: FallbackSection, info: SerializationInfo) -> Any:
        # without auto, dump the list form: configs and build fingerprints from before auto stay equal
        return list(value.nodes) if value.auto is None else value.model_dump(mode=info.mode)

    @property
    def fallback_patterns(self) -> list[str]:
        """Node names, globs or op types to keep in float (``build.fallback`` or ``build.fallback.nodes``)."""
        return list(self.fallback.nodes)

    @property
    def auto_fallback(self) -> AutoFallbackSection | None:
        """The automatic fallback settings when enabled, else None."""
        auto = self.fallback.auto
        return auto if auto is not None and auto.enabled else None


class BenchSection(_Section):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    warmup_ms: int = Field(default=200, ge=0)
    duration_s: float = Field(default=3.0, gt=0)
    min_iterations: int = Field(default=10, ge=1)
    repeats: int = Field(default=3, ge=1)
    threads: int | None = Field(default=None, ge=1)
    data: str | None = None
    labels: Literal["auto", "none"] = "auto"
    max_samples: int | None = Field(default=None, ge=1)
    gates: list[str] = Field(default_factory=list)

    @field_validator("data")
    @classmethod
    def _existing_data(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _resolve_path(value, info)

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, sizes: list[int]) -> list[int]:
        if any(size < 1 for size in sizes):
            raise ValueError("batch sizes must be >= 1")
        return sizes

    @field_validator("gates")
    @classmethod
    def _parse_gates(cls, gates: list[str]) -> list[str]:
        for text in gates:
            parse_gate(text)  # raises ValueError with the reason
        return gates

    def parsed_gates(self) -> list[Gate]:
        return [parse_gate(text) for text in self.gates]


class Config(_Section):
    """A validated per-model config."""

    name: str
    description: str = ""
    model: ModelSection
    export: ExportSection = Field(default_factory=ExportSection)
    calibration: CalibrationSection
    build: BuildSection = Field(default_factory=BuildSection)
    bench: BenchSection = Field(default_factory=BenchSection)
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source_path(self) -> Path | None:
        """The YAML file this config was read from."""
        return self._source

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError("name must be letters, digits, '.', '_' or '-' (it names a directory)")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        _check_images_fit_inputs(self)
        _check_batch_ranges(self)
        if self.export.reestimate_batchnorm and self.model.source == "onnx":
            raise ValueError("export.reestimate_batchnorm needs a PyTorch model, not source 'onnx'")
        for gate in self.bench.parsed_gates():
            if gate.needs_labels and self.bench.labels == "none":
                raise ValueError(f"gate {gate.text!r} needs labels but bench.labels is 'none'")
        return self


def _check_images_fit_inputs(cfg: Config) -> None:
    """An image dataset feeds exactly one float NCHW/NHWC input of the right channel count."""
    if cfg.calibration.format != "images" and not _looks_like_image_data(cfg):
        return
    inputs = cfg.model.inputs
    if len(inputs) != 1:
        raise ValueError(f"image data feeds one input, but the model declares {len(inputs)}; use .npz data")
    spec, pre = inputs[0], cfg.calibration.preprocess
    if spec.dtype not in FLOAT_DTYPES or len(spec.shape) != 4:
        raise ValueError(f"image data needs a 4-D float input, but {spec.name!r} is {spec.dtype} {spec.shape}")
    channel_axis = 1 if pre.layout == "nchw" else 3
    channels = spec.shape[channel_axis]
    if isinstance(channels, int) and channels != pre.channels:
        raise ValueError(
            f"input {spec.name!r} has {channels} channels at axis {channel_axis} ({pre.layout}) "
            f"but preprocess.color {pre.color!r} gives {pre.channels}"
        )
    for key in ("mean", "std"):
        values = getattr(pre, key)
        if values is not None and len(values) != pre.channels:
            raise ValueError(f"calibration.preprocess.{key} needs {pre.channels} values, got {len(values)}")
    _check_spatial_size(spec, pre)


def _check_spatial_size(spec: InputSpec, pre: PreprocessSection) -> None:
    hw_axes = (2, 3) if pre.layout == "nchw" else (1, 2)
    want = [spec.shape[a] for a in hw_axes]
    crop = [pre.center_crop] * 2 if isinstance(pre.center_crop, int) else pre.center_crop
    resize = pre.resize
    if crop is not None and isinstance(resize, list) and (crop[0] > resize[0] or crop[1] > resize[1]):
        raise ValueError(f"center_crop {crop} is larger than resize {resize}")
    produced = crop if crop is not None else (resize if isinstance(resize, list) else None)
    if produced is not None and all(isinstance(w, int) for w in want) and list(produced) != want:
        raise ValueError(f"preprocessing produces {produced[0]}x{produced[1]} images but input {spec.name!r} "
                         f"expects {want[0]}x{want[1]}")


def _looks_like_image_data(cfg: Config) -> bool:
    from quantkit.data import detect_format

    try:
        return detect_format(Path(cfg.calibration.data), cfg.calibration.format) == "images"
    except Exception:  # noqa: BLE001 - a bad data dir is reported by the loader with a better message
        return False


def _check_batch_ranges(cfg: Config) -> None:
    profile = cfg.build.profile
    first = cfg.model.inputs[0].shape[0]
    if isinstance(first, int) and not profile.min == profile.opt == profile.max == first:
        raise ValueError(
            f"input {cfg.model.inputs[0].name!r} has a fixed batch of {first}; set build.profile "
            f"min/opt/max to {first} or make the batch axis dynamic (a name, e.g. 'batch')"
        )
    outside = [b for b in cfg.bench.batch_sizes if not profile.min <= b <= profile.max]
    if outside:
        raise ValueError(
            f"bench.batch_sizes {outside} lie outside build.profile [{profile.min}, {profile.max}]"
        )
    if cfg.build.backend == "tensorrt" and cfg.calibration.batch_size != profile.opt:
        raise ValueError(
            f"TensorRT calibrates at the profile's OPT shape: calibration.batch_size "
            f"({cfg.calibration.batch_size}) must equal build.profile.opt ({profile.opt})"
        )


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read, merge and validate a config file.

    Args:
        path: the YAML file.
        overrides: dotted key -> value from the command line (None values are ignored).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: naming the file, the line (where known), the key and what was expected.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    raw, lines = _parse_yaml(path, text)
    overridden = {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, dotted, value)
            overridden[tuple(dotted.split("."))] = dotted
    try:
        cfg = Config.model_validate(raw, context={"base_dir": str(path.parent.resolve())})
    except ValidationError as exc:
        messages = [_format_error(path, err, lines, overridden) for err in exc.errors()]
        more = f" (and {len(messages) - 1} more; `quantkit validate {path}` lists all)" if len(messages) > 1 else ""
        error = ConfigError(messages[0] + more)
        error.all_messages = messages  # type: ignore[attr-defined]
        raise error from None
    cfg._source = path
    return cfg


def _parse_yaml(path: Path, text: str) -> tuple[dict, dict[tuple, int]]:
    """YAML -> (plain data, key path -> 1-based line). Duplicate keys are an error."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if node is None:
        raise ConfigError(f"{path}: config file is empty")
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: expected a mapping of sections at the top level")
    lines: dict[tuple, int] = {}
    _index_lines(path, node, (), lines)
    data = yaml.load(text, Loader=yaml.SafeLoader)
    return data, lines


def _index_lines(path: Path, node: yaml.Node, prefix: tuple, lines: dict[tuple, int]) -> None:
    lines[prefix] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if key_node.tag != "tag:yaml.org,2002:str" else key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{path}:{line}: duplicate key {_dotted(prefix + (key,))!r} (first at line {seen[key]})")
            seen[key] = line
            lines[prefix + (key,)] = line
            _index_lines(path, value_node, prefix + (key,), lines)
            lines[prefix + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _index_lines(path, item, prefix + (index,), lines)


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    target = raw
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise ConfigError(f"cannot override {dotted}: {key} is not a section")
    target[keys[-1]] = copy.deepcopy(value)


def _dotted(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _format_error(path: Path, err: Mapping[str, Any], lines: dict[tuple, int], overridden: dict) -> str:
    loc = tuple(part for part in err["loc"] if not _is_union_tag(part))
    where = f"{path}"
    if loc in overridden or loc[:-1] in overridden:
        where = f"{path} (set on the command line)"
    else:
        for cut in range(len(loc), -1, -1):
            if loc[:cut] in lines:
                where = f"{path}:{lines[loc[:cut]]}"
                break
    key = _dotted(loc) or "<top level>"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"expected one of: {', '.join(allowed)}"
        return f"{where}: {key}: unknown key ({hint})"
    if kind == "missing":
        return f"{where}: {key}: required key is missing"
    message = err["msg"]
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    if kind in ("literal_error",) or kind.endswith("_type") or kind.endswith("_parsing"):
        message = f"{message}, got {err.get('input')!r}"
    return f"{where}: {key}: {message}"


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the union member's type to a loc ('int', 'list[int]'); users never wrote those
    return isinstance(part, str) and (part in ("int", "str", "float", "bool", "none") or "[" in part
                                      or part.startswith("function-"))


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the section at ``loc`` (for "did you mean")."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        field = model.model_fields.get(part)
        if field is None:
            # inside a dict field keyed by user names (calibration.overrides.<pattern>)
            continue
        model = _inner_model(field.annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside list[...]/dict[..., ...]/Optional[...], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        inner = _inner_model(arg)
        if inner is not None:
            return inner
    return None


def dump_config(cfg: Config) -> str:
    """The merged, validated config as YAML (defaults filled in, paths absolute)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=None)
