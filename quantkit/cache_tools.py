"""Read, print and diff calibration results: TensorRT caches (ours, trtexec's, Polygraphy's) or calib.json.

Backs ``quantkit inspect``. A TensorRT cache carries only scales; amax is
recovered as scale * 127 so that a cache made elsewhere feeds the same
structures as our own calibration (min/max are then unknown: symmetric ranges).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit.errors import DataError


def load_scales(path: Path):
    """A :class:`~quantkit.calib.cache.TrtCache` from a TensorRT cache file or a calib.json.

    Raises:
        DataError: naming the file and the line for a malformed cache.
    """
    from quantkit.calib.cache import CacheFormatError, TrtCache, read_trt_cache

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            payload = json.loads(data)
            tensors = payload["tensors"]
            version = payload["fingerprint"]["trt_cache_version"]
            algorithm = payload["fingerprint"]["method"]
            return TrtCache(version, algorithm, {name: float(t["scale"]) for name, t in tensors.items()})
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: not a quantkit calib.json ({type(exc).__name__}: {exc})") from None
    try:
        return read_trt_cache(data)
    except CacheFormatError as exc:
        raise DataError(f"{path}: {exc}") from None


def ranges_from_cache(cache) -> dict[str, dict[str, float]]:
    """Per-tensor ``{amax, scale}`` from a TensorRT cache (amax = scale * 127)."""
    return {name: {"amax": scale * 127.0, "scale": scale} for name, scale in cache.scales.items()}


def cache_table(path: Path, cache) -> str:
    lines = [f"{path}: {cache.header}, {len(cache.scales)} tensors", f"{'tensor':<60} {'scale':>12} {'amax':>12}"]
    for name, scale in cache.scales.items():
        lines.append(f"{name:<60} {scale:>12.6g} {scale * 127:>12.6g}")
    return "\n".join(lines)


def diff_table(path_a: Path, a, path_b: Path, b, rtol: float) -> tuple[str, dict[str, Any]]:
    """A readable diff and its JSON form."""
    from quantkit.calib.cache import diff_caches

    rows = diff_caches(a, b, rtol=rtol)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    header = (f"a = {path_a} ({a.header}), b = {path_b} ({b.header}): "
              + ", ".join(f"{n} {status}" for status, n in counts.items()))
    lines = [header]
    if a.version != b.version or a.algorithm != b.algorithm:
        lines.append("note: headers differ; TensorRT ignores a cache whose header does not match it")
    lines.append(f"{'status':<10} {'tensor':<56} {'scale a':>11} {'scale b':>11} {'b/a':>8}")
    for row in rows:
        if row.status == "equal":
            continue
        fmt = lambda v: "-" if v is None else f"{v:.5g}"  # noqa: E731
        lines.append(f"{row.status:<10} {row.name:<56} {fmt(row.scale_a):>11} {fmt(row.scale_b):>11} "
                     f"{fmt(row.ratio):>8}")
    payload = {"a": str(path_a), "b": str(path_b), "counts": counts,
               "rows": [vars(row) for row in rows]}
    return "\n".join(lines), payload
