"""Contract tests of the engine build against the recording fake of TensorRT 10 and 11."""

from __future__ import annotations

import json
import sys

import pytest

from backends.tensorrt.conftest import OPT_BATCH, PROFILE, make_batches
from backends.tensorrt.trt_testmodels import save
from quantkit.artifacts import Manifest
from quantkit.backends.tensorrt.engine import build_engine_trt, engine_manifest_path
from quantkit.calib.cache import ALGORITHM_ENTROPY2, write_trt_cache
from quantkit.errors import (ConfigError, DataError, MissingArtifactError, ModelError, NotAvailableError)

FP16_NODES = ["/conv/Conv", "/fc/Gemm"]


def build(workspace, kwargs, calib_cache=None, **overrides):
    return build_engine_trt(workspace.onnx_fp32, workspace.qdq_model, calib_cache, workspace.engine,
                            **{**kwargs, **overrides})


def our_cache(path, version=101601, algorithm=ALGORITHM_ENTROPY2):
    path.write_bytes(write_trt_cache({"input": 0.02, "/conv/Conv_output_0": 0.05}, version, algorithm))
    return path


# ---------------------------------------------------------------------------- TensorRT 10: implicit


def test_implicit_sets_int8_fp16_and_obey_flags_and_the_workspace(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)
    details = build(workspace, build_kwargs)
    assert details["path"] == "implicit"
    assert [flag.member for (flag,) in gpu.called("IBuilderConfig.set_flag")] == \
        ["INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS"]
    [(pool, size)] = gpu.called("IBuilderConfig.set_memory_pool_limit")
    assert (pool.member, size) == ("WORKSPACE", 64 << 20)
    assert gpu.called("Builder.create_network") == [(0,)]


def test_implicit_profile_and_calibration_profile(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)
    build(workspace, build_kwargs)
    assert gpu.called("IOptimizationProfile.set_shape") == [("input", (1, 1, 8, 8), (4, 1, 8, 8), (8, 1, 8, 8))]
    [(added,)] = gpu.called("IBuilderConfig.add_optimization_profile")
    [(calibration,)] = gpu.called("IBuilderConfig.set_calibration_profile")
    assert calibration is added
    # profiles are configured before the build starts
    order = gpu.order("IBuilderConfig.set_calibration_profile", "IBuilderConfig.int8_calibrator=",
                      "Builder.build_serialized_network")
    assert order == ["IBuilderConfig.set_calibration_profile", "IBuilderConfig.int8_calibrator=",
                     "Builder.build_serialized_network"]


def test_valid_cache_is_read_first_and_no_batch_is_requested(make_gpu, workspace, build_kwargs, tmp_path):
    gpu = make_gpu(10)
    cache = our_cache(tmp_path / "calib.cache")
    details = build(workspace, build_kwargs, calib_cache=cache)
    assert gpu.calibration.cache_read == cache.read_bytes()
    assert gpu.calibration.batches == []
    assert details["calibration"]["source"] == "calib.cache"
    assert details["calibration"]["callbacks"] == {"read_calibration_cache": 1}
    assert not gpu.called("mem_alloc")  # no device buffer for batches was needed
    assert gpu.called("IInt8EntropyCalibrator2.__init__") == [()]


def test_without_cache_batches_of_the_opt_shape_are_fed_and_the_written_cache_saved(
        make_gpu, workspace, build_kwargs, console):
    gpu = make_gpu(10)
    details = build(workspace, build_kwargs)
    calibration = details["calibration"]
    assert calibration["source"] == "gpu"
    assert gpu.calibration.cache_read is None
    assert gpu.calibration.batches == [[(OPT_BATCH, 1, 8, 8)]] * 3  # the short remainder batch is skipped
    assert calibration["batches_fed"] == 3 and calibration["short_batches_skipped"] == 1
    written = workspace.engine.with_name("model.trt_calib.cache")
    assert calibration["written_cache"] == str(written)
    assert written.read_bytes() == gpu.calibration.written
    assert gpu.calibration.batch_size == OPT_BATCH
    # the fed buffers are freed once the build is over
    assert len(gpu.called("DeviceAllocation.free")) == len(gpu.called("mem_alloc")) == 1
    assert any("calibrating on the GPU" in line for line in console.infos)


