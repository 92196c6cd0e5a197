"""Range methods: turn :class:`~quantkit.calib.histogram.TensorStats` into an amax.

Every method has the signature ``f(stats, **params) -> RangeResult`` and is registered in
:data:`METHODS`. All are deterministic (same stats and params -> bit-identical floats) and
return ``amax == 0.0`` with ``clipped_fraction == 0.0`` for empty or all-zero statistics.

Conventions shared by the methods:

* The histogram is of ``|x|`` with bin width ``w`` (see :mod:`quantkit.calib.histogram`).
  Within a bin, values are assumed uniformly spread -- except exact zeros, which the stats
  count separately (``zero_count``) and which are treated as a point mass at 0 wherever that
  matters (percentile, mse, clipped fraction).
* ``clipped_fraction`` is the estimated fraction of elements with ``|x| > amax``.
* Symmetric int8 with 127 positive levels: ``scale = amax / 127``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantkit.calib.histogram import TensorStats

QMAX = 127  # symmetric int8: levels -127..127


@dataclass(frozen=True)
class RangeResult:
    """Outcome of one range method for one tensor.

    Attributes:
        amax: the chosen clipping range (scale = amax / 127); 0.0 for all-zero tensors.
        method: registry name of the method.
        params: the effective parameters, defaults included (so a result is self-describing).
        clipped_fraction: estimated fraction of |x| values above amax, from the histogram.
    """

    amax: float
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    clipped_fraction: float = 0.0


# ---------------------------------------------------------------------------- helpers
def _has_histogram(stats: TensorStats) -> bool:
    """True when there is a non-zero range to work on (otherwise amax is 0)."""
    return stats.count > 0 and stats.width is not None


def _hist_without_zeros(stats: TensorStats) -> np.ndarray:
    """Histogram as int64 with the exact-zero point mass removed from bin 0."""
    h = np.array(stats.hist, dtype=np.int64)
    h[0] -= stats.zero_count
    return h


def fraction_above(stats: TensorStats, amax: float) -> float:
    """Estimated fraction of elements with ``|x| > amax``.

    Values are taken as uniform within each bin (zeros as a point mass at 0), so an amax
    inside a bin clips the corresponding part of that bin.

    Args:
        stats: collected statistics.
        amax: threshold (>= 0).

    Returns:
        A float in [0, 1]; 0.0 when amax >= the observed max|x| or there is no data.
    """
    if not _has_histogram(stats) or amax >= stats.amax:
        return 0.0
    h = _hist_without_zeros(stats)
    x = amax / stats.width  # position in bins
    k = int(math.floor(x))
    if k >= h.size:
        return 0.0
    above = float(h[k + 1 :].sum()) + float(h[k]) * (1.0 - (x - k))
    return above / stats.count


def _candidates(nbins: int, start_bin: int, stride: int) -> np.ndarray:
    """Candidate bin counts ``i`` for threshold ``i * w``: start_bin..nbins step stride.

    The full range (i = nbins, no clipping) is always included, also when the stride skips
    it or nbins < start_bin, so there is at least one candidate.
    """
    first = min(start_bin, nbins)
    cand = np.arange(first, nbins + 1, stride, dtype=np.int64)
    if cand[-1] != nbins:
        cand = np.append(cand, nbins)
    return cand


def _check_positive_int(name: str, value: Any) -> int:
    """Validate an integer parameter >= 1 and return it as int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------- entropy
