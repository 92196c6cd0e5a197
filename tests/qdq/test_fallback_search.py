"""The sensitivity search's pieces on their own: greedy selection (fake scores), neighbours, local errors."""

from __future__ import annotations

import math

import pytest

from quantkit.qdq import placement
from quantkit.qdq import testing as tiny
from quantkit.qdq.cpu import write_cpu_qdq
from quantkit.qdq.fallback_search import (EvalBatch, OutputScorer, Score, adjacent_nodes, search_fallback,
                                          significant_gain)
from quantkit.qdq.sensitivity_metrics import local_errors, rank_by_local_error


def additive_scores(gains: dict[str, float], base: float = 0.90, failing: tuple[str, ...] = ()):
    """score(set) = base + sum of the nodes' gains (cosine and 'agreement' alike); records every call."""
    calls: list[tuple[str, ...]] = []

    def score(float_set):
        calls.append(tuple(float_set))
        if any(node in failing for node in float_set):
            return Score(math.nan, None, math.nan, error="refused")
        value = min(1.0, base + sum(gains.get(node, 0.0) for node in float_set))
        return Score(value, value, 10.0)

    return score, calls


def test_budget_met_by_all_int8_needs_no_search():
    score, calls = additive_scores({"a": 0.05}, base=0.99)
    result = search_fallback(score, ["a", "b"], metric="cosine", target=0.98, cap=2, candidates=2)
    assert result.met and result.chosen == [] and calls == [()]


def test_greedy_takes_the_best_nodes_then_prunes_the_unneeded():
    gains = {"a": 0.01, "b": 0.05, "c": 0.04, "d": 0.0}
    score, _ = additive_scores(gains)
    result = search_fallback(score, ["a", "b", "c", "d"], metric="cosine", target=0.985, cap=3, candidates=4)
    assert result.met and sorted(result.chosen) == ["b", "c"]
    assert result.final.cosine == pytest.approx(0.99)
    assert set(result.leave_one_out) == {"a", "b", "c", "d"}


def test_prune_drops_an_early_choice_made_redundant_later():
    # a is the best single node, but b and c together do more than all three need
    def score(float_set):
        s = set(float_set)
        value = 0.90 + 0.04 * ("a" in s) + 0.03 * (len(s & {"b", "c"}) == 1) + 0.09 * ({"b", "c"} <= s)
        return Score(value, value, 10.0)

    result = search_fallback(score, ["a", "b", "c"], metric="cosine", target=0.985, cap=3, candidates=3,
                             neighbours={"b": ["c"]})
    assert result.met and sorted(result.chosen) == ["b", "c"]
    assert [step["node"] for step in result.steps if step["action"] == "drop" and step["accepted"]] == ["a"]


def test_unreachable_budget_keeps_the_best_set_within_the_cap():
    score, _ = additive_scores({"a": 0.02, "b": 0.01, "c": 0.005})
    result = search_fallback(score, ["a", "b", "c"], metric="cosine", target=0.99, cap=2, candidates=3)
    assert not result.met
    assert result.chosen == ["a", "b"] and result.final.cosine == pytest.approx(0.93)


def test_unreachable_budget_never_keeps_nodes_that_do_not_raise_the_budget_metric():
    calls = []

    def score(float_set):  # cosine improves, agreement does not
        calls.append(tuple(float_set))
        return Score(0.9 + 0.01 * len(float_set), 0.8, 10.0)

    result = search_fallback(score, ["a", "b"], metric="top1_agreement", target=0.95, cap=2, candidates=2)
    assert not result.met and result.chosen == []
    assert result.final.top1_agreement == 0.8


def test_unreachable_budget_drops_a_set_whose_gain_is_within_the_noise():
    # agreement on 64 samples: the best set flips one sample back (+1/64), less than min_gain 2/64
    def score(float_set):
        return Score(0.99 + 0.001 * len(float_set), 0.875 + (1 / 64 if float_set else 0.0), 30.0)

    result = search_fallback(score, ["a", "b"], metric="top1_agreement", target=0.95, cap=2, candidates=2,
                             min_gain=significant_gain("top1_agreement", 64))
    assert not result.met and result.chosen == [] and result.final.top1_agreement == 0.875
    assert result.steps[-1]["action"] == "keep_none"
    # two samples more is kept
    def better(float_set):
        return Score(0.99, 0.875 + (2 / 64) * len(float_set) / 2, 30.0)

    kept = search_fallback(better, ["a", "b"], metric="top1_agreement", target=0.95, cap=2, candidates=2,
                           min_gain=significant_gain("top1_agreement", 64))
    assert kept.chosen and kept.final.top1_agreement == pytest.approx(0.875 + 2 / 64)


