"""Accuracy metrics on arrays whose answers are known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantkit.bench.accuracy import (LabelAccumulator, OutputComparator, cosine_similarity, label_ranks, snr_db,
                                     topk_accuracy)
from quantkit.errors import DataError


def test_cosine_known_values():
    assert cosine_similarity(np.array([1.0, 0.0]), np.array([0.0, 3.0])) == 0.0  # orthogonal
    assert cosine_similarity(np.array([1.0, 2.0]), np.array([2.0, 4.0])) == pytest.approx(1.0)
    assert cosine_similarity(np.array([1.0, 2.0]), np.array([-1.0, -2.0])) == pytest.approx(-1.0)
    assert cosine_similarity(np.zeros(3), np.zeros(3)) == 1.0  # identical (all zero)
    assert cosine_similarity(np.zeros(3), np.ones(3)) == 0.0


def test_snr_known_values():
    ref = np.ones(4)
    assert snr_db(ref, ref) == math.inf  # identical: infinite, not a division error
    assert snr_db(ref, ref * 1.1) == pytest.approx(20.0)  # signal 4, noise 4 * 0.01 -> 100x -> 20 dB
    assert snr_db(np.zeros(2), np.ones(2)) == -math.inf


def test_topk_on_hand_made_logits():
    logits = np.array([
        [0.9, 0.05, 0.03, 0.01, 0.005, 0.005, 0.0],  # label 0: rank 0
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],          # label 0: rank 6 (worst)
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],          # label 2: rank 4 -> top-5 only
        [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0],          # label 1 tied with class 0: lower index wins -> rank 1
    ])
    labels = np.array([0, 0, 2, 1])
    assert list(label_ranks(logits, labels)) == [0, 6, 4, 1]
    assert topk_accuracy(logits, labels, 1) == 25.0
    assert topk_accuracy(logits, labels, 5) == 75.0


def test_nan_scores_never_count_as_correct():
    logits = np.array([[np.nan, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert list(label_ranks(logits, np.array([0, 0]))) == [3, 0]


def test_label_out_of_range_is_a_data_error():
    with pytest.raises(DataError, match="outside the model's 3 classes"):
        label_ranks(np.zeros((1, 3)), np.array([3]))


def test_top5_only_with_more_than_five_classes():
    acc = LabelAccumulator()
    acc.update(np.eye(5), np.arange(5))
    assert acc.result().top1 == 100.0 and acc.result().top5 is None


def test_output_comparator_streams_like_one_pass():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(10, 6)).astype(np.float32)
    test = ref + rng.normal(scale=0.1, size=ref.shape).astype(np.float32)
    test[3] = -ref[3]  # one sample flipped: worst sample cosine -1
    whole, parts = OutputComparator("y"), OutputComparator("y")
    whole.update(ref, test)
    parts.update(ref[:4], test[:4])
    parts.update(ref[4:], test[4:])
    a, b = whole.result(), parts.result()
    assert a.cosine == pytest.approx(cosine_similarity(ref, test))
    assert a.snr_db == pytest.approx(snr_db(ref, test))
    assert a.max_abs_err == pytest.approx(np.abs(ref.astype(np.float64) - test).max())
    assert a.mean_abs_err == pytest.approx(np.abs(ref.astype(np.float64) - test).mean())
    assert a.cosine_min_sample == pytest.approx(-1.0)
    assert a.top1_agreement == pytest.approx(np.mean(ref.argmax(1) == test.argmax(1)))
    for key in ("cosine", "snr_db", "max_abs_err", "mean_abs_err", "cosine_min_sample", "top1_agreement"):
        assert getattr(a, key) == pytest.approx(getattr(b, key)), key
    assert a.shape == [None, 6] and a.elements == 60


def test_identical_outputs_and_non_classifier_shapes():
    comparator = OutputComparator("features")
    features = np.ones((2, 3, 4), np.float32)
    comparator.update(features, features.copy())
    result = comparator.result()
    assert (result.cosine, result.snr_db, result.max_abs_err, result.top1_agreement) == (1.0, math.inf, 0.0, None)