def test_cache_with_another_tensorrt_version_is_not_used_and_warned_about(make_gpu, workspace, build_kwargs,
                                                                          console, tmp_path):
    gpu = make_gpu(10)
    cache = our_cache(tmp_path / "calib.cache", version=100300)
    details = build(workspace, build_kwargs, calib_cache=cache)
    assert gpu.calibration.cache_read is None
    assert details["calibration"]["batches_fed"] == 3
    assert any("TRT-100300-EntropyCalibration2" in w and "101601" in w for w in console.warnings)


def test_no_cache_and_no_data_is_a_clear_error(make_gpu, workspace, build_kwargs):
    make_gpu(10)
    with pytest.raises(ConfigError, match="calibration cache or calibration data"):
        build(workspace, build_kwargs, calibration_batches=None)


def test_fp16_on_exactly_the_configured_layers(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)
    details = build(workspace, build_kwargs, fp16_nodes=FP16_NODES)
    precision_set = [args[0].member for args in gpu.called("ILayer.precision=")]
    assert precision_set == ["HALF"] * 3  # conv, gemm matmul, gemm bias; not gemm's weight constant
    retyped = [(name, index, dtype.member) for name, index, dtype in gpu.called("ILayer.set_output_type")]
    assert retyped == [("/conv/Conv", 0, "HALF"), ("/fc/Gemm", 0, "HALF"), ("/fc/Gemm_bias", 0, "HALF")]
    layers = details["layers"]
    assert {node for node, entry in layers.items() if entry["requested"] == "fp16"} == set(FP16_NODES)
    assert layers["/fc/Gemm"]["layers"] == ["/fc/Gemm_weights", "/fc/Gemm", "/fc/Gemm_bias"]
    assert layers["/Shape"]["requested"] == "n/a" and layers["/relu/Relu"]["requested"] == "int8"


def test_fp16_node_on_a_network_output_keeps_the_output_type(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)
    build(workspace, build_kwargs, fp16_nodes=["/Softmax"])
    assert [a[0].member for a in gpu.called("ILayer.precision=")] == ["HALF"]
    assert gpu.called("ILayer.set_output_type") == []  # "logits" is a network output


def test_unknown_or_shape_only_fp16_node_is_refused(make_gpu, workspace, build_kwargs):
    make_gpu(10)
    with pytest.raises(ConfigError, match="/conv/Conv_typo"):
        build(workspace, build_kwargs, fp16_nodes=["/conv/Conv_typo"])
    with pytest.raises(ConfigError, match="/Shape"):
        build(workspace, build_kwargs, fp16_nodes=["/Shape"])


def test_exception_in_a_calibrator_callback_surfaces_after_the_build(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)

    def broken():
        yield from make_batches(count=1)()
        raise RuntimeError("disk vanished")

    with pytest.raises(ModelError, match="get_batch.*disk vanished"):
        build(workspace, build_kwargs, calibration_batches=broken)
    assert gpu.called("Builder.build_serialized_network")  # TensorRT itself carried on
    assert not workspace.engine.exists()
    assert gpu.context_stack == []


def test_batch_with_a_wrong_shape_is_a_data_error(make_gpu, workspace, build_kwargs):
    make_gpu(10)
    with pytest.raises(DataError, match="OPT shape"):
        build(workspace, build_kwargs, calibration_batches=make_batches(count=2, batch=OPT_BATCH + 1))


def test_build_returning_none_is_a_model_error_and_pops_the_context(make_gpu, workspace, build_kwargs, tmp_path):
    gpu = make_gpu(10, build_returns_none=True)
    with pytest.raises(ModelError, match="returned None"):
        build(workspace, build_kwargs, calib_cache=our_cache(tmp_path / "calib.cache"))
    assert not workspace.engine.exists()
    assert gpu.order("Context.push", "Context.pop") == ["Context.push", "Context.pop"]
    assert gpu.context_stack == []


def test_parser_errors_name_the_node(make_gpu, workspace, build_kwargs):
    import onnx

    make_gpu(10)
    model = onnx.load(str(workspace.onnx_fp32))
    model.graph.node[1].op_type = "UnsupportedOp"
    save(model, workspace.onnx_fp32)
    with pytest.raises(ModelError, match=r"node /relu/Relu \(UnsupportedOp\): no importer registered"):
        build(workspace, build_kwargs)