def kl_divergences(
    hist: np.ndarray,
    *,
    num_quantized_bins: int = 128,
    start_bin: int = 128,
    stride: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """KL(P||Q) for every candidate threshold of TensorRT's entropy calibration.

    For candidate i (threshold after bin i-1), following NVIDIA's Python ports:

    * P = bins[0:i], with the tail mass sum(bins[i:]) added to P[i-1].
    * Q: bins[0:i] *without* the tail, bin j assigned to level floor(j*nq/i) (this equals the
      ports' ``np.digitize(range(i), np.linspace(0, i, nq+1)) - 1`` exactly for nq a power of
      two, where those linspace edges are exact); each level's mass is spread evenly over its
      non-empty bins and empty bins stay empty.
    * Both normalised; KL summed over bins with P > 0; infinite if some P > 0 has Q = 0
      (happens when bin i-1 is empty but the tail is not).

    Implementation: ``KL = (1/N) * sum_j P_j log(P_j / Q_j) + log(S / N)`` over the non-empty
    bins only (N = total, S = sum(bins[:i]) = sum of unnormalised Q), which keeps every term
    a small, well-conditioned log ratio instead of subtracting large ``x log x`` sums. The
    ratios and logs of many candidates are computed at once (see :func:`_kl_block`); only
    the final per-candidate dot product is a call per candidate, so the values are
    bit-identical to evaluating each candidate on its own.

    Args:
        hist: |x| histogram counts (non-negative integers).
        num_quantized_bins: quantised levels (128 for int8).
        start_bin: first candidate i.
        stride: step between candidates (the full range is always a candidate).

    Returns:
        ``(candidates, kl)``: int64 array of i values and float64 divergences (may be inf).
    """
    nq = _check_positive_int("num_quantized_bins", num_quantized_bins)
    start_bin = _check_positive_int("start_bin", start_bin)
    stride = _check_positive_int("stride", stride)
    h = np.asarray(hist, dtype=np.int64)
    if h.ndim != 1 or h.size == 0 or (h < 0).any() or h.sum() == 0:
        raise ValueError("hist must be a 1-D array of non-negative counts with a positive sum")

    total = int(h.sum())
    cum = np.concatenate(([0], np.cumsum(h)))  # cum[i] = sum(h[:i]), exact int64
    cum_nz = np.concatenate(([0], np.cumsum(h > 0)))  # non-empty bins among h[:i]
    nz_counts = h[np.flatnonzero(h)].astype(np.float64)

    cands = _candidates(h.size, start_bin, stride)
    kl = np.full(cands.size, math.inf, dtype=np.float64)
    tails = total - cum[cands]
    # P[i-1] = tail > 0 but Q[i-1] = 0 (empty bins stay empty): KL is infinite.
    finite = np.flatnonzero((h[cands - 1] > 0) | (tails == 0))
    # Blocks of candidates whose non-empty bins total about _KL_BLOCK_ELEMS (cache-sized).
    ends = np.cumsum(cum_nz[cands[finite]])
    start = 0
    while start < finite.size:
        done = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, done + _KL_BLOCK_ELEMS, side="right")))
        rows = finite[start:stop]
        kl[rows] = _kl_block(cands[rows], tails[rows], total, cum, cum_nz, nz_counts, nq)
        start = stop
    return cands, kl


# Candidate blocks of about this many (candidate, non-empty bin) pairs: two float64 work
# arrays of this size stay in cache (measured fastest among 2**14..2**20).
_KL_BLOCK_ELEMS = 1 << 16


def _kl_block(i, tail, total, cum, cum_nz, nz_counts, nq) -> list[float]:
    """KL(P||Q) for the candidates ``i`` (all with a finite KL), see :func:`kl_divergences`.

    The non-empty bins below each candidate are laid out back to back in one flat array.
    Level l of candidate i covers bins [ceil(l*i/nq), ceil((l+1)*i/nq)) (exact integer
    arithmetic); the non-empty bin j lies in level floor(j*nq/i), so the levels' non-empty
    counts, repeated in order, give every bin its level's Q.
    """
    bounds = np.arange(nq + 1, dtype=np.int64) * i[:, None]
    bounds += nq - 1
    bounds //= nq
    mass = np.diff(cum[bounds], axis=1).astype(np.float64)
    filled = np.diff(cum_nz[bounds], axis=1)
    level_q = np.divide(mass, filled, out=np.zeros_like(mass), where=filled > 0)
    q = np.repeat(level_q.ravel(), filled.ravel())  # Q of every non-empty bin below i, per row
    k = cum_nz[i]  # non-empty bins below each i (>= 1: bin i-1 or, without tail, some bin)
    p = np.concatenate([nz_counts[:kk] for kk in k.tolist()])
    ends = np.cumsum(k)
    with_tail = np.flatnonzero(tail > 0)
    p[ends[with_tail] - 1] += tail[with_tail].astype(np.float64)  # bin i-1, non-empty here
    ratio = np.divide(p, q, out=q)
    np.log(ratio, out=ratio)
    out = []
    dot, log, begin = np.dot, math.log, 0
    for end, below in zip(ends.tolist(), cum[i].tolist()):
        out.append(float(dot(p[begin:end], ratio[begin:end])) / total + log(below / total))
        begin = end
    return out


def _pick_last_min(values: np.ndarray, tie_tol: float) -> int:
    """Index of the last value within ``tie_tol`` of the minimum (values may hold inf)."""
    best = float(values.min())
    if not math.isfinite(best):
        return values.size - 1
    return int(np.flatnonzero(values <= best + tie_tol)[-1])


