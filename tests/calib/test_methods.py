"""Tests for quantkit.calib.methods (range methods on TensorStats)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from quantkit.calib import methods as M
from quantkit.calib.histogram import TensorStats


def _stats(x, num_bins: int = 2048) -> TensorStats:
    s = TensorStats(num_bins=num_bins)
    s.update(np.asarray(x, dtype=np.float32))
    return s


@pytest.fixture(scope="module")
def gauss():
    x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    return x, _stats(x)


# ----------------------------------------------------------------------------- entropy
def brute_force_kl(hist, nq, start_bin):
    """Reference KL search written from the published description with plain loops.

    Levels come from NVIDIA's ports (np.digitize against np.linspace(0, i, nq + 1)); P
    folds the tail into bin i-1, Q spreads each level's (tail-free) mass evenly over its
    non-empty bins, KL is summed over P > 0 and is inf where Q == 0 < P.
    """
    n = len(hist)
    candidates, kls = [], []
    for i in range(start_bin, n + 1):
        tail = sum(int(c) for c in hist[i:])
        p = [float(c) for c in hist[:i]]
        p[-1] += tail
        levels = np.digitize(range(i), np.linspace(0, i, nq + 1)) - 1
        level_mass = [0.0] * nq
        level_filled = [0] * nq
        for j in range(i):
            if hist[j] > 0:
                level_mass[levels[j]] += float(hist[j])
                level_filled[levels[j]] += 1
        q = [0.0] * i
        for j in range(i):
            if hist[j] > 0:
                q[j] = level_mass[levels[j]] / level_filled[levels[j]]
        sp, sq = sum(p), sum(q)
        kl = 0.0
        for pj, qj in zip(p, q):
            if pj > 0:
                if qj == 0:
                    kl = math.inf
                    break
                kl += (pj / sp) * math.log((pj / sp) / (qj / sq))
        candidates.append(i)
        kls.append(kl)
    best = min(kls)
    pick = max(k for k, v in enumerate(kls) if v <= best + 1e-12)  # last index reaching min
    return np.array(candidates), np.array(kls), candidates[pick]


def _random_hist(rng, n, sparse):
    """Decaying random histogram, optionally with many empty bins (to exercise inf KL)."""
    scale = np.exp(-np.linspace(0, 6, n)) * 5000
    h = rng.poisson(scale)
    if sparse:
        h[rng.random(n) < 0.3] = 0
    h[0] = max(h[0], 1)
    return h


@pytest.mark.parametrize(
    "n, nq, start_bin, sparse, seed",
    [(256, 32, 32, False, 0), (300, 32, 32, True, 1), (400, 128, 128, False, 2), (333, 128, 128, True, 3)],
)
def test_vectorised_kl_matches_brute_force(n, nq, start_bin, sparse, seed):
    h = _random_hist(np.random.default_rng(seed), n, sparse)
    cands, kl = M.kl_divergences(h, num_quantized_bins=nq, start_bin=start_bin)
    ref_cands, ref_kl, ref_pick = brute_force_kl(h, nq, start_bin)
    np.testing.assert_array_equal(cands, ref_cands)
    assert np.array_equal(np.isinf(kl), np.isinf(ref_kl))
    if sparse:
        assert np.isinf(kl).any()  # the Q == 0 < P case was exercised
    finite = np.isfinite(kl)
    np.testing.assert_allclose(kl[finite], ref_kl[finite], rtol=1e-9, atol=1e-13)
    assert cands[M._pick_last_min(kl, 1e-12)] == ref_pick


def _kl_per_candidate(hist, nq, start_bin, stride=1):
    """The previous implementation, one numpy pass per candidate; kept as the bit-exact reference
    for the blocked kl_divergences (same formula, same float operations per candidate)."""
    h = np.asarray(hist, dtype=np.int64)
    total = int(h.sum())
    cum = np.concatenate(([0], np.cumsum(h)))
    cum_nz = np.concatenate(([0], np.cumsum(h > 0)))
    nz = np.flatnonzero(h)
    nz_counts = h[nz].astype(np.float64)
    nz_scaled = nz.astype(np.float64) * nq
    level_ids = np.arange(nq + 1, dtype=np.int64)
    cands = M._candidates(h.size, start_bin, stride)
    kl = np.empty(cands.size, dtype=np.float64)
    for c, i in enumerate(cands.tolist()):
        tail = total - int(cum[i])
        if h[i - 1] == 0 and tail > 0:
            kl[c] = math.inf
            continue
        k = int(np.searchsorted(nz, i))
        bounds = (level_ids * i + (nq - 1)) // nq
        mass = np.diff(cum[bounds]).astype(np.float64)
        filled = np.diff(cum_nz[bounds])
        level_q = np.divide(mass, filled, out=np.zeros_like(mass), where=filled > 0)
        q = level_q[(nz_scaled[:k] / i).astype(np.intp)]
        p = nz_counts[:k]
        if tail:
            p = p.copy()
            p[-1] += tail
        kl[c] = float(np.dot(p, np.log(p / q))) / total + math.log(int(cum[i]) / total)
    return cands, kl


@pytest.mark.parametrize("block", [1, 1000, 1 << 16])
def test_blocked_kl_is_bit_identical_to_per_candidate_evaluation(monkeypatch, block):
    monkeypatch.setattr(M, "_KL_BLOCK_ELEMS", block)
    rng = np.random.default_rng(11)
    for trial in range(40):
        n = int(rng.integers(1, 1500))
        h = rng.poisson(np.exp(-np.linspace(0, rng.uniform(1, 12), n)) * rng.uniform(1, 1e8))
        if trial % 2:
            h[rng.random(n) < rng.uniform(0, 0.95)] = 0  # empty bins: inf candidates, sparse levels
        h[0] = max(h[0], 1)
        nq = int(rng.choice([1, 7, 32, 128]))
        start_bin = int(rng.integers(1, 300))
        stride = int(rng.choice([1, 3, 7]))
        cands, kl = M.kl_divergences(h, num_quantized_bins=nq, start_bin=start_bin, stride=stride)
        ref_cands, ref_kl = _kl_per_candidate(h, nq, start_bin, stride)
        np.testing.assert_array_equal(cands, ref_cands)
        assert kl.tobytes() == ref_kl.tobytes()  # bit for bit, inf included


def test_blocked_kl_on_realistic_histograms_matches_reference_and_brute_force():
    x = np.random.default_rng(12).standard_normal(300_000).astype(np.float32)
    relu = _stats(np.maximum(x, 0) * 3)
    gauss = _stats(x)
    gauss.update(x * 1.3)  # grown histogram: more bins than num_bins
    for s in (relu, gauss):
        h = np.array(s.hist, dtype=np.int64)
        h[0] = h[1]
        _, kl = M.kl_divergences(h)
        _, ref = _kl_per_candidate(h, 128, 128)
        assert kl.tobytes() == ref.tobytes()
    _, _, pick = brute_force_kl(gauss.hist[:400], 128, 128)
    cands, kl = M.kl_divergences(gauss.hist[:400])
    assert cands[M._pick_last_min(kl, 1e-12)] == pick


def test_entropy_method_uses_kl_search_and_amax_is_i_times_width():
    h_data = np.random.default_rng(4).standard_normal(50_000)
    s = _stats(h_data, num_bins=400)
    r = M.entropy(s, num_quantized_bins=128, start_bin=128, copy_bin1_to_bin0=False)
    _, _, pick = brute_force_kl(s.hist, 128, 128)
    assert r.amax == s.edge(pick)
    tail = s.hist[pick:].sum() / s.count
    assert r.clipped_fraction == pytest.approx(tail, abs=1e-12)
    assert r.method == "entropy" and r.params["num_quantized_bins"] == 128


def test_entropy_copy_bin1_to_bin0_matches_port_preprocessing():
    x = np.maximum(np.random.default_rng(5).standard_normal(50_000), 0)
    s = _stats(x, num_bins=300)
    h = s.hist.copy()
    h[0] = h[1]
    _, _, pick = brute_force_kl(h, 128, 128)
    assert M.entropy(s).amax == s.edge(pick)  # default copies bin 1 into bin 0


def test_entropy_gaussian_clips_the_tail(gauss):
    x, s = gauss
    sigma = float(x.std())
    r = M.entropy(s)
    # Measured with this algorithm (== NVIDIA's ports): ~4.3-4.9 sigma for 1M samples.
    assert 4.0 * sigma <= r.amax <= 5.0 * sigma
    assert r.amax < s.amax
    assert 0 < r.clipped_fraction < 1e-4


def test_entropy_heavy_tail_clips_well_below_max():
    x = np.random.default_rng(6).laplace(size=1_000_000).astype(np.float32)
    s = _stats(x)
    r = M.entropy(s)
    assert r.amax < 0.8 * s.amax
    assert r.clipped_fraction > 1e-5


def test_entropy_uniform_keeps_nearly_full_range():
    x = np.random.default_rng(7).uniform(-3, 3, 500_000).astype(np.float32)
    s = _stats(x)
    r = M.entropy(s)
    assert r.amax == s.amax  # full range wins; i = num_bins maps exactly to the max
    assert r.clipped_fraction == 0.0


def test_entropy_relu_zero_spike_handling():
    x = np.maximum(np.random.default_rng(8).standard_normal(1_000_000), 0).astype(np.float32)
    s = _stats(x)
    with_copy = M.entropy(s)
    literal = M.entropy(s, copy_bin1_to_bin0=False)
    assert with_copy.amax > 4.0 and with_copy.clipped_fraction < 1e-4
    assert literal.amax < 2.5 and literal.clipped_fraction > 0.005  # spike dominates KL


def test_entropy_stride_keeps_full_range_candidate(gauss):
    _, s = gauss
    cands, _ = M.kl_divergences(s.hist, stride=7)
    assert cands[0] == 128 and cands[-1] == s.nbins and np.all(np.diff(cands) > 0)
    strided = M.entropy(s, stride=4)
    assert abs(strided.amax - M.entropy(s).amax) < 0.1 * s.amax


def test_entropy_fewer_bins_than_start_bin():
    s = _stats(np.linspace(0, 1, 1000), num_bins=64)
    r = M.entropy(s)
    assert r.amax == pytest.approx(1.0)  # only candidate: the full range


# ----------------------------------------------------------------------------- minmax
def test_minmax_known_arrays():
    r = M.minmax(_stats([-3.0, 1.0, 2.0]))
    assert (r.amax, r.clipped_fraction, r.method, r.params) == (3.0, 0.0, "minmax", {})
    assert M.minmax(_stats([0.5, 2.25])).amax == 2.25


# ----------------------------------------------------------------------------- percentile
def test_percentile_interpolates_within_bins():
    x = (np.arange(1, 100_001) / 100_000.0).astype(np.float32)  # ~uniform on (0, 1]
    s = _stats(x)
    for pct in (50.0, 90.0, 99.0, 99.99):
        r = M.percentile(s, percentile=pct)
        assert r.amax == pytest.approx(pct / 100, abs=1e-4)  # well inside one bin width (~5e-4)
        assert r.clipped_fraction == pytest.approx(1 - pct / 100, abs=1e-4)
    assert M.percentile(s, percentile=100).amax == s.amax


def test_percentile_matches_numpy_on_gaussian(gauss):
    x, s = gauss
    a = np.abs(x)
    for pct in (99.0, 99.9, 99.99):
        assert M.percentile(s, percentile=pct).amax == pytest.approx(np.percentile(a, pct), abs=s.width)


def test_percentile_zero_spike_and_validation():
    x = np.concatenate([np.zeros(600), np.linspace(0.1, 1, 400)])
    s = _stats(x)
    assert M.percentile(s, percentile=50).amax == 0.0
    assert M.percentile(s, percentile=70).amax == pytest.approx(0.1 + 0.9 * 0.25, abs=3e-3)
    for bad in (-1, 100.5):
        with pytest.raises(ValueError):
            M.percentile(s, percentile=bad)


# ----------------------------------------------------------------------------- mse
def _empirical_mse(a: np.ndarray, amax: float) -> float:
    s = amax / 127
    q = np.minimum(np.floor(a / s + 0.5), 127) * s
    return float(np.mean((q - a) ** 2))


def test_mse_error_model_matches_data():
    x = np.random.default_rng(9).standard_normal(200_000)
    x[:50_000] = 0.0  # exact zeros must not be charged rounding error
    s = _stats(x)
    a = np.abs(x.astype(np.float32)).astype(np.float64)
    cands = np.arange(128, s.nbins + 1, 96)
    model = M.mse_errors(s, cands)
    empirical = np.array([_empirical_mse(a, i * s.width) for i in cands])
    np.testing.assert_allclose(model, empirical, rtol=0.01)


def test_mse_gaussian_optimum(gauss):
    x, s = gauss
    r = M.mse(s)
    sigma = float(x.std())
    assert 3.6 * sigma <= r.amax <= 4.3 * sigma  # analytic 8-bit Gaussian optimum ~3.9 sigma
    a = np.abs(x).astype(np.float64)
    grid = [i * s.width for i in range(1200, s.nbins + 1, 16)]
    best = min(_empirical_mse(a, amax) for amax in grid)
    assert _empirical_mse(a, r.amax) <= best * 1.01


def test_mse_uniform_keeps_nearly_full_range_and_stride():
    s = _stats(np.random.default_rng(10).uniform(-1, 1, 200_000))
    r = M.mse(s)
    assert 0.97 * s.amax <= r.amax <= s.amax
    assert M.mse(s, stride=8).amax == pytest.approx(r.amax, rel=0.02)


# ----------------------------------------------------------------------------- shared
@pytest.mark.parametrize("name", sorted(M.METHODS))
def test_empty_and_all_zero_stats_give_zero(name):
    for s in (TensorStats(), _stats(np.zeros(100))):
        r = M.METHODS[name](s)
        assert (r.amax, r.clipped_fraction, r.method) == (0.0, 0.0, name)


@pytest.mark.parametrize("name", sorted(M.METHODS))
def test_methods_are_deterministic(name):
    x = np.random.default_rng(11).standard_normal(100_000) * 3
    a, b = _stats(x), _stats(x)
    r1, r2, r3 = M.METHODS[name](a), M.METHODS[name](a), M.METHODS[name](b)
    assert r1 == r2 == r3
    assert isinstance(r1.amax, float) and math.isfinite(r1.amax)


def test_range_result_is_frozen():
    r = M.RangeResult(1.0, "minmax", {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.amax = 2.0  # type: ignore[misc]


def test_compute_range_dispatch_and_errors(gauss):
    _, s = gauss
    assert M.compute_range(s, "percentile", percentile=99.0) == M.percentile(s, percentile=99.0)
    with pytest.raises(ValueError, match="did you mean 'entropy'"):
        M.compute_range(s, "entropi")
    with pytest.raises(TypeError):
        M.compute_range(s, "minmax", percentile=1)


def test_fraction_above_is_consistent_with_the_histogram():
    s = _stats(np.linspace(0, 1, 10_001))
    assert M.fraction_above(s, 0.5) == pytest.approx(0.5, abs=1e-3)
    assert M.fraction_above(s, 1.0) == 0.0
    assert M.fraction_above(s, 2.0) == 0.0
