"""Unit tests of the TensorRT backend's pure parts: cache check, feeder, shapes, portability, name extraction."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from backends.tensorrt.conftest import make_batches
from helpers import REPO
from quantkit.backends.tensorrt.calibrator import CalibrationFeeder, load_valid_cache
from quantkit.backends.tensorrt.engine import check_engine_portability
from quantkit.backends.tensorrt.network import shape_ranges
from quantkit.calib.cache import write_trt_cache
from quantkit.config import InputSpec
from quantkit.errors import ConfigError, DataError, ModelError, StaleArtifactError


class _Memory:
    """Enough of pycuda for the feeder: allocations are numpy buffers, pointers their ids."""

    def __init__(self):
        self.buffers: dict[int, np.ndarray] = {}
        self.freed = 0

    def mem_alloc(self, nbytes):
        memory = self

        class Allocation:
            def __init__(self):
                self.data = np.zeros(nbytes, np.uint8)
                memory.buffers[id(self)] = self.data

            def __int__(self):
                return id(self)

            def free(self):
                memory.freed += 1

        return Allocation()

    def memcpy_htod(self, device_buffer, array):
        device_buffer.data[:] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)


def test_cache_header_must_match_version_and_algorithm(tmp_path, console):
    good = tmp_path / "good.cache"
    good.write_bytes(write_trt_cache({"x": 0.1}, 101601, "EntropyCalibration2"))
    assert load_valid_cache(good, 101601, console) == good.read_bytes()
    assert load_valid_cache(good, 110400, console) is None
    minmax = tmp_path / "minmax.cache"
    minmax.write_bytes(write_trt_cache({"x": 0.1}, 101601, "MinMaxCalibration"))
    assert load_valid_cache(minmax, 101601, console) is None
    garbage = tmp_path / "garbage.cache"
    garbage.write_bytes(b"\xff\xfe not a cache")
    assert load_valid_cache(garbage, 101601, console) is None
    assert load_valid_cache(tmp_path / "missing.cache", 101601, console) is None
    assert load_valid_cache(None, 101601, console) is None
    assert len(console.warnings) == 4


def test_feeder_hands_out_pointers_in_name_order_and_stops(tmp_path, console):
    memory = _Memory()
    batches = lambda: iter([{"b": np.ones((2, 3), np.float32), "a": np.zeros((2, 5), np.int64)}])  # noqa: E731
    feeder = CalibrationFeeder(memory, batches, {"a": (2, 5), "b": (2, 3)}, None, tmp_path / "c.cache", console)
    pointers = feeder.next_batch(["b", "a"])
    assert [memory.buffers[p].size for p in pointers] == [2 * 3 * 4, 2 * 5 * 8]
    assert memory.buffers[pointers[0]].view(np.float32).tolist() == [1.0] * 6
    assert feeder.next_batch(["b", "a"]) is None
    assert feeder.events == ["get_batch", "get_batch"] and feeder.batch_size == 2
    feeder.free()
    assert memory.freed == 2


def test_feeder_errors_are_recorded_not_raised(tmp_path, console):
    feeder = CalibrationFeeder(_Memory(), make_batches(count=0, remainder=1), {"input": (4, 1, 8, 8)}, None,
                               tmp_path / "c.cache", console)
    assert feeder.guarded("get_batch", lambda: feeder.next_batch(["input"]), None) is None
    with pytest.raises(DataError, match="no batch of the profile's OPT shape"):
        feeder.raise_recorded()
    broken = CalibrationFeeder(_Memory(), None, {"input": (4,)}, None, tmp_path / "c.cache", console)
    broken.guarded("write_calibration_cache", lambda: 1 / 0, None)
    with pytest.raises(ModelError, match=r"write_calibration_cache\(\) failed: ZeroDivisionError"):
        broken.raise_recorded()


def test_feeder_writes_the_cache_atomically(tmp_path, console):
    feeder = CalibrationFeeder(_Memory(), None, {"input": (4,)}, None, tmp_path / "out" / "c.cache", console)
    feeder.write_cache(b"TRT-101601-EntropyCalibration2\n")
    assert (tmp_path / "out" / "c.cache").read_bytes() == b"TRT-101601-EntropyCalibration2\n"
    assert feeder.next_batch(["input"]) is None  # no data: TensorRT gets "no more batches"


def test_shape_ranges_for_fixed_and_dynamic_axes():
    specs = [InputSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
             InputSpec(name="image", shape=[1, 3, 4, 4])]
    ranges = shape_ranges(specs, (1, 1, 1), {"ids": (1, 16)})
    assert (ranges[0].min, ranges[0].opt, ranges[0].max) == ((1, 16), (1, 16), (1, 16))
    assert ranges[1].max == (1, 3, 4, 4)
    with pytest.raises(ConfigError, match="'seq'"):
        shape_ranges(specs, (1, 1, 1), {})


def test_portability_accepts_the_same_platform_and_refuses_others():
    built = {"tensorrt_version": "10.16.1.11", "gpu_name": "NVIDIA L4", "compute_capability": "8.9"}
    check_engine_portability({"details": built}, dict(built))
    with pytest.raises(StaleArtifactError, match=r"TensorRT 10\.16\.1\.11 vs 11\.4\.0\.106 here.*rebuild it here"):
        check_engine_portability(built, {**built, "tensorrt_version": "11.4.0.106"})
    with pytest.raises(StaleArtifactError, match="compute capability 8.9"):
        check_engine_portability(built, {**built, "compute_capability": "9.0", "gpu_name": "NVIDIA H100"})
    with pytest.raises(StaleArtifactError, match="GPU NVIDIA L4 vs NVIDIA L40S"):
        check_engine_portability(built, {**built, "gpu_name": "NVIDIA L40S"})


def _script():
    path = REPO / "scripts" / "trt_names.py"
    spec = importlib.util.spec_from_file_location("trt_names_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_boost_python_declarations_are_read_per_class():
    script = _script()
    source = '''
    #define DEF_SIMPLE_METHOD(NAME) def(#NAME, &cl::NAME)
    py::def("init", init, py::arg("flags")=0);
    {
      typedef stream cl;
      py::class_<cl, boost::noncopyable, shared_ptr<cl> >
        ("Stream", py::init<unsigned int>(py::arg("flags")=0))
        .DEF_SIMPLE_METHOD(synchronize)
        // .def("commented_out", &cl::x)
        .add_property("handle", &cl::handle_int)
        ;
    }
    {
      py::class_<cl, boost::noncopyable> wrp("PagelockedHostAllocation", py::no_init);
      wrp.DEF_SIMPLE_METHOD(free);
    }
    DEF_SIMPLE_FUNCTION(mem_get_info);
    '''
    assert script.boost_python_names(source) == {"init", "Stream", "Stream.synchronize", "Stream.handle",
                                                 "PagelockedHostAllocation", "PagelockedHostAllocation.free",
                                                 "mem_get_info"}


def test_driver_py_additions_are_read():
    script = _script()
    source = "def pagelocked_zeros(shape):\n    pass\n\ndef _private():\n    Device.get_attributes = 1\n"
    assert script.driver_py_names(source) == {"pagelocked_zeros", "Device.get_attributes"}


def test_committed_lists_say_where_they_came_from():
    names_dir = Path(REPO / "quantkit" / "backends" / "tensorrt" / "names")
    assert "tensorrt-cu12-bindings==10.16.1.11" in (names_dir / "trt10.txt").read_text().splitlines()[0]
    assert "tensorrt-cu13-bindings==11.4.0.106" in (names_dir / "trt11.txt").read_text().splitlines()[0]
    assert "pycuda==2026.1" in (names_dir / "pycuda.txt").read_text().splitlines()[0]