def entropy(
    stats: TensorStats,
    *,
    num_quantized_bins: int = 128,
    start_bin: int = 128,
    stride: int = 1,
    copy_bin1_to_bin0: bool = True,
    tie_tol: float = 1e-12,
) -> RangeResult:
    """TensorRT EntropyCalibration2: the threshold minimising KL(P||Q), see :func:`kl_divergences`.

    amax = i * w, the upper edge of the last kept bin. This matches both NVIDIA Python ports
    (``calib_bin_edges[i]``); the GTC-2017 slides say (i + 0.5) * w, i.e. the centre of the
    next bin. We use i * w because (a) with it, "no clipping" (i = num_bins, no growth)
    gives exactly the observed max, and (b) scales then agree with the ports that
    ModelOpt/pytorch-quantization users compare against; the difference is half a bin
    (0.024% of the first range at 2048 bins).

    Args:
        stats: collected statistics.
        num_quantized_bins: quantised levels (128 for int8).
        start_bin: smallest candidate i.
        stride: candidate step (1 = exhaustive like TensorRT; the full range is always tried).
        copy_bin1_to_bin0: replace bin 0 by bin 1 before the search, as both NVIDIA ports do
            (``bins[0] = bins[1]``). This damps the zero spike of post-ReLU tensors: without
            it the spike dominates KL and the search clips far too hard (measured: ReLU of a
            unit Gaussian, 1M samples -> amax 2.07 with ~1.9% clipped, vs 4.47 with it).
            The GTC slides do not mention it; it is on by default to match the ports, which
            are NVIDIA's public stand-in for the closed-source calibrator. False gives the
            literal slide algorithm.
        tie_tol: KL values within this absolute tolerance (nats) of the minimum count as
            ties; the last such candidate wins, like the ports' "last argmin", but robust
            to 1e-16-level rounding noise.

    Returns:
        RangeResult with clipped_fraction = tail mass beyond i * w.
    """
    params = {
        "num_quantized_bins": _check_positive_int("num_quantized_bins", num_quantized_bins),
        "start_bin": _check_positive_int("start_bin", start_bin),
        "stride": _check_positive_int("stride", stride),
        "copy_bin1_to_bin0": bool(copy_bin1_to_bin0),
        "tie_tol": float(tie_tol),
    }
    if not _has_histogram(stats):
        return RangeResult(0.0, "entropy", params, 0.0)
    h = np.array(stats.hist, dtype=np.int64)
    if copy_bin1_to_bin0 and h.size > 1:
        h[0] = h[1]
    cands, kl = kl_divergences(
        h, num_quantized_bins=num_quantized_bins, start_bin=start_bin, stride=stride
    )
    i = int(cands[_pick_last_min(kl, tie_tol)])
    amax = stats.edge(i)
    return RangeResult(amax, "entropy", params, fraction_above(stats, amax))


# ---------------------------------------------------------------------------- minmax
def minmax(stats: TensorStats) -> RangeResult:
    """amax = max(|min|, |max|); nothing is clipped.

    Args:
        stats: collected statistics.

    Returns:
        RangeResult with clipped_fraction 0.
    """
    return RangeResult(float(stats.amax), "minmax", {}, 0.0)


# ---------------------------------------------------------------------------- percentile
def percentile(stats: TensorStats, *, percentile: float = 99.99) -> RangeResult:
    """amax at which the cumulative |x| distribution reaches ``percentile`` percent.

    Exact zeros form a point mass at 0; every other count is spread uniformly over its bin,
    so the result is interpolated linearly inside the bin where the target is reached
    (the NVIDIA ports return that bin's upper edge instead). The result is capped at the
    observed max|x| (interpolation in a grown last bin could exceed it).

    Args:
        stats: collected statistics.
        percentile: in [0, 100].

    Returns:
        RangeResult; clipped_fraction is ~ 1 - percentile/100.
    """
    pct = float(percentile)
    if not 0.0 <= pct <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {percentile!r}")
    params = {"percentile": pct}
    if not _has_histogram(stats):
        return RangeResult(0.0, "percentile", params, 0.0)
    target = pct / 100.0 * stats.count
    if target <= stats.zero_count:
        return RangeResult(0.0, "percentile", params, fraction_above(stats, 0.0))
    h = _hist_without_zeros(stats)
    cum = stats.zero_count + np.cumsum(h)  # cum[k] = count of |x| < (k+1)*w
    k = int(np.searchsorted(cum, target, side="left"))
    if k >= h.size:  # only reachable through float rounding at 100%
        amax = stats.amax
    else:
        below = float(cum[k] - h[k])  # h[k] > 0 since cum[k-1] < target <= cum[k]
        amax = min(stats.edge(k + (target - below) / float(h[k])), stats.amax)
    return RangeResult(amax, "percentile", params, fraction_above(stats, amax))


