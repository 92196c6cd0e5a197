"""Tests for quantkit.calib.cache (TensorRT calibration cache text format)."""

from __future__ import annotations

import math
import struct

import pytest

from quantkit.calib.cache import (
    CHANGED,
    EQUAL,
    ONLY_IN_A,
    ONLY_IN_B,
    SCALE_FLOOR,
    CacheFormatError,
    TrtCache,
    amax_to_scale,
    diff_caches,
    read_trt_cache,
    scale_to_hex,
    trt_version_code,
    write_trt_cache,
)


def _float32_bits_from_first_principles(value: float) -> int:
    """IEEE-754 binary32 bits of a positive normal value, built by hand (round half to even)."""
    exponent = math.floor(math.log2(value))
    mantissa = value / 2.0**exponent  # in [1, 2)
    frac = (mantissa - 1.0) * 2**23
    m = math.floor(frac)
    rest = frac - m
    if rest > 0.5 or (rest == 0.5 and m % 2 == 1):
        m += 1
    if m == 2**23:
        m, exponent = 0, exponent + 1
    return ((exponent + 127) << 23) | m


def test_hex_of_one_over_127_from_first_principles():
    scale = amax_to_scale(1.0)
    bits = _float32_bits_from_first_principles(1.0 / 127.0)
    assert bits == struct.unpack(">I", struct.pack(">f", 1.0 / 127.0))[0]
    assert scale_to_hex(scale) == f"{bits:08x}" == "3c010204"
    data = write_trt_cache({"input": scale}, 8601, "EntropyCalibration2")
    assert data == b"TRT-8601-EntropyCalibration2\ninput: 3c010204\n"


def test_fixed_literal_hex_values():
    assert scale_to_hex(0.0078125) == "3c000000"  # 2**-7
    assert scale_to_hex(amax_to_scale(127.0)) == "3f800000"  # scale 1.0
    assert scale_to_hex(SCALE_FLOOR) == "00800000"  # zero-padded to 8 digits


def test_amax_to_scale_floor_and_validation():
    assert amax_to_scale(0.0) == SCALE_FLOOR == 2.0**-126
    assert amax_to_scale(1e-45) == SCALE_FLOOR
    s = amax_to_scale(3.3)
    assert s == struct.unpack(">f", struct.pack(">f", 3.3 / 127))[0]  # float32-exact
    for bad in (-1.0, math.nan, math.inf, 1e300):
        with pytest.raises(ValueError):
            amax_to_scale(bad)


def test_round_trip_with_awkward_names():
    scales = {
        "input": amax_to_scale(2.64),
        "/conv1/Conv_output_0": amax_to_scale(10.5),
        "(Unnamed Layer* 4) [Activation]_output": amax_to_scale(0.01),
        "a: b: c": amax_to_scale(1.0),
        "ends with colon:": amax_to_scale(7.0),
        " leading and trailing ": amax_to_scale(0.0),
        "ünïcode/张量": amax_to_scale(99.0),
    }
    data = write_trt_cache(scales, 100300, "EntropyCalibration2")
    cache = read_trt_cache(data)
    assert (cache.version, cache.algorithm) == (100300, "EntropyCalibration2")
    assert list(cache.scales) == list(scales)  # file order preserved
    assert cache.scales == scales  # float32-exact values round-trip bit for bit
    assert cache.to_bytes() == data
    assert data.endswith(b"\n") and data.count(b"\n") == len(scales) + 1


def test_write_is_deterministic_and_ordered():
    scales = {"b": 0.5, "a": 0.25}
    one = write_trt_cache(scales, 8601, "MinMaxCalibration")
    two = write_trt_cache(dict(scales), 8601, "MinMaxCalibration")
    assert one == two == b"TRT-8601-MinMaxCalibration\nb: 3f000000\na: 3e800000\n"
    assert write_trt_cache({}, 8601, "EntropyCalibration2") == b"TRT-8601-EntropyCalibration2\n"


@pytest.mark.parametrize(
    "scales, version, algorithm",
    [
        ({"": 1.0}, 8601, "EntropyCalibration2"),
        ({"a\nb": 1.0}, 8601, "EntropyCalibration2"),
        ({"a": 0.0}, 8601, "EntropyCalibration2"),
        ({"a": -1.0}, 8601, "EntropyCalibration2"),
        ({"a": math.nan}, 8601, "EntropyCalibration2"),
        ({"a": 1e-50}, 8601, "EntropyCalibration2"),  # underflows float32
        ({"a": 1e39}, 8601, "EntropyCalibration2"),  # beyond float32
        ({"a": 1.0}, -1, "EntropyCalibration2"),
        ({"a": 1.0}, True, "EntropyCalibration2"),
        ({"a": 1.0}, 8601, "Entropy Calibration"),
        ({"a": 1.0}, 8601, ""),
    ],
)
def test_write_rejects_invalid_input(scales, version, algorithm):
    with pytest.raises(ValueError):
        write_trt_cache(scales, version, algorithm)


