"""TensorRT calibration cache, text format.

::

    TRT-<version>-<algorithm>
    <tensor name>: <8 hex digits>
    ...

* Header: ``<version>`` is TensorRT's ``NV_TENSORRT_VERSION`` (see :func:`trt_version_code`),
  ``<algorithm>`` e.g. ``EntropyCalibration2`` or ``MinMaxCalibration``. TensorRT silently
  ignores (and recalibrates) a cache whose header does not match the running version, so
  callers choose the version explicitly and should warn loudly about mismatches.
* Each tensor line: name, ``": "``, then the big-endian IEEE-754 float32 bits of
  ``scale = amax / 127`` as 8 lowercase hex digits (``struct.pack('>f', s).hex()``).
  Names may contain spaces and colons, so lines are split with ``rpartition(': ')``.
* Lines end with ``\\n``; names are UTF-8.

Writing is strict and deterministic (same input -> same bytes). Reading accepts what the
writer produces plus small variations seen from other tools (CRLF line ends, upper-case or
unpadded hex, a missing final newline) and rejects everything else with the line number.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

ALGORITHM_ENTROPY2 = "EntropyCalibration2"
ALGORITHM_MINMAX = "MinMaxCalibration"

QMAX = 127
# Smallest positive *normal* float32 (2**-126 = 1.1754944e-38, bits 00800000). Used as the
# scale of all-zero tensors (amax == 0) and as a floor for tiny amax: scales must be > 0 for
# TensorRT and ONNX Q/DQ, and staying normal avoids denormal flushing to zero on GPUs.
SCALE_FLOOR = 2.0**-126
_FLOAT32_MAX = 3.4028234663852886e38

_HEADER_RE = re.compile(r"TRT-(\d+)-(\S+)")
_HEX_RE = re.compile(r"[0-9a-fA-F]{1,8}")


class CacheFormatError(ValueError):
    """A calibration cache is malformed.

    Attributes:
        line: 1-based line number of the problem.
        expected: what was expected there.
        got: the offending text (possibly shortened).
    """

    def __init__(self, line: int, expected: str, got: str):
        self.line = line
        self.expected = expected
        self.got = got
        shown = got if len(got) <= 80 else got[:77] + "..."
        super().__init__(f"calibration cache line {line}: expected {expected}, got {shown!r}")


@dataclass
class TrtCache:
    """A parsed calibration cache.

    Attributes:
        version: header version number (e.g. 8601 or 100300).
        algorithm: header algorithm name (e.g. EntropyCalibration2).
        scales: tensor name -> scale (amax / 127), in file order.
    """

    version: int
    algorithm: str
    scales: dict[str, float] = field(default_factory=dict)

    @property
    def header(self) -> str:
        """The header line without newline, ``TRT-<version>-<algorithm>``."""
        return f"TRT-{self.version}-{self.algorithm}"

    def to_bytes(self) -> bytes:
        """Serialise with :func:`write_trt_cache`."""
        return write_trt_cache(self.scales, self.version, self.algorithm)


# ---------------------------------------------------------------------------- numbers
def trt_version_code(major: int, minor: int, patch: int) -> int:
    """TensorRT's ``NV_TENSORRT_VERSION`` integer, as used in the cache header.

    * TensorRT 10.x and later: ``major*10000 + minor*100 + patch`` (10.3.0 -> 100300).
    * TensorRT 8.x (and 7.x; 9.x assumed): ``major*1000 + minor*100 + patch``
      (8.6.1 -> 8601). Applied automatically for ``major < 10`` because that is the number
      those versions write; the two schemes cannot collide (8.x codes are < 10000).

    Args:
        major, minor, patch: version components (minor/patch 0..99; minor 0..9 below 10.x).

    Returns:
        The version code.
    """
    for name, value in (("major", major), ("minor", minor), ("patch", patch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if minor > 99 or patch > 99:
        raise ValueError(f"minor and patch must be <= 99, got {minor}.{patch}")
    if major >= 10:
        return major * 10000 + minor * 100 + patch
    if minor > 9:
        raise ValueError(f"TensorRT {major}.x codes (major*1000+minor*100+patch) need minor <= 9, got {minor}")
    return major * 1000 + minor * 100 + patch


def _to_float32(value: float) -> float:
    """Round a Python float to the nearest float32 (raises OverflowError when out of range)."""
    return struct.unpack(">f", struct.pack(">f", value))[0]


def amax_to_scale(amax: float) -> float:
    """int8 scale for a symmetric range: ``amax / 127``, floored at :data:`SCALE_FLOOR`.

    amax == 0 (an all-zero tensor) and any amax whose scale would fall below the smallest
    normal float32 give ``SCALE_FLOOR`` (2**-126), so the scale is always a positive
    normal float32. The result is rounded to float32, so the cache, ONNX Q/DQ initializers
    and any comparison all use the very same number.

    Args:
        amax: clipping range, finite and >= 0.

    Returns:
        The scale as a Python float that is exactly representable in float32.

    Raises:
        ValueError: amax negative, NaN, infinite or too large for a float32 scale.
    """
    amax = float(amax)
    if not (math.isfinite(amax) and amax >= 0.0):
        raise ValueError(f"amax must be finite and >= 0, got {amax!r}")
    scale = amax / QMAX
    if scale > _FLOAT32_MAX:
        raise ValueError(f"amax {amax!r} gives a scale beyond the float32 range")
    return max(_to_float32(scale), SCALE_FLOOR)


def scale_to_hex(scale: float) -> str:
    """8 lowercase hex digits of the big-endian float32 bits of ``scale``."""
    return struct.pack(">f", scale).hex()


def hex_to_scale(text: str) -> float:
    """Inverse of :func:`scale_to_hex` (also accepts 1-8 digits, any case)."""
    return struct.unpack(">f", int(text, 16).to_bytes(4, "big"))[0]


# ---------------------------------------------------------------------------- write
def _check_name(name: object) -> str:
    """Validate a tensor name for writing."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if "\n" in name or "\r" in name:
        raise ValueError(f"tensor name {name!r} contains a line break")
    return name