def test_timing_cache_is_loaded_and_saved(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)
    workspace.timing_cache.parent.mkdir(parents=True, exist_ok=True)
    workspace.timing_cache.write_bytes(b"previous-cache")
    details = build(workspace, build_kwargs)
    assert gpu.called("IBuilderConfig.create_timing_cache") == [(b"previous-cache",)]
    assert [args[1] for args in gpu.called("IBuilderConfig.set_timing_cache")] == [False]
    assert workspace.timing_cache.read_bytes().startswith(b"fake-timing-cache:")
    assert details["timing_cache"] == str(workspace.timing_cache)


def test_foreign_timing_cache_is_replaced_by_an_empty_one(make_gpu, workspace, build_kwargs, console):
    gpu = make_gpu(10, reject_timing_cache=True)
    workspace.timing_cache.parent.mkdir(parents=True, exist_ok=True)
    workspace.timing_cache.write_bytes(b"from-another-gpu")
    build(workspace, build_kwargs)
    assert [args[0] for args in gpu.called("IBuilderConfig.create_timing_cache")] == [b"from-another-gpu", b""]
    assert any("timing cache" in w for w in console.warnings)


def test_engine_and_manifest_are_written(make_gpu, workspace, build_kwargs, tmp_path):
    make_gpu(10, gpu_name="NVIDIA L4", compute_capability=(8, 9))
    cache = our_cache(tmp_path / "calib.cache")
    details = build(workspace, build_kwargs, calib_cache=cache, fp16_nodes=["/conv/Conv"])
    assert json.loads(workspace.engine.read_bytes())["fake_trt_plan"] == 10
    assert details["tensorrt_version"] == "10.16.1.11"
    assert details["gpu"] == {"name": "NVIDIA L4", "compute_capability": "8.9"}
    manifest = Manifest.read(engine_manifest_path(workspace.engine))
    assert manifest.details == {"tensorrt_version": "10.16.1.11", "gpu_name": "NVIDIA L4",
                                "compute_capability": "8.9"}
    assert manifest.fingerprint["calib_cache"] and manifest.fingerprint["onnx_fp32"]
    assert manifest.fingerprint["fp16_nodes"] == ["/conv/Conv"]
    assert set(manifest.outputs) == {"model.engine"}
    leftovers = [p.name for p in workspace.root.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_dynamic_non_batch_axis_takes_its_size_from_the_data(make_gpu, workspace, build_kwargs):
    from quantkit.config import InputSpec

    gpu = make_gpu(10)
    specs = [InputSpec(name="input", shape=["batch", 1, "height", "width"])]
    build(workspace, build_kwargs, input_specs=specs)
    assert gpu.called("IOptimizationProfile.set_shape")[0][1:] == ((1, 1, 8, 8), (4, 1, 8, 8), (8, 1, 8, 8))
    with pytest.raises(ConfigError, match="dynamic and no calibration data"):
        build(workspace, build_kwargs, input_specs=specs, calibration_batches=None,
              calib_cache=our_cache(workspace.root / "calib.cache"))


# ---------------------------------------------------------------------------- TensorRT 11: explicit


def test_explicit_on_11_sets_no_precision_flag_and_parses_the_typed_qdq_model(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(11)
    details = build(workspace, build_kwargs, fp16_nodes=["/relu/Relu"])
    assert details["path"] == "explicit"
    assert gpu.called("IBuilderConfig.set_flag") == []
    assert gpu.called("Builder.create_network") == [(0,)]  # strongly typed is the only mode in 11
    assert gpu.called("ILayer.precision=") == [] and gpu.called("ILayer.set_output_type") == []
    [parsed] = gpu.parsed_models
    ops = [node.op_type for node in parsed.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops and ops.count("Cast") == 2
    assert gpu.called("OnnxParser.parse") == [(str(workspace.root / "model.typed.onnx"),)]
    assert details["layers"]["/relu/Relu"] == {"requested": "fp16"}
    assert details["layers"]["/conv/Conv"] == {"requested": "int8"}
    assert details["layers"]["/Softmax"] == {"requested": "fp32"}
    assert gpu.calibration.batch_size is None  # nothing calibrates on this path
    assert gpu.called("IOptimizationProfile.set_shape") == [("input", (1, 1, 8, 8), (4, 1, 8, 8), (8, 1, 8, 8))]


def test_explicit_on_10_opts_in_to_strong_typing(make_gpu, workspace, build_kwargs):
    gpu = make_gpu(10)
    details = build(workspace, build_kwargs, path="explicit")
    assert gpu.called("Builder.create_network") == [(gpu.flag_bit("STRONGLY_TYPED"),)]
    assert gpu.called("IBuilderConfig.set_flag") == []
    assert details["strongly_typed_flag"] is True


@pytest.mark.parametrize("major, expected", [(10, "implicit"), (11, "explicit")])
def test_auto_picks_the_path_by_features(make_gpu, workspace, build_kwargs, major, expected):
    make_gpu(major)
    assert build(workspace, build_kwargs)["path"] == expected


def test_implicit_request_on_11_is_not_available(make_gpu, workspace, build_kwargs):
    make_gpu(11)
    with pytest.raises(NotAvailableError, match=r"implicit build path needs trt\.IInt8EntropyCalibrator2.*"
                                                r"use path 'explicit' instead"):
        build(workspace, build_kwargs, path="implicit")


def test_explicit_without_the_qdq_model_is_a_missing_artifact(make_gpu, workspace, build_kwargs):
    make_gpu(11)
    with pytest.raises(MissingArtifactError, match="Q/DQ"):
        build_engine_trt(workspace.onnx_fp32, None, None, workspace.engine, **build_kwargs)


def test_unknown_path_is_a_config_error(make_gpu, workspace, build_kwargs):
    make_gpu(10)
    with pytest.raises(ConfigError, match="unknown TensorRT build path"):
        build(workspace, build_kwargs, path="fp8")


def test_the_fake_rejects_what_11_lacks(make_gpu):
    gpu = make_gpu(11)
    with pytest.raises(AttributeError):
        gpu.trt.IInt8EntropyCalibrator2
    with pytest.raises(AttributeError):
        gpu.trt.BuilderFlag.INT8
    assert not hasattr(gpu.trt.IBuilderConfig, "int8_calibrator")
    gpu10 = make_gpu(10)
    config = gpu10.trt.Builder(gpu10.trt.Logger()).create_builder_config()
    with pytest.raises(AttributeError):
        config.set_int8_magic(True)


# ---------------------------------------------------------------------------- without TensorRT or GPU


def test_missing_tensorrt_is_one_clear_line(monkeypatch, workspace, build_kwargs):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` raise ImportError
    with pytest.raises(NotAvailableError) as info:
        build(workspace, build_kwargs)
    assert info.value.message == "TensorRT backend needs `pip install 'quantkit[tensorrt]'` and an NVIDIA GPU"


def test_no_gpu_is_not_available(make_gpu, workspace, build_kwargs):
    make_gpu(10, gpus=0)
    with pytest.raises(NotAvailableError, match="no usable CUDA device"):
        build(workspace, build_kwargs)


def test_importing_the_backend_does_not_import_tensorrt():
    import subprocess

    code = ("import sys, quantkit.backends.tensorrt, quantkit.backends.tensorrt.engine, "
            "quantkit.backends.tensorrt.runner, quantkit.backends.tensorrt.build_implicit, "
            "quantkit.backends.tensorrt.build_explicit\n"
            "heavy = sorted(m for m in ('tensorrt', 'pycuda', 'cuda', 'torch') if m in sys.modules)\n"
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_profile_order_is_checked(make_gpu, workspace, build_kwargs):
    make_gpu(10)
    with pytest.raises(ConfigError, match="min <= opt <= max"):
        build(workspace, build_kwargs, profile=(4, 2, 8))
    assert PROFILE == (1, OPT_BATCH, 8)


def test_explicit_also_converts_the_fp16_nodes_recorded_in_the_qdq_model(make_gpu, workspace, build_kwargs):
    import onnx

    gpu = make_gpu(11)
    model = onnx.load(str(workspace.qdq_model))
    entry = model.metadata_props.add()
    entry.key, entry.value = "quantkit.fp16_nodes", json.dumps(["/Softmax"])
    save(model, workspace.qdq_model)
    details = build(workspace, build_kwargs, fp16_nodes=["/relu/Relu"])
    assert details["fp16_conversion"]["nodes"] == ["/relu/Relu", "/Softmax"]
    assert details["fp16_conversion"]["from_qdq_metadata"] == ["/Softmax"]
    assert details["layers"]["/Softmax"] == {"requested": "fp16"}
    assert len(gpu.parsed_models) == 1
