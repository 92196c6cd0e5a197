"""Name check: every TensorRT / pycuda name the backend touches exists in the real bindings.

Reads the backend's source with ``ast`` under the rule documented in
``quantkit/backends/tensorrt/surface.py`` and compares with the committed lists that
``scripts/trt_names.py`` extracted from tensorrt-cu12-bindings 10.16.1.11,
tensorrt-cu13-bindings 11.4.0.106 and pycuda 2026.1. No network, no TensorRT needed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from quantkit.backends.tensorrt import detect, surface
from quantkit.backends.tensorrt.surface import CUDA_ROLES, MODULE_MAJORS, TRT_ROLES, load_names

PACKAGE = Path(surface.__file__).resolve().parent


@dataclass
class Usage:
    trt: dict[str, int] = field(default_factory=dict)  # name -> first line
    cuda: dict[str, int] = field(default_factory=dict)
    probes: dict[str, int] = field(default_factory=dict)
    cudart: dict[str, int] = field(default_factory=dict)


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"] (root must be a plain name), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _until_dunder(parts: list[str]) -> list[str]:
    for index, part in enumerate(parts):
        if part.startswith("__") and part != "__version__":
            return parts[:index]
    return parts


def collect(source: str) -> Usage:
    """Apply the surface rule to one module's source."""
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    usage = Usage()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" \
                and len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
            owner = _chain(node.args[0])
            if owner and owner[0] == "trt":
                usage.probes.setdefault(".".join([*owner[1:], node.args[1].value]), node.lineno)
        if not isinstance(node, ast.Attribute):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            continue  # only whole chains
        parts = _chain(node)
        if parts is None:
            continue
        # the module may also be held as an attribute (self._trt, self._cuda)
        for index, part in enumerate(parts[:-1]):
            if part.lstrip("_") in ("trt", "cuda"):
                parts = [part.lstrip("_"), *parts[index + 1:]]
                break
        root, rest = parts[0], _until_dunder(parts[1:])
        if root == "trt" and rest:
            usage.trt.setdefault(".".join(rest), node.lineno)
            continue
        if root == "cuda" and rest:
            usage.cuda.setdefault(".".join(rest), node.lineno)
            continue
        if root == "cudart" or (len(parts) > 2 and parts[1] == "_cudart"):
            name = rest[0] if root == "cudart" else parts[2]
            usage.cudart.setdefault(name, node.lineno)
            continue
        for index, part in enumerate(parts[:-1]):
            role = part.lstrip("_")
            member = parts[index + 1]
            if member.startswith("__"):
                break
            if role in TRT_ROLES:
                usage.trt.setdefault(f"{TRT_ROLES[role]}.{member}", node.lineno)
            elif role in CUDA_ROLES:
                usage.cuda.setdefault(f"{CUDA_ROLES[role]}.{member}", node.lineno)
    return usage


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("*.py"))


@pytest.mark.parametrize("module", sorted(MODULE_MAJORS))
def test_every_tensorrt_name_exists_in_each_major_the_module_runs_under(module):
    usage = collect((PACKAGE / f"{module}.py").read_text())
    problems = []
    for major in MODULE_MAJORS[module]:
        names = load_names(f"trt{major}")
        problems += [f"{module}.py:{line}: {name} is not in TensorRT {major}.x"
                     for name, line in sorted(usage.trt.items(), key=lambda item: item[1]) if name not in names]
    pycuda = load_names("pycuda")
    problems += [f"{module}.py:{line}: {name} is not in pycuda" for name, line in usage.cuda.items()
                 if name not in pycuda]
    union = set().union(*(load_names(f"trt{m}") for m in ("10", "11")))
    problems += [f"{module}.py:{line}: probe {name} exists in no TensorRT version (typo?)"
                 for name, line in usage.probes.items() if name not in union]
    assert not problems, "\n".join(problems)


def test_every_module_touching_tensorrt_or_pycuda_is_registered():
    unregistered = []
    for path in _modules():
        usage = collect(path.read_text())
        if (usage.trt or usage.cuda) and path.stem not in MODULE_MAJORS:
            unregistered.append(path.name)
    assert not unregistered, f"add {unregistered} to surface.MODULE_MAJORS so their names are checked"