def test_reader_tolerates_crlf_uppercase_short_hex_and_missing_final_newline():
    data = b"TRT-8601-EntropyCalibration2\r\nx: 3C010204\r\ny: 800000\r\nz: 0"
    cache = read_trt_cache(data)
    assert cache.scales == {"x": amax_to_scale(1.0), "y": SCALE_FLOOR, "z": 0.0}


@pytest.mark.parametrize(
    "data, line, expected",
    [
        (b"", 1, "header"),
        (b"TRT-EntropyCalibration2\n", 1, "header"),
        (b"trt-8601-EntropyCalibration2\n", 1, "header"),
        (b"TRT-8601-\n", 1, "header"),
        (b"TRT-8601-EntropyCalibration2\na: 3c010204\nno separator\n", 3, "<tensor name>"),
        (b"TRT-8601-EntropyCalibration2\na:3c010204\n", 2, "<tensor name>"),
        (b"TRT-8601-EntropyCalibration2\na: 3c010204\n\nb: 3c010204\n", 3, "<tensor name>"),
        (b"TRT-8601-EntropyCalibration2\n: 3c010204\n", 2, "non-empty tensor name"),
        (b"TRT-8601-EntropyCalibration2\na: xyz\n", 2, "hex"),
        (b"TRT-8601-EntropyCalibration2\na: 3c0102045\n", 2, "hex"),
        (b"TRT-8601-EntropyCalibration2\na: 3c010204 \n", 2, "hex"),
        (b"TRT-8601-EntropyCalibration2\na: 7fc00000\n", 2, "finite"),  # NaN
        (b"TRT-8601-EntropyCalibration2\na: bf800000\n", 2, "non-negative"),  # -1.0
        (b"TRT-8601-EntropyCalibration2\na: 3c010204\nb: 1\na: 3c010204\n", 4, "line 2"),
        (b"TRT-8601-EntropyCalibration2\na: \xff\xfe\n", 2, "UTF-8"),
    ],
)
def test_reader_errors_carry_line_numbers(data, line, expected):
    with pytest.raises(CacheFormatError) as info:
        read_trt_cache(data)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.line == line
    assert expected in err.expected
    assert f"line {line}:" in str(err)


def test_reader_rejects_text():
    with pytest.raises(TypeError):
        read_trt_cache("TRT-8601-EntropyCalibration2\n")  # type: ignore[arg-type]


def test_diff_caches_statuses_and_ordering():
    a = TrtCache(8601, "EntropyCalibration2", {"same": 0.5, "x2": 0.25, "gone": 1.0, "half": 1.0, "tiny": 1.0})
    b = TrtCache(100300, "EntropyCalibration2", {"new": 2.0, "half": 0.5, "same": 0.5, "x2": 0.5, "tiny": 1.0000001})
    rows = diff_caches(a, b)
    assert [(r.name, r.status) for r in rows] == [
        ("gone", ONLY_IN_A),
        ("new", ONLY_IN_B),
        ("x2", CHANGED),  # |ln 2| ties with |ln 0.5|: a's order decides
        ("half", CHANGED),
        ("tiny", CHANGED),
        ("same", EQUAL),
    ]
    by_name = {r.name: r for r in rows}
    assert by_name["x2"].ratio == 2.0 and by_name["half"].ratio == 0.5
    assert by_name["gone"].scale_b is None and by_name["new"].scale_a is None
    assert by_name["same"].ratio == 1.0
    relaxed = {r.name: r.status for r in diff_caches(a, b, rtol=1e-6)}
    assert relaxed["tiny"] == EQUAL and relaxed["x2"] == CHANGED


def test_diff_sorts_changed_by_abs_log_ratio():
    a = TrtCache(1, "A", {"k1": 1.0, "k2": 1.0, "k3": 1.0})
    b = TrtCache(1, "A", {"k1": 1.1, "k2": 0.1, "k3": 3.0})
    assert [r.name for r in diff_caches(a, b)] == ["k2", "k3", "k1"]


def test_trt_version_code_schemes():
    assert trt_version_code(10, 3, 0) == 100300
    assert trt_version_code(10, 13, 2) == 101302
    assert trt_version_code(11, 0, 0) == 110000
    assert trt_version_code(8, 6, 1) == 8601  # 8.x: major*1000 + minor*100 + patch
    assert trt_version_code(8, 5, 3) == 8503
    for bad in ((10, 100, 0), (10, 0, 100), (8, 10, 0), (-1, 0, 0), (10.0, 0, 0)):
        with pytest.raises(ValueError):
            trt_version_code(*bad)