# ---------------------------------------------------------------------------- mse
def _cum_sq_error(u: np.ndarray) -> np.ndarray:
    """Antiderivative G(u) = integral_0^u e(t) dt of the squared quantisation error in level
    units, e(t) = (t - Q(t))^2 with Q(t) = min(round(t), 127) for t >= 0.

    With n = min(floor(t + 1/2), 127) and r = t - n: each whole rounding cell contributes
    1/12 and the current one (r^3 + 1/8)/3. Clamping n at 127 turns the same formula into
    the clipping error (t - 127)^2 beyond 127.5, and G stays continuous at every cell edge.
    ``u`` is overwritten (in-place arithmetic keeps the big work matrices to two buffers).
    """
    n = np.add(u, 0.5)
    np.floor(n, out=n)
    np.minimum(n, QMAX, out=n)
    r = np.subtract(u, n, out=u)
    np.multiply(n, 1.0 / 12.0, out=n)
    cube = np.multiply(r, r)
    np.multiply(cube, r, out=cube)
    cube += 0.125
    cube *= 1.0 / 3.0
    n += cube
    return n


def mse_errors(
    stats: TensorStats, candidates: np.ndarray, *, block_elems: int = 1 << 20
) -> np.ndarray:
    """Expected squared error E[(x - fake_quant(x))^2] for amax = i * w, i in ``candidates``.

    Each bin's values are uniform on [j*w, (j+1)*w) (exact zeros excluded: they quantise
    without error), so a bin contributes exactly ``s^3 / w * (G(u_{j+1}) - G(u_j))`` with
    ``s = amax / 127`` and ``u = edge / s`` (see :func:`_cum_sq_error`) -- rounding error
    inside the range and clipping error above it, without the bin-centre approximation.

    Args:
        stats: statistics with a histogram.
        candidates: int array of bin counts i (amax = i * w).
        block_elems: bound on the (candidates x edges) work matrix size.

    Returns:
        float64 array: mean squared error per element for each candidate.
    """
    h = _hist_without_zeros(stats)
    nz = np.flatnonzero(h)
    counts = h[nz].astype(np.float64)
    # G is evaluated once per distinct edge; neighbouring non-empty bins share an edge.
    edges = np.union1d(nz, nz + 1)
    lo_pos = np.searchsorted(edges, nz)
    hi_pos = np.searchsorted(edges, nz + 1)
    edge_values = edges.astype(np.float64)
    w = stats.width
    out = np.empty(candidates.size, dtype=np.float64)
    rows = max(1, block_elems // max(1, edges.size))
    for start in range(0, candidates.size, rows):
        cand = candidates[start : start + rows].astype(np.float64)
        u = np.multiply((QMAX / cand)[:, None], edge_values[None, :])  # edges in level units
        g = _cum_sq_error(u)
        per_bin = g[:, hi_pos] - g[:, lo_pos]
        s = cand * w / QMAX
        out[start : start + rows] = (per_bin @ counts) * (s * s * s / w) / stats.count
    return out


def mse(stats: TensorStats, *, start_bin: int = 128, stride: int = 1) -> RangeResult:
    """amax minimising the expected squared int8 quantisation error (rounding + clipping).

    Candidates are bin edges amax = i * w for i = start_bin..nbins (step ``stride``, the full
    range always included); ties go to the smallest amax. The error model is exact for
    uniform-within-bin data (see :func:`mse_errors`).

    Args:
        stats: collected statistics.
        start_bin: smallest candidate i.
        stride: candidate step.

    Returns:
        RangeResult with the estimated clipped fraction.
    """
    start_bin = _check_positive_int("start_bin", start_bin)
    stride = _check_positive_int("stride", stride)
    params = {"start_bin": start_bin, "stride": stride}
    if not _has_histogram(stats):
        return RangeResult(0.0, "mse", params, 0.0)
    cands = _candidates(stats.nbins, start_bin, stride)
    errors = mse_errors(stats, cands)
    i = int(cands[int(np.argmin(errors))])
    amax = stats.edge(i)
    return RangeResult(amax, "mse", params, fraction_above(stats, amax))


# ---------------------------------------------------------------------------- registry
METHODS: dict[str, Callable[..., RangeResult]] = {
    "entropy": entropy,
    "minmax": minmax,
    "percentile": percentile,
    "mse": mse,
}


def compute_range(stats: TensorStats, method: str, **params: Any) -> RangeResult:
    """Look up ``method`` in :data:`METHODS` and apply it.

    Args:
        stats: collected statistics.
        method: registry name.
        **params: method parameters.

    Returns:
        The method's RangeResult.

    Raises:
        ValueError: unknown method name (with a close-match suggestion).
        TypeError: unknown parameter for that method.
    """
    try:
        fn = METHODS[method]
    except KeyError:
        close = difflib.get_close_matches(method, METHODS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(METHODS)
        raise ValueError(f"unknown calibration method {method!r} (known: {known}){hint}") from None
    return fn(stats, **params)