def _check_scale(name: str, scale: float) -> str:
    """Validate a scale for writing and return its hex text."""
    value = float(scale)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"scale of {name!r} must be finite and > 0, got {scale!r}")
    try:
        text = scale_to_hex(value)
    except OverflowError:
        raise ValueError(f"scale of {name!r} ({scale!r}) is beyond the float32 range") from None
    if hex_to_scale(text) == 0.0:
        raise ValueError(f"scale of {name!r} ({scale!r}) underflows to 0 in float32")
    return text


def write_trt_cache(scales: Mapping[str, float], version: int, algorithm: str) -> bytes:
    """Serialise scales into the TensorRT calibration cache text format.

    Args:
        scales: tensor name -> scale (amax / 127, see :func:`amax_to_scale`); written in
            the mapping's iteration order.
        version: header version code (:func:`trt_version_code`).
        algorithm: header algorithm, e.g. :data:`ALGORITHM_ENTROPY2`.

    Returns:
        UTF-8 bytes, every line newline-terminated; deterministic for equal inputs.

    Raises:
        ValueError: invalid version, algorithm, name or scale.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    if not isinstance(algorithm, str) or not _HEADER_RE.fullmatch(f"TRT-0-{algorithm}"):
        raise ValueError(f"algorithm must be a non-empty string without whitespace, got {algorithm!r}")
    lines = [f"TRT-{version}-{algorithm}"]
    for name, scale in scales.items():
        lines.append(f"{_check_name(name)}: {_check_scale(name, scale)}")
    return ("\n".join(lines) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------- read
def _decode_lines(data: bytes) -> list[str]:
    """Split cache bytes into text lines (final newline optional, CRLF tolerated)."""
    raw = bytes(data).split(b"\n")
    if len(raw) > 1 and raw[-1] == b"":
        raw.pop()  # the terminating newline
    lines = []
    for number, chunk in enumerate(raw, start=1):
        if chunk.endswith(b"\r"):
            chunk = chunk[:-1]
        try:
            lines.append(chunk.decode("utf-8"))
        except UnicodeDecodeError:
            raise CacheFormatError(number, "UTF-8 text", chunk.decode("utf-8", "replace")) from None
    return lines


def _parse_header(line: str) -> tuple[int, str]:
    """Parse ``TRT-<version>-<algorithm>`` (line 1)."""
    match = _HEADER_RE.fullmatch(line)
    if not match:
        raise CacheFormatError(1, "header 'TRT-<version>-<algorithm>'", line)
    return int(match.group(1)), match.group(2)


def _parse_entry(number: int, line: str) -> tuple[str, float]:
    """Parse ``<name>: <hex>`` (split at the *last* ': ' since names may contain it)."""
    name, sep, text = line.rpartition(": ")
    if not sep:
        raise CacheFormatError(number, "'<tensor name>: <8 hex digits>'", line)
    if not name:
        raise CacheFormatError(number, "a non-empty tensor name before ': '", line)
    if not _HEX_RE.fullmatch(text):
        raise CacheFormatError(number, "up to 8 hex digits (float32 bits) after ': '", line)
    scale = hex_to_scale(text)
    if not math.isfinite(scale) or math.copysign(1.0, scale) < 0:
        raise CacheFormatError(number, "a finite, non-negative float32 scale", line)
    return name, scale


def read_trt_cache(data: bytes) -> TrtCache:
    """Parse a TensorRT calibration cache.

    Args:
        data: the cache file's bytes.

    Returns:
        TrtCache with the header fields and scales in file order.

    Raises:
        CacheFormatError: with the 1-based line number, for a bad header, a malformed or
            empty line, bad hex, a non-finite/negative scale or a duplicate tensor name.
        TypeError: ``data`` is not bytes-like.
    """
    if isinstance(data, str):
        raise TypeError("read_trt_cache expects bytes; open the file in binary mode")
    lines = _decode_lines(data)
    version, algorithm = _parse_header(lines[0])
    scales: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for number, line in enumerate(lines[1:], start=2):
        name, scale = _parse_entry(number, line)
        if name in scales:
            raise CacheFormatError(
                number, f"a tensor name not listed before (first on line {first_seen[name]})", line
            )
        scales[name] = scale
        first_seen[name] = number
    return TrtCache(version, algorithm, scales)


# ---------------------------------------------------------------------------- diff
ONLY_IN_A = "only-in-a"
ONLY_IN_B = "only-in-b"
EQUAL = "equal"
CHANGED = "changed"


@dataclass(frozen=True)
class CacheDiffRow:
    """One tensor in a cache comparison.

    Attributes:
        name: tensor name.
        scale_a, scale_b: scales in each cache (None when absent).
        ratio: scale_b / scale_a (None unless in both; inf if only scale_a is 0).
        status: one of ``only-in-a``, ``only-in-b``, ``equal``, ``changed``.
    """

    name: str
    scale_a: float | None
    scale_b: float | None
    ratio: float | None
    status: str

    @property
    def abs_log_ratio(self) -> float:
        """|ln(ratio)| (0 when not in both caches, inf for a zero against non-zero)."""
        if self.ratio is None:
            return 0.0
        if self.ratio == 0.0 or math.isinf(self.ratio):
            return math.inf
        return abs(math.log(self.ratio))


def _compare(name: str, sa: float, sb: float, rtol: float) -> CacheDiffRow:
    """Row for a tensor present in both caches."""
    if sa == sb:
        return CacheDiffRow(name, sa, sb, 1.0, EQUAL)
    ratio = sb / sa if sa != 0.0 else math.inf
    status = EQUAL if abs(ratio - 1.0) <= rtol else CHANGED
    return CacheDiffRow(name, sa, sb, ratio, status)


def diff_caches(a: TrtCache, b: TrtCache, *, rtol: float = 0.0) -> list[CacheDiffRow]:
    """Compare two caches tensor by tensor.

    Args:
        a, b: parsed caches (headers are not compared; check ``version``/``algorithm``).
        rtol: scales with ``|b/a - 1| <= rtol`` count as equal (default: bit-identical only).

    Returns:
        Rows ordered: only-in-a (a's order), only-in-b (b's order), changed (largest
        ``|ln(b/a)|`` first, ties in a's order), equal (a's order).
    """
    only_a, only_b, changed, equal = [], [], [], []
    for name, sa in a.scales.items():
        if name not in b.scales:
            only_a.append(CacheDiffRow(name, sa, None, None, ONLY_IN_A))
            continue
        row = _compare(name, sa, b.scales[name], rtol)
        (changed if row.status == CHANGED else equal).append(row)
    for name, sb in b.scales.items():
        if name not in a.scales:
            only_b.append(CacheDiffRow(name, None, sb, None, ONLY_IN_B))
    changed.sort(key=lambda row: -row.abs_log_ratio)  # stable: ties keep a's order
    return only_a + only_b + changed + equal
