"""Tests for quantkit.calib.histogram.TensorStats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantkit.calib.histogram import HistogramOverflowError, NonFiniteError, TensorStats


def _state(stats: TensorStats) -> dict:
    """Everything observable, for exact comparisons."""
    return stats.to_dict()


def _gauss(n: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def test_first_batch_sets_width_and_max_lands_in_last_bin():
    x = np.array([-4.0, 0.0, 0.5, 1.0, 2.0], dtype=np.float32)
    s = TensorStats(num_bins=8)
    s.update(x)
    assert s.width == pytest.approx(0.5)
    assert s.nbins == 8
    # |x| = 4, 0, 0.5, 1, 2 -> bins 7 (max folded into last bin), 0, 1, 2, 4
    assert s.hist.tolist() == [1, 1, 1, 0, 1, 0, 0, 1]
    assert (s.min, s.max, s.count, s.zero_count) == (-4.0, 2.0, 5, 1)
    assert s.amax == 4.0


def test_growth_appends_bins_of_same_width():
    s = TensorStats(num_bins=2048)
    first = np.linspace(-1.0, 1.0, 1001, dtype=np.float32)
    s.update(first)
    width = s.width
    hist_before = s.hist.copy()
    second = np.array([2.5, -3.0, 0.25], dtype=np.float32)
    s.update(second)
    assert s.width == width  # never re-binned
    assert s.nbins > 2048
    assert s.nbins == int(3.0 / width) + 1  # exactly enough bins for max 3.0
    assert s.hist.sum() == s.count == 1004
    # old counts untouched, new values in their same-width bins
    delta = s.hist.copy()
    delta[:2048] -= hist_before
    assert delta.sum() == 3
    assert delta[int(2.5 / width)] == 1 and delta[int(3.0 / width)] == 1
    assert delta[int(0.25 / width)] == 1
    assert s.max == 2.5 and s.min == -3.0


def test_values_equal_to_first_max_never_grow_the_histogram():
    x = _gauss(10_000)
    s = TensorStats()
    s.update(x)
    s.update(np.full(100, s.amax, dtype=np.float32))
    s.update(-np.full(100, s.amax, dtype=np.float32))
    assert s.nbins == 2048
    assert s.hist[-1] >= 201


@pytest.mark.parametrize("sizes", [[100_000], [50_000, 50_000], [1, 99_999], [7, 33_333, 66_660], [20_000] * 5])
def test_histogram_independent_of_batch_sizes_when_first_batch_holds_max(sizes):
    x = _gauss(100_000, seed=3)
    # put the global |max| into the first element so every split's first batch holds it
    k = int(np.argmax(np.abs(x)))
    x[[0, k]] = x[[k, 0]]
    ref = TensorStats()
    ref.update(x)
    s = TensorStats()
    start = 0
    for size in sizes:
        s.update(x[start : start + size])
        start += size
    assert start == x.size
    assert _state(s) == _state(ref)


def test_batch_order_after_first_batch_does_not_matter():
    first = _gauss(10_000, seed=1)
    b, c = _gauss(5_000, seed=2) * 3, _gauss(5_000, seed=3) * 0.5
    s1, s2 = TensorStats(), TensorStats()
    for batch in (first, b, c):
        s1.update(batch)
    for batch in (first, c, b):
        s2.update(batch)
    assert s1.nbins > 2048  # b forced growth
    assert _state(s1) == _state(s2)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x,
        lambda x: x.reshape(100, 300)[:, ::3],  # non-contiguous view
        lambda x: x.reshape(100, 300).T,  # Fortran order
        lambda x: x.astype(np.float64),
        lambda x: x.astype(np.float16),
        lambda x: (x * 20).astype(np.int32),
    ],
    ids=["f32", "strided", "transposed", "f64", "f16", "int32"],
)
def test_chunking_gives_identical_results(make):
    data = make(_gauss(30_000, seed=5))
    small = TensorStats(chunk_elems=999)  # many uneven chunks
    big = TensorStats()
    small.update(data)
    big.update(data)
    assert _state(small) == _state(big)
    assert small.count == data.size
    # and against a from-scratch computation in float32
    a = np.abs(np.asarray(data, dtype=np.float32)).ravel()
    assert small.zero_count == int((a == 0).sum())
    assert small.amax == float(a.max())


def test_counts_match_numpy_histogram_away_from_edges():
    x = _gauss(200_000, seed=7)
    s = TensorStats()
    s.update(x)
    a = np.abs(x).astype(np.float64)
    ref, _ = np.histogram(a, bins=2048, range=(0, float(a.max())))
    # float32 indexing may move values lying within ~1e-7 of an edge; allow a tiny difference
    assert np.abs(s.hist - ref).sum() <= 10
    assert s.hist.sum() == ref.sum()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_and_leaves_state_untouched(bad):
    s = TensorStats()
    s.update(_gauss(1000))
    before = _state(s)
    x = _gauss(1000, seed=1)
    x[[3, 500]] = bad
    with pytest.raises(NonFiniteError) as info:
        s.update(x)
    assert isinstance(info.value, ValueError)
    assert info.value.count == 2 and info.value.total == 1000
    assert (info.value.nan_count == 2) == bool(np.isnan(bad))
    assert "2 non-finite" in str(info.value)
    assert _state(s) == before


def test_non_finite_on_first_batch_and_float64_overflow():
    s = TensorStats()
    with pytest.raises(NonFiniteError):
        s.update(np.array([1.0, np.nan], dtype=np.float32))
    assert s.count == 0 and s.width is None
    with pytest.raises(NonFiniteError) as info:
        s.update(np.array([1.0, 1e300, -1e300], dtype=np.float64))  # beyond float32 range
    assert info.value.inf_count == 2


def test_all_zero_batches_then_data():
    s = TensorStats(num_bins=16)
    s.update(np.zeros((4, 5), dtype=np.float32))
    assert s.width is None and s.nbins == 0 and s.amax == 0.0
    assert (s.count, s.zero_count, s.min, s.max) == (20, 20, 0.0, 0.0)
    s.update(np.array([0.0, 1.0, -0.5], dtype=np.float32))
    assert s.width == pytest.approx(1.0 / 16)
    assert s.hist[0] == 21  # 20 earlier zeros + this batch's zero
    assert s.hist.sum() == s.count == 23
    assert s.zero_count == 21


def test_zero_count_and_signed_extremes():
    x = np.array([[0.0, -0.0, 3.0], [-7.5, 0.0, 1e-30]], dtype=np.float32)
    s = TensorStats()
    s.update(x)
    assert s.zero_count == 3
    assert (s.min, s.max) == (-7.5, 3.0)
    s.update(np.array([True, False]))  # bool accepted as 1.0 / 0.0
    assert s.zero_count == 4 and s.count == 8


def test_empty_array_is_noop_and_bad_dtype_rejected():
    s = TensorStats()
    s.update(np.zeros((0, 3), dtype=np.float32))
    assert s.count == 0 and s.min is None
    with pytest.raises(TypeError):
        s.update(np.array([1 + 2j]))
    with pytest.raises(TypeError):
        s.update(np.array(["a"]))


def test_overflow_error_when_growth_exceeds_max_bins():
    s = TensorStats(num_bins=64, max_bins=128)
    s.update(np.array([1.0], dtype=np.float32))
    s.update(np.array([1.9], dtype=np.float32))  # 122 bins: fine
    assert s.nbins == int(1.9 * 64) + 1
    with pytest.raises(HistogramOverflowError):
        s.update(np.array([2.5], dtype=np.float32))
    assert s.nbins == int(1.9 * 64) + 1 and s.count == 2


def test_tiny_first_range_uses_float64_indexing():
    s = TensorStats(num_bins=32)
    s.update(np.array([1e-37, 5e-38, 0.0], dtype=np.float32))
    assert s.nbins == 32 and s.hist[-1] == 1 and s.hist.sum() == 3


def test_to_dict_json_round_trip_and_continued_updates():
    s = TensorStats(num_bins=256)
    s.update(_gauss(5000))
    s.update(_gauss(5000, seed=1) * 2)
    clone = TensorStats.from_dict(json.loads(json.dumps(s.to_dict())))
    assert clone.to_dict() == s.to_dict()
    more = _gauss(3000, seed=9) * 4
    s.update(more)
    clone.update(more)
    assert clone.to_dict() == s.to_dict()
    empty = TensorStats.from_dict(json.loads(json.dumps(TensorStats().to_dict())))
    assert empty.count == 0 and empty.width is None


def test_from_dict_rejects_inconsistent_data():
    d = TensorStats(num_bins=8)
    d.update(np.array([1.0, 2.0], dtype=np.float32))
    good = d.to_dict()
    with pytest.raises(ValueError):
        TensorStats.from_dict({**good, "format": "other"})
    with pytest.raises(ValueError):
        TensorStats.from_dict({**good, "count": 3})
    with pytest.raises(ValueError):
        TensorStats.from_dict({**good, "hist": [1, 1]})


def test_merge_equals_sequential_updates():
    # Two workers whose first batches share the max (hence the width) can be merged.
    first = _gauss(4000, seed=1)
    r1, r2 = _gauss(4000, seed=2) * 2, _gauss(4000, seed=3) * 0.3
    w1, w2, seq = TensorStats(), TensorStats(), TensorStats()
    for batch in (first, r1):
        w1.update(batch)
    for batch in (first, r2):
        w2.update(batch)
    for batch in (first, r1, first, r2):
        seq.update(batch)
    w1.merge(w2)
    assert w1.to_dict() == seq.to_dict()
    before = w1.to_dict()
    w1.merge(TensorStats())  # empty other is a no-op
    assert w1.to_dict() == before
    fresh = TensorStats()
    fresh.merge(w2)
    assert fresh.to_dict() == w2.to_dict()


def test_merge_zero_only_stats_and_incompatible_widths():
    a = TensorStats(num_bins=8)
    a.update(np.array([1.0, 0.5], dtype=np.float32))
    zeros = TensorStats(num_bins=8)
    zeros.update(np.zeros(3, dtype=np.float32))
    a.merge(zeros)
    assert a.hist[0] == 3 and a.count == 5 and a.zero_count == 3
    zeros.merge(a)
    assert zeros.width == a.width and zeros.hist[0] == 6 and zeros.count == 8
    other = TensorStats(num_bins=8)
    other.update(np.array([2.0], dtype=np.float32))
    with pytest.raises(ValueError):
        a.merge(other)
    with pytest.raises(ValueError):
        a.merge(TensorStats(num_bins=16))


def test_hist_view_is_read_only():
    s = TensorStats()
    s.update(_gauss(100))
    with pytest.raises(ValueError):
        s.hist[0] = 5
    edges = s.bin_edges()
    assert edges.size == s.nbins + 1 and edges[-1] == pytest.approx(s.amax)


def test_constructor_validation():
    with pytest.raises(ValueError):
        TensorStats(num_bins=0)
    with pytest.raises(ValueError):
        TensorStats(chunk_elems=True)
    with pytest.raises(ValueError):
        TensorStats(num_bins=64, max_bins=32)


def test_max_bins_equal_to_num_bins_allows_the_initial_range():
    s = TensorStats(num_bins=16, max_bins=16)
    s.update(np.array([1.0, 0.25], dtype=np.float32))
    s.update(np.array([1.0], dtype=np.float32))
    assert s.nbins == 16 and s.hist[-1] == 2
    with pytest.raises(HistogramOverflowError):
        s.update(np.array([1.01], dtype=np.float32))


def test_huge_jump_overflows_instead_of_allocating():
    s = TensorStats()
    s.update(np.array([1e-3], dtype=np.float32))
    with pytest.raises(HistogramOverflowError):
        s.update(np.array([3e38], dtype=np.float32))  # index overflows float32 -> inf


def test_edges_hit_first_amax_exactly():
    x = np.random.default_rng(12).uniform(-3, 3, 1000).astype(np.float32)
    s = TensorStats(num_bins=1000)  # not a power of two
    s.update(x)
    assert s.edge(s.num_bins) == s.first_amax == s.amax
    assert s.bin_edges()[-1] == s.first_amax
    assert s.edge(500) == pytest.approx(s.first_amax / 2)


# ----------------------------------------------------------------------------- fast paths
def _two_pass(monkeypatch):
    """Force the whole-batch min/max scan + binning path (the one the first batch takes)."""
    monkeypatch.setattr(TensorStats, "_histogram_fixed_width", lambda self, arr: None)


def _later_batches(seed: int) -> list[np.ndarray]:
    """Batches after a first one of _gauss(..) scale: growth, edge values, zeros, -0.0, dtypes."""
    rng = np.random.default_rng(seed)
    x = _gauss(70_000, seed=seed)
    edge = np.array([1.0, -1.0, np.nextafter(1.0, 0.0), np.nextafter(1.0, 2.0), 1.0001], dtype=np.float32)
    return [
        x * 0.5,
        x * 3,  # grows the histogram, clip "some"
        np.concatenate([x[:1000] * 0.1, -np.zeros(500, dtype=np.float32), np.zeros(7, dtype=np.float32)]),
        (x * 2).astype(np.float64).reshape(70, 1000)[:, ::3],  # float64, non-contiguous
        (x * 20).astype(np.int32),
        rng.choice(edge, 5000),  # values at / around first_amax after rescaling below
    ]


@pytest.mark.parametrize("chunk", [999, 1 << 16, 1 << 24])
def test_fixed_width_single_pass_equals_two_pass_scan(monkeypatch, chunk):
    first = _gauss(100_000, seed=20)
    fast = TensorStats(chunk_elems=chunk)
    fast.update(first)
    batches = _later_batches(21)
    batches[-1] = batches[-1] * np.float32(fast.first_amax)  # exactly first_amax and neighbours
    for batch in batches:
        fast.update(batch)
    assert fast.nbins > fast.num_bins  # growth happened
    _two_pass(monkeypatch)
    slow = TensorStats(chunk_elems=chunk)
    for batch in [first, *batches]:
        slow.update(batch)
    assert _state(fast) == _state(slow)


def test_fixed_width_errors_match_the_two_pass_path(monkeypatch):
    def run(batch):
        s = TensorStats(chunk_elems=1000, max_bins=4096)
        s.update(_gauss(5000))
        before = _state(s)
        with pytest.raises((NonFiniteError, HistogramOverflowError)) as info:
            s.update(batch)
        assert _state(s) == before  # untouched
        return type(info.value), str(info.value)

    overflow_then_nan = _gauss(5000, seed=1)
    overflow_then_nan[10] = 1e6  # a block that would overflow max_bins ...
    overflow_then_nan[[3000, 4000]] = np.nan  # ... before later blocks holding NaN
    overflow = _gauss(5000, seed=2)
    overflow[4500] = -1e6
    wide = np.array([1.0, 1e300, np.nan], dtype=np.float64)  # float64 beyond float32, and NaN
    fast = [run(b) for b in (overflow_then_nan, overflow, wide)]
    _two_pass(monkeypatch)
    assert fast == [run(b) for b in (overflow_then_nan, overflow, wide)]
    assert fast[0][0] is NonFiniteError and "2 non-finite value(s) out of 5000" in fast[0][1]
    assert fast[1][0] is HistogramOverflowError


def test_intp_indices_beyond_int32_give_the_same_counts(monkeypatch):
    import quantkit.calib.histogram as H

    batches = [_gauss(50_000, seed=30), *_later_batches(31)[:3]]
    ref = TensorStats()
    for batch in batches:
        ref.update(batch)
    monkeypatch.setattr(H, "_INT32_MAX", 100)  # every update takes the intp index path
    wide = TensorStats()
    for batch in batches:
        wide.update(batch)
    assert _state(wide) == _state(ref)


def test_negative_zero_counts_as_zero():
    s = TensorStats()
    s.update(np.array([1.0, -0.0, 0.0], dtype=np.float32))
    s.update(np.array([-0.0, -0.0, 2.0, 1e-45], dtype=np.float32))  # 1e-45: denormal, not zero
    assert s.zero_count == 4 and s.count == 7
    assert s.min == -0.0 and s.max == 2.0