def test_significant_gain_is_two_samples_for_agreement_and_any_rise_for_cosine():
    assert significant_gain("top1_agreement", 64) == pytest.approx(2 / 64)
    assert significant_gain("cosine", 64) == 0.0


def test_refused_candidates_are_skipped():
    score, _ = additive_scores({"a": 0.2, "b": 0.09}, failing=("a",))
    result = search_fallback(score, ["a", "b"], metric="cosine", target=0.98, cap=2, candidates=2)
    assert result.leave_one_out["a"].error == "refused"
    assert result.met and result.chosen == ["b"]


def test_neighbours_of_the_chosen_set_are_tried():
    # c alone does nothing (it is outside the beam), but next to a it removes a Q/DQ pair
    def score(float_set):
        s = set(float_set)
        value = 0.90 + 0.03 * ("a" in s) + (0.06 if {"a", "c"} <= s else 0.0) + 0.001 * ("b" in s)
        return Score(value, value, 10.0)

    result = search_fallback(score, ["a", "b", "x", "c"], metric="cosine", target=0.98, cap=2, candidates=3,
                             neighbours={"a": ["c"]}, beam=2)
    assert result.met and result.chosen == ["a", "c"]


def test_cap_zero_only_scores_the_baseline():
    score, calls = additive_scores({"a": 0.5})
    result = search_fallback(score, ["a"], metric="cosine", target=0.99, cap=0, candidates=1)
    assert not result.met and result.chosen == [] and calls == [()]


def test_adjacent_nodes_walk_through_unmeasured_ops():
    model = tiny.residual_cnn()
    reported = [n.name for n in placement.quantizable_nodes(model) if n.reported]
    near = adjacent_nodes(model, reported)
    assert near["conv1"][0] == "conv2"  # through relu1
    assert "add" in near["conv3"] and "conv2" in near["conv3"]
    assert "conv1" not in near["conv3"]  # two unmeasured hops away at least


def _all_int8_local_errors(model, ranges):
    """local_errors of every reported node of the all-INT8 CPU flavour, as a list and by name."""
    nodes = placement.select_nodes(placement.quantizable_nodes(model), placement.CPU)
    reported = [n.name for n in placement.quantizable_nodes(model) if n.reported]
    qmodel = write_cpu_qdq(model, ranges, nodes)
    errors = local_errors(model, qmodel, reported, [tiny.random_feeds(model, 4, seed) for seed in (7, 8)])
    return errors, {e.name: e for e in errors}


def test_local_errors_on_a_residual_cnn(residual):
    model, ranges = residual
    errors, by_name = _all_int8_local_errors(model, ranges)
    assert set(by_name) >= {"conv1", "conv2", "conv3", "add", "gap", "fc"}
    first = by_name["conv1"]
    # the first node's error is all its own: input Q/DQ, weights, output rounding
    assert first.local_snr_db == pytest.approx(first.snr_db, abs=0.5)
    assert all(0.5 < e.cosine <= 1.0 and math.isfinite(e.snr_db) for e in errors)
    assert sorted(rank_by_local_error(errors)) == sorted(by_name)


def test_output_scorer_scores_the_reference_as_perfect_and_refuses_broken_models(residual):
    model, _ = residual
    batches = [EvalBatch(tiny.random_feeds(model, 4, 3), 4)]
    scorer = OutputScorer(model, batches)
    perfect = scorer.score(model)
    assert perfect.cosine == pytest.approx(1.0) and perfect.top1_agreement == 1.0
    broken = model.__class__()
    broken.CopyFrom(model)
    broken.graph.node[0].op_type = "NoSuchOp"
    assert scorer.score(broken).error is not None and scorer.evaluations == 2


def test_local_errors_see_through_the_folded_squeeze_excite_gate(squeeze_excite):
    """The CPU flavour folds the HardSigmoid into se_fc2's requantization: se_fc2's output Q now holds
    the gate, not se_fc2's output rounded; every node must still be measured against its own tensor."""
    model, ranges = squeeze_excite
    errors, by_name = _all_int8_local_errors(model, ranges)
    assert {"se_fc2", "se_mul", "conv3"} <= set(by_name)
    assert by_name["se_fc2"].snr_db > 25 and by_name["se_fc2"].cosine > 0.99  # not compared with the gate
    assert by_name["se_mul"].snr_db > 20 and by_name["se_mul"].cosine > 0.99  # reads the folded gate