def test_the_check_sees_the_calls_that_matter():
    """Guard against a rule change that makes the collector silently see nothing."""
    implicit = collect((PACKAGE / "build_implicit.py").read_text())
    assert {"BuilderFlag.INT8", "BuilderFlag.FP16", "BuilderFlag.OBEY_PRECISION_CONSTRAINTS",
            "IBuilderConfig.set_calibration_profile", "IBuilderConfig.int8_calibrator", "ILayer.precision",
            "ILayer.set_output_type", "float16"} <= set(implicit.trt)
    runner = collect((PACKAGE / "runner.py").read_text())
    assert {"IExecutionContext.execute_async_v3", "IExecutionContext.set_tensor_address",
            "IExecutionContext.set_optimization_profile_async", "ICudaEngine.get_tensor_profile_shape",
            "Runtime.deserialize_cuda_engine"} <= set(runner.trt)
    assert {"memcpy_htod_async", "memcpy_dtoh_async", "pagelocked_empty", "mem_alloc", "Stream.synchronize",
            "Event.time_till", "Context.pop", "DeviceAllocation.free"} <= set(runner.cuda)
    network = collect((PACKAGE / "network.py").read_text())
    assert {"IBuilderConfig.set_memory_pool_limit", "MemoryPoolType.WORKSPACE", "OnnxParser.get_error",
            "ParserError.desc", "IOptimizationProfile.set_shape", "ITimingCache.serialize"} <= set(network.trt)
    assert {"IInt8EntropyCalibrator2"} <= set(collect((PACKAGE / "calibrator.py").read_text()).trt)


def test_the_check_catches_a_name_missing_in_11():
    usage = collect("def f(trt, config, layer):\n"
                    "    config.int8_calibrator = None\n"
                    "    layer.precision = trt.float16\n"
                    "    config.set_flag(trt.BuilderFlag.FP16)\n")
    missing = {name for name in usage.trt if name not in load_names("trt11")}
    assert missing == {"IBuilderConfig.int8_calibrator", "ILayer.precision", "BuilderFlag.FP16"}


def test_name_lists_hold_the_known_facts():
    trt10, trt11, pycuda = load_names("trt10"), load_names("trt11"), load_names("pycuda")
    assert "IInt8EntropyCalibrator2" in trt10 and "IInt8EntropyCalibrator2" not in trt11
    assert "IExecutionContext.execute_async_v3" in trt10 & trt11
    assert "BuilderFlag.INT8" in trt10 and "BuilderFlag.INT8" not in trt11
    assert "NetworkDefinitionCreationFlag.STRONGLY_TYPED" in trt10 & trt11
    assert "IExecutionContext.execute_async_v2" not in trt10  # removed in 10.0
    assert {"memcpy_htod_async", "Device.retain_primary_context", "Stream.handle"} <= pycuda
    assert len(trt10) > 2000 and len(trt11) > 1800


def test_implicit_path_probes_match_the_real_bindings():
    trt10, trt11 = load_names("trt10"), load_names("trt11")
    probes = [(owner.removeprefix("trt").lstrip("."), name) for owner, name in detect._IMPLICIT_NEEDS]
    qualified = [f"{owner}.{name}" if owner else name for owner, name in probes]
    assert all(name in trt10 for name in qualified), [n for n in qualified if n not in trt10]
    assert not any(name in trt11 for name in qualified), [n for n in qualified if n in trt11]


def test_detection_on_fakes_of_both_majors(make_gpu):
    assert detect.available_paths(make_gpu(10).trt) == ["implicit", "explicit"]
    assert detect.available_paths(make_gpu(11).trt) == ["explicit"]


def test_cuda_graph_helper_uses_real_cuda_python_names():
    cudart = pytest.importorskip("cuda.bindings.runtime")
    usage = collect((PACKAGE / "cudagraph.py").read_text())
    assert {"cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaGraphLaunch"} \
        <= set(usage.cudart)
    missing = [name for name in usage.cudart if not hasattr(cudart, name)]
    assert not missing
    assert hasattr(cudart.cudaStreamCaptureMode, "cudaStreamCaptureModeThreadLocal")
