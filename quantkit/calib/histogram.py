"""Streaming per-tensor statistics for calibration (pure numpy).

:class:`TensorStats` is fed one batch at a time and keeps what every range method in
:mod:`quantkit.calib.methods` needs: signed min/max, element and exact-zero counts, and a
histogram of ``|x|``.

Histogram layout (TensorRT / NVIDIA-port style)
-----------------------------------------------
* Bins start at 0. The first batch with a non-zero ``max|x|`` (``first_amax``) fixes the bin
  width ``w = first_amax / num_bins``; ``first_amax`` itself lands in the last bin.
* When a later batch exceeds the covered range, bins of the *same* width are appended; the
  histogram is never re-binned. Every value's bin is a function of the value and ``w`` only,
  so once ``w`` is fixed the counts do not depend on how the data were split into batches.
* Batches that are entirely zero before any width exists only increment the counters; their
  zeros go to bin 0 once a width is known. A tensor that is zero throughout has no histogram
  and ``amax == 0``; the range methods then return amax 0.0, and writers of scales must use a
  tiny positive scale instead (see :func:`quantkit.calib.cache.amax_to_scale`).

Indexing: bin = floor(|x| * r) with ``r = num_bins / first_amax`` rounded to float32 and the
product computed in float32 (one multiply + an int32 cast + ``np.bincount``; several times
faster than ``np.histogram``). Bins are half-open ``[k*w, (k+1)*w)`` like ``np.histogram``
(edges exact up to float32 rounding of the product), except that the initial range is closed
at the top: values ``<= first_amax`` whose index comes out as ``num_bins`` (``first_amax``
itself, or values within rounding of it) are put in bin ``num_bins - 1``. That is a clip of
the index only, applied per element and only when a batch reaches that index, so the bin of
a value never depends on what else is in its batch. Because rounding is monotonic, a batch's
largest index is the index of its max, which sizes the growth before any binning.
(When ``r`` does not fit in float32 -- ``first_amax`` below ~1e-34 -- float64 is used.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

DEFAULT_NUM_BINS = 2048
DEFAULT_CHUNK_ELEMS = 1 << 24
DEFAULT_MAX_BINS = 1 << 20
# Work is done in blocks of at most this many elements: the scratch buffers (float32 |x|,
# int32 index, and bincount's internal intp copy: 16 bytes per element) then stay in cache
# and are not page-faulted in on every update, which measured ~3x faster than one
# 12.8M-element pass. chunk_elems can only make blocks smaller.
_FAST_BLOCK_ELEMS = 1 << 18
# Indices are computed as int32 while they fit (float32 -> int32 conversion measured ~4x
# faster than -> intp, which more than pays for bincount's internal widening).
_INT32_MAX = np.iinfo(np.int32).max
_FORMAT = "quantkit.tensor_stats/1"
# Above this the reciprocal width does not fit float32 comfortably; index in float64 instead.
_FLOAT32_SCALE_LIMIT = 1e37


class NonFiniteError(ValueError):
    """A batch contained NaN or +/-Inf (after conversion to float32).

    The message names no tensor or batch; callers add that context.

    Attributes:
        count: number of non-finite values in the batch.
        nan_count: how many of them are NaN.
        inf_count: how many are +/-Inf (including float64 values beyond the float32 range).
        total: number of elements in the batch.
    """

    def __init__(self, count: int, nan_count: int, inf_count: int, total: int):
        self.count = count
        self.nan_count = nan_count
        self.inf_count = inf_count
        self.total = total
        super().__init__(
            f"{count} non-finite value(s) out of {total} (NaN: {nan_count}, Inf: {inf_count})"
        )


class HistogramOverflowError(ValueError):
    """A batch exceeds the first batch's range so much that the histogram would need more
    than ``max_bins`` bins (the first calibration batch was not representative)."""

    def __init__(self, needed: float, max_bins: int):
        self.needed = needed
        self.max_bins = max_bins
        super().__init__(
            f"histogram would need {needed:.0f} bins (limit {max_bins}): values are far larger "
            "than in the first calibration batch; use a representative first batch or raise max_bins"
        )


def _index_scale(first_amax: float, num_bins: int) -> np.floating:
    """Reciprocal bin width used for indexing.

    Args:
        first_amax: the width-defining max|x| (> 0, a float32 value).
        num_bins: bins covering [0, first_amax].

    Returns:
        ``num_bins / first_amax`` as a numpy float32 scalar (float64 when it would not fit
        float32); its dtype is the dtype the indices are computed in.
    """
    inv = num_bins / first_amax
    dtype = np.float32 if inv < _FLOAT32_SCALE_LIMIT else np.float64
    return dtype(inv)


def _clip_initial_top(idx: np.ndarray, values: np.ndarray, n0: int, first_amax: float) -> None:
    """Move index n0 to n0-1 for values <= first_amax (used only in batches that also grow)."""
    at_edge = np.flatnonzero(idx == n0)
    if at_edge.size:
        inside = np.abs(values[at_edge]) <= first_amax
        idx[at_edge[inside]] = n0 - 1


def _clip_mode(scale: np.floating, first_amax: float, amax: float, n0: int) -> str:
    """Which clip of index n0 (closed top of the initial range) values up to ``amax`` need:
    none (no value reaches n0), all (no value exceeds first_amax), or per element."""
    top_index = int(float(scale.dtype.type(amax) * scale))
    return "none" if top_index < n0 else ("all" if amax <= first_amax else "some")


def _blocks(arr: np.ndarray, block: int) -> Iterator[np.ndarray]:
    """Yield consecutive 1-D blocks of ``arr`` in C order.

    Contiguous arrays give views; others give per-block copies (``arr.flat`` slicing), so a
    non-contiguous batch never needs a full flattened copy.
    """
    n = arr.size
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1)
        for start in range(0, n, block):
            yield flat[start : start + block]
    else:
        for start in range(0, n, block):
            yield arr.flat[start : start + block]


def _as_float32(block: np.ndarray) -> np.ndarray:
    """Return ``block`` as float32 (no copy when it already is)."""
    return block if block.dtype == np.float32 else block.astype(np.float32)


class TensorStats:
    """Streaming statistics of one tensor, updated batch by batch.

    Args:
        num_bins: histogram bins covering ``[0, first_amax]`` (TensorRT uses 2048).
        chunk_elems: at most this many elements are converted / indexed at once, which bounds
            scratch memory to ~16 bytes per element of a chunk (the work block is additionally
            capped at 2**18 elements for cache efficiency).
        max_bins: hard limit on histogram growth (see :class:`HistogramOverflowError`).

    Attributes:
        count: elements seen.
        zero_count: elements that were exactly 0 (after float32 conversion).
        min, max: signed extremes as Python floats, ``None`` before any element.
        first_amax: max|x| of the first batch with a non-zero range (defines the width), or None.
    """

    def __init__(
        self,
        num_bins: int = DEFAULT_NUM_BINS,
        *,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        max_bins: int = DEFAULT_MAX_BINS,
    ):
        for name, value in (("num_bins", num_bins), ("chunk_elems", chunk_elems), ("max_bins", max_bins)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_bins < num_bins:
            raise ValueError(f"max_bins ({max_bins}) must be >= num_bins ({num_bins})")
        self.num_bins = int(num_bins)
        self.chunk_elems = int(chunk_elems)
        self.max_bins = int(max_bins)
        self.count = 0
        self.zero_count = 0
        self.min: float | None = None
        self.max: float | None = None
        self.first_amax: float | None = None
        self._scale: np.floating | None = None
        self._hist = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ properties
    @property
    def amax(self) -> float:
        """max(|min|, |max|) over everything seen; 0.0 when empty or all zero."""
        if self.min is None or self.max is None:
            return 0.0
        return max(abs(self.min), abs(self.max))

    @property
    def width(self) -> float | None:
        """Bin width ``first_amax / num_bins`` (float64), or None while no width is fixed."""
        return None if self.first_amax is None else self.first_amax / self.num_bins

    @property
    def hist(self) -> np.ndarray:
        """Read-only view of the |x| histogram counts (int64; empty while no width is fixed)."""
        view = self._hist.view()
        view.flags.writeable = False
        return view

    @property
    def nbins(self) -> int:
        """Current number of histogram bins (>= num_bins after growth, 0 without a width)."""
        return int(self._hist.size)

    def edge(self, k: float) -> float:
        """Nominal position ``k * width`` (k may be fractional), as ``first_amax * (k / num_bins)``
        so that edge(num_bins) is exactly ``first_amax``. 0.0 without a width."""
        if self.first_amax is None:
            return 0.0
        return self.first_amax * (k / self.num_bins)

    def bin_edges(self) -> np.ndarray:
        """Nominal bin edges ``k * width`` for k = 0..nbins (float64; empty without a width)."""
        if self.first_amax is None:
            return np.zeros(0, dtype=np.float64)
        return self.first_amax * (np.arange(self.nbins + 1, dtype=np.float64) / self.num_bins)

    # ------------------------------------------------------------------ update
    def update(self, array: Any) -> None:
        """Add one batch.

        The state is only modified once the whole batch has been processed, so a batch that
        raises leaves the statistics untouched.

        Args:
            array: any array-like of bool, integer or floating dtype, any shape; values are
                taken as float32.

        Raises:
            NonFiniteError: the batch holds NaN/Inf (or float64 values beyond float32 range).
            HistogramOverflowError: the histogram would exceed ``max_bins`` bins.
            TypeError: unsupported dtype (complex, object, strings, ...).
        """
        arr = np.asarray(array)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"unsupported dtype {arr.dtype} for calibration statistics")
        if arr.size == 0:
            return
        first_amax, scale = self.first_amax, self._scale
        counts: np.ndarray | None = None
        fused = None if scale is None else self._histogram_fixed_width(arr)
        if fused is not None:
            counts, zeros, lo, hi = fused
        else:  # no width yet, or an error to report: scan the whole batch first
            lo, hi = self._scan_min_max(arr)
            batch_amax = max(-lo, hi)
            if first_amax is None and batch_amax > 0.0:
                first_amax, scale = batch_amax, _index_scale(batch_amax, self.num_bins)
            if scale is None:
                zeros = arr.size  # batch_amax == 0: every element is exactly zero
            else:
                nb = self._bins_needed(batch_amax, first_amax, scale, new_width=self._scale is None)
                counts, zeros = self._histogram(arr, scale, first_amax, batch_amax, nb)

        # Commit (nothing above touched self).
        if scale is not None and self._scale is None:
            self._hist = np.zeros(self.num_bins, dtype=np.int64)
            self._hist[0] = self.count  # earlier all-zero batches belong in bin 0
            self.first_amax, self._scale = first_amax, scale
        if counts is not None:
            self._add_counts(counts)
        self.count += int(arr.size)
        self.zero_count += int(zeros)
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)

    def _scan_min_max(self, arr: np.ndarray) -> tuple[float, float]:
        """Signed min and max of a batch as float32-rounded Python floats.

        Reductions run directly on ``arr`` (no copy, also for strided arrays); NaN propagates
        through min/max, so finiteness of both results proves the whole batch finite.

        Raises:
            NonFiniteError: with the count of offending values.
        """
        with np.errstate(over="ignore"):  # float64 beyond float32 range -> inf -> error below
            lo = np.float32(arr.min())
            hi = np.float32(arr.max())
        if not (np.isfinite(lo) and np.isfinite(hi)):
            self._raise_non_finite(arr)
        return float(lo), float(hi)

    def _raise_non_finite(self, arr: np.ndarray) -> None:
        """Count NaN / Inf in float32 terms (error path only) and raise NonFiniteError."""
        nan = inf = 0
        for block in _blocks(arr, self.chunk_elems):
            with np.errstate(over="ignore"):
                b32 = _as_float32(block)
            nan += int(np.count_nonzero(np.isnan(b32)))
            inf += int(np.count_nonzero(np.isinf(b32)))
        raise NonFiniteError(nan + inf, nan, inf, int(arr.size))

    def _bins_needed(
        self, batch_amax: float, first_amax: float, scale: np.floating, new_width: bool
    ) -> int:
        """Number of bins after this batch: current (or num_bins) grown to hold batch_amax."""
        current = self.num_bins if new_width else self.nbins
        # Same float arithmetic as the per-element indexing, so this is the batch's top index.
        with np.errstate(over="ignore"):
            top = float(scale.dtype.type(batch_amax) * scale)
        if batch_amax <= first_amax:  # closed top of the initial range
            top = min(top, self.num_bins - 1)
        if not math.isfinite(top) or top >= self.max_bins:
            raise HistogramOverflowError(math.floor(top) + 1 if math.isfinite(top) else top, self.max_bins)
        return max(current, int(top) + 1)

    def _histogram(
        self, arr: np.ndarray, scale: np.floating, first_amax: float, batch_amax: float, nb: int
    ) -> tuple[np.ndarray, int]:
        """Bin counts (length ``nb``) and exact-zero count of one batch whose max is known.

        Indices are < nb by construction of ``nb`` (see :meth:`_bin_block`).
        """
        clip = _clip_mode(scale, first_amax, batch_amax, self.num_bins)
        work, bits, idx = self._scratch(arr.size, scale, nb)
        counts = np.zeros(nb, dtype=np.int64)
        nonzero = 0
        for chunk in _blocks(arr, min(self.chunk_elems, _FAST_BLOCK_ELEMS)):
            nonzero += self._bin_block(_as_float32(chunk), work, bits, idx, scale, first_amax, clip, counts)
        return counts, int(arr.size) - nonzero

    def _histogram_fixed_width(self, arr: np.ndarray) -> tuple[np.ndarray, int, float, float] | None:
        """One pass over a batch once the width is fixed: per block min/max, growth and binning.

        Saves the two separate min/max passes over the whole batch (the blocks are scanned
        while in cache). Gives exactly the counts of :meth:`_histogram`: a value's bin depends
        only on the value and the width, the top clip is a per-element rule, and the largest
        per-block bin count is the batch's (rounding is monotonic).

        Returns:
            ``(counts, zeros, min, max)``, or None when a block is non-finite or would
            overflow ``max_bins``; the caller then takes the two-pass path, which raises the
            same errors (with whole-batch counts) as before.
        """
        scale, first_amax, n0 = self._scale, self.first_amax, self.num_bins
        work, bits, idx = self._scratch(arr.size, scale, self.max_bins)
        counts = np.zeros(self.nbins, dtype=np.int64)
        nonzero = 0
        lo, hi = math.inf, -math.inf
        for chunk in _blocks(arr, min(self.chunk_elems, _FAST_BLOCK_ELEMS)):
            with np.errstate(over="ignore"):  # float64 beyond float32 range -> inf -> None
                b32 = _as_float32(chunk)
            # min/max of the float32 values == float32 of the min/max (monotonic rounding)
            block_lo, block_hi = float(b32.min()), float(b32.max())
            if not (math.isfinite(block_lo) and math.isfinite(block_hi)):
                return None
            block_amax = max(-block_lo, block_hi)
            with np.errstate(over="ignore"):
                top = float(scale.dtype.type(block_amax) * scale)  # the block's top index
            if not math.isfinite(top):
                return None
            clip = "none" if int(top) < n0 else ("all" if block_amax <= first_amax else "some")
            if block_amax <= first_amax:  # closed top of the initial range
                top = min(top, n0 - 1)
            if top >= self.max_bins:
                return None
            if int(top) >= counts.size:
                counts = np.concatenate((counts, np.zeros(int(top) + 1 - counts.size, dtype=np.int64)))
            nonzero += self._bin_block(b32, work, bits, idx, scale, first_amax, clip, counts)
            lo, hi = min(lo, block_lo), max(hi, block_hi)
        return counts, int(arr.size) - nonzero, lo, hi

    def _scratch(self, size: int, scale: np.floating, max_index: int):
        """Work buffers for one update: |x| (scale's dtype), its integer view, bin indices."""
        work = np.empty(min(self.chunk_elems, _FAST_BLOCK_ELEMS, size), dtype=scale.dtype)
        bits = work.view(np.int32 if work.itemsize == 4 else np.int64)
        idx = np.empty(work.size, dtype=np.int32 if max_index <= _INT32_MAX else np.intp)
        return work, bits, idx

    def _bin_block(self, b32: np.ndarray, work: np.ndarray, bits: np.ndarray, idx: np.ndarray,
                   scale: np.floating, first_amax: float, clip: str, counts: np.ndarray) -> int:
        """Add one float32 block to ``counts`` (in place); returns its count of non-zeros.

        ``floor(|x| * scale)`` cast to int32 (intp beyond 2**31 bins) + ``np.bincount``.
        Exact zeros are counted on the integer view of ``|x|`` (+0.0 is the only float with
        all bits clear; NaN is excluded by the min/max checks), several times faster than
        ``count_nonzero`` on floats.
        """
        n = b32.size
        w, i = work[:n], idx[:n]
        np.abs(b32, out=w)
        nonzero = int(np.count_nonzero(bits[:n]))  # before scaling: tiny values may underflow
        np.multiply(w, scale, out=w)
        np.copyto(i, w, casting="unsafe")  # truncation == floor for values >= 0
        if clip == "all":
            np.minimum(i, self.num_bins - 1, out=i)
        elif clip == "some":
            _clip_initial_top(i, b32, self.num_bins, first_amax)
        binned = np.bincount(i, minlength=counts.size)
        if binned.size != counts.size:  # cannot happen unless the max scan and binning disagree
            raise RuntimeError("internal error: histogram index beyond computed range")
        counts += binned
        return nonzero

    def _add_counts(self, counts: np.ndarray) -> None:
        """Add bin counts, growing the histogram with same-width bins if needed."""
        if counts.size > self._hist.size:
            grown = np.zeros(counts.size, dtype=np.int64)
            grown[: self._hist.size] = self._hist
            self._hist = grown
        self._hist[: counts.size] += counts

    # ------------------------------------------------------------------ merge / (de)serialise
    def merge(self, other: TensorStats) -> None:
        """Add another TensorStats of the same tensor (e.g. from another worker) in place.

        Only histograms with the same bin layout can be combined without re-binning: both
        must have the same ``num_bins`` and, if both have a width, the same ``first_amax``.

        Args:
            other: statistics to add; left unchanged.

        Raises:
            ValueError: incompatible bin layouts.
        """
        if other.num_bins != self.num_bins:
            raise ValueError(f"cannot merge: num_bins {self.num_bins} != {other.num_bins}")
        if (
            self.first_amax is not None
            and other.first_amax is not None
            and self.first_amax != other.first_amax
        ):
            raise ValueError(
                f"cannot merge histograms with different bin widths "
                f"(first_amax {self.first_amax!r} vs {other.first_amax!r})"
            )
        if other.count == 0:
            return
        if other.first_amax is not None:
            if self.first_amax is None:
                self._hist = np.zeros(self.num_bins, dtype=np.int64)
                self._hist[0] = self.count
                self.first_amax, self._scale = other.first_amax, other._scale
            self._add_counts(other._hist)
        elif self.first_amax is not None:
            self._hist[0] += other.count  # other saw only zeros
        self.count += other.count
        self.zero_count += other.zero_count
        self.min = other.min if self.min is None else min(self.min, other.min)  # type: ignore[type-var]
        self.max = other.max if self.max is None else max(self.max, other.max)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (floats round-trip exactly through ``json``).

        Returns:
            A dict with format tag, configuration, counters, min/max/first_amax (None when
            unset) and the histogram as a list of ints.
        """
        return {
            "format": _FORMAT,
            "num_bins": self.num_bins,
            "max_bins": self.max_bins,
            "count": self.count,
            "zero_count": self.zero_count,
            "min": self.min,
            "max": self.max,
            "first_amax": self.first_amax,
            "hist": [int(c) for c in self._hist],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> TensorStats:
        """Rebuild from :meth:`to_dict` output.

        Args:
            data: the mapping produced by :meth:`to_dict` (e.g. after a JSON round trip).
            chunk_elems: processing chunk size for later updates (not part of the state).

        Returns:
            A TensorStats equal in state to the one serialised.

        Raises:
            ValueError: wrong format tag or inconsistent content.
        """
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a TensorStats dict (format {data.get('format')!r}, expected {_FORMAT!r})")
        stats = cls(int(data["num_bins"]), chunk_elems=chunk_elems, max_bins=int(data["max_bins"]))
        stats.count = int(data["count"])
        stats.zero_count = int(data["zero_count"])
        stats.min = None if data["min"] is None else float(data["min"])
        stats.max = None if data["max"] is None else float(data["max"])
        hist = np.asarray(data["hist"], dtype=np.int64)
        if data["first_amax"] is not None:
            stats.first_amax = float(data["first_amax"])
            if not (stats.first_amax > 0 and math.isfinite(stats.first_amax)):
                raise ValueError(f"invalid first_amax {stats.first_amax!r}")
            stats._scale = _index_scale(stats.first_amax, stats.num_bins)
            if hist.size < stats.num_bins or int(hist.sum()) != stats.count or (hist < 0).any():
                raise ValueError("histogram inconsistent with num_bins/count")
            stats._hist = hist
        elif hist.size:
            raise ValueError("histogram present without first_amax")
        if (stats.count == 0) != (stats.min is None) or not 0 <= stats.zero_count <= stats.count:
            raise ValueError("counters inconsistent with min/max")
        return stats

    def __repr__(self) -> str:
        return (
            f"TensorStats(count={self.count}, zeros={self.zero_count}, min={self.min}, "
            f"max={self.max}, width={self.width}, nbins={self.nbins})"
        )
