"""How far the INT8 model's outputs are from FP32's, and from the labels.

Everything is accumulated batch by batch (in float64), so the evaluation set
never has to fit in memory. Definitions (``r`` = FP32 output, ``q`` = INT8 output,
over all elements of all samples of one output):

* ``cosine``: r·q / (|r| |q|) over the flattened output (1 when both are all
  zeros, 0 when only one is); ``cosine_min_sample``: the worst single sample.
* ``max_abs_err`` = max |r - q|; ``mean_abs_err`` = mean |r - q|.
* ``snr_db`` = 10 log10(Σ r² / Σ (r - q)²); ``inf`` when the outputs are identical.
* ``top1_agreement``: for outputs shaped [N, C] (C >= 2, floating point), the
  fraction of samples whose argmax is the same.
* against labels, on the first [N, C] output: top-1 and top-5 in percent; the
  label's rank counts classes with a higher score, ties going to the lower class
  index (as ``numpy.argmax``); a sample with NaN/Inf scores counts as wrong; top-5
  is only reported when C > 5 (otherwise it is trivially 100 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from quantkit.backends.base import Runner
from quantkit.data import Batch
from quantkit.errors import DataError, ModelError


def is_classifier_output(array: np.ndarray) -> bool:
    """[N, C] with C >= 2 and a floating dtype: logits or probabilities."""
    return array.ndim == 2 and array.shape[1] >= 2 and np.issubdtype(array.dtype, np.floating)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two arrays, flattened (see the module doc for all-zero inputs)."""
    a64, b64 = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return _cosine(float(a64 @ b64), float(a64 @ a64), float(b64 @ b64))


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio of ``test`` against ``reference`` in dB (``inf`` if identical)."""
    ref = np.asarray(reference, np.float64)
    noise = ref - np.asarray(test, np.float64)
    return _snr(float(np.sum(ref * ref)), float(np.sum(noise * noise)))


def _cosine(dot: float, norm_a2: float, norm_b2: float) -> float:
    if not all(math.isfinite(v) for v in (dot, norm_a2, norm_b2)):
        return math.nan
    if norm_a2 == 0 and norm_b2 == 0:
        return 1.0
    if norm_a2 == 0 or norm_b2 == 0:
        return 0.0
    return max(-1.0, min(1.0, dot / math.sqrt(norm_a2 * norm_b2)))


def _snr(signal: float, noise: float) -> float:
    if math.isnan(signal) or math.isnan(noise):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def label_ranks(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Rank of each sample's label among its class scores (0 = top-1; see the module doc for ties).

    Rows with a NaN/Inf score get rank C (never correct).
    """
    scores = np.asarray(scores, np.float64)
    count, classes = scores.shape
    labels = np.asarray(labels, np.int64)
    if labels.shape != (count,):
        raise DataError(f"expected {count} labels, got shape {list(labels.shape)}")
    bad = (labels < 0) | (labels >= classes)
    if bad.any():
        raise DataError(f"label {int(labels[bad][0])} is outside the model's {classes} classes [0, {classes - 1}]")
    label_scores = scores[np.arange(count), labels][:, None]
    higher = (scores > label_scores).sum(axis=1)
    tied_before = ((scores == label_scores) & (np.arange(classes)[None, :] < labels[:, None])).sum(axis=1)
    ranks = higher + tied_before
    ranks[~np.isfinite(scores).all(axis=1)] = classes
    return ranks


def topk_accuracy(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Percent of samples whose label is among the ``k`` best scores."""
    ranks = label_ranks(scores, labels)
    return 100.0 * float(np.mean(ranks < k)) if len(ranks) else math.nan


@dataclass
class OutputAgreement:
    """INT8 vs FP32 figures for one output (see the module doc)."""

    name: str
    shape: list[int | None]
    elements: int
    cosine: float
    cosine_min_sample: float
    max_abs_err: float
    mean_abs_err: float
    snr_db: float
    top1_agreement: float | None

    def to_json(self) -> dict:
        return dict(vars(self))


class OutputComparator:
    """Streaming accumulator of :class:`OutputAgreement` for one output."""

    def __init__(self, name: str):
        self.name = name
        self.sample_shape: tuple[int, ...] | None = None
        self.count = 0
        self.elements = 0
        self.dot = self.ref2 = self.test2 = self.noise2 = self.abs_sum = 0.0
        self.max_abs = 0.0
        self.min_sample_cosine = math.inf
        self.agree = 0
        self.classifier = True

    def update(self, reference: np.ndarray, test: np.ndarray) -> None:
        """Add one batch of outputs (batch axis first, padding already removed)."""
        if reference.shape != test.shape:
            raise ModelError(f"output {self.name!r}: INT8 shape {list(test.shape)} != FP32 {list(reference.shape)}")
        if reference.ndim == 0 or reference.shape[0] == 0:
            return
        self.sample_shape = tuple(reference.shape[1:])
        ref = reference.astype(np.float64).reshape(len(reference), -1)
        tst = test.astype(np.float64).reshape(len(test), -1)
        diff = ref - tst
        self.count += len(ref)
        self.elements += ref.size
        self.dot += float(np.sum(ref * tst))
        self.ref2 += float(np.sum(ref * ref))
        self.test2 += float(np.sum(tst * tst))
        self.noise2 += float(np.sum(diff * diff))
        abs_diff = np.abs(diff)
        self.abs_sum += float(abs_diff.sum())
        self.max_abs = max(self.max_abs, float(abs_diff.max())) if not np.isnan(abs_diff).any() else math.nan
        per_sample = [_cosine(float(r @ t), float(r @ r), float(t @ t)) for r, t in zip(ref, tst)]
        self.min_sample_cosine = min(self.min_sample_cosine, *per_sample) \
            if not any(math.isnan(c) for c in per_sample) else math.nan
        self.classifier = self.classifier and is_classifier_output(reference)
        if self.classifier:
            finite = np.isfinite(ref).all(axis=1) & np.isfinite(tst).all(axis=1)
            self.agree += int(np.sum((ref.argmax(axis=1) == tst.argmax(axis=1)) & finite))

    def result(self) -> OutputAgreement:
        return OutputAgreement(
            name=self.name,
            shape=[None, *self.sample_shape] if self.sample_shape is not None else [],
            elements=self.elements,
            cosine=_cosine(self.dot, self.ref2, self.test2),
            cosine_min_sample=self.min_sample_cosine if self.count else math.nan,
            max_abs_err=self.max_abs,
            mean_abs_err=self.abs_sum / self.elements if self.elements else math.nan,
            snr_db=_snr(self.ref2, self.noise2),
            top1_agreement=self.agree / self.count if self.classifier and self.count else None,
        )


@dataclass
class TopK:
    """Accuracy against labels, in percent (top5 None when the output has <= 5 classes)."""

    top1: float
    top5: float | None

    def to_json(self) -> dict:
        return {"top1": self.top1, "top5": self.top5}


@dataclass
class LabelReport:
    """FP32 and INT8 accuracy on the labelled output."""

    output: str
    samples: int
    fp32: TopK
    int8: TopK

    @property
    def top1_drop(self) -> float:
        return self.fp32.top1 - self.int8.top1

    @property
    def top5_drop(self) -> float | None:
        return None if self.fp32.top5 is None else self.fp32.top5 - self.int8.top5

    def to_json(self) -> dict:
        return {"output": self.output, "samples": self.samples, "fp32": self.fp32.to_json(),
                "int8": self.int8.to_json(), "top1_drop": self.top1_drop, "top5_drop": self.top5_drop}


class LabelAccumulator:
    """Streaming top-1/top-5 counts for one model."""

    def __init__(self):
        self.count = 0
        self.top1 = 0
        self.top5 = 0
        self.classes: int | None = None

    def update(self, scores: np.ndarray, labels: np.ndarray) -> None:
        ranks = label_ranks(scores, labels)
        self.classes = scores.shape[1]
        self.count += len(ranks)
        self.top1 += int(np.sum(ranks < 1))
        self.top5 += int(np.sum(ranks < 5))

    def result(self) -> TopK:
        if not self.count:
            return TopK(math.nan, None)
        top5 = 100.0 * self.top5 / self.count if self.classes and self.classes > 5 else None
        return TopK(100.0 * self.top1 / self.count, top5)


@dataclass
class AccuracyReport:
    """Everything measured on the evaluation data."""

    samples: int
    batch_size: int
    outputs: list[OutputAgreement] = field(default_factory=list)
    labels: LabelReport | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "samples": self.samples,
            "batch_size": self.batch_size,
            "outputs": [o.to_json() for o in self.outputs],
            "labels": self.labels.to_json() if self.labels else None,
            "notes": list(self.notes),
        }


def evaluate_accuracy(reference: Runner, candidate: Runner, batches: Iterable[Batch], *, batch_size: int,
                      use_labels: bool, on_batch: Callable[[int], None] | None = None) -> AccuracyReport:
    """Run both (active) runners on every batch and compare.

    Args:
        reference: the FP32 runner.
        candidate: the INT8 runner.
        batches: the evaluation data; padded samples (beyond ``Batch.size``) are ignored.
        batch_size: recorded in the report.
        use_labels: compare against ``Batch.labels`` (every batch must have them).
        on_batch: called with the number of real samples after each batch (progress).

    Returns:
        The report; ``labels`` is None without labels or without an [N, C] output.
    """
    comparators: dict[str, OutputComparator] = {}
    label_output: str | None = None
    fp32_labels, int8_labels = LabelAccumulator(), LabelAccumulator()
    samples = 0
    notes: list[str] = []
    for batch in batches:
        ref_out = reference.infer(batch.inputs)
        test_out = candidate.infer(batch.inputs)
        if set(ref_out) != set(test_out):
            raise ModelError(f"the INT8 model's outputs {sorted(test_out)} differ from FP32's {sorted(ref_out)}")
        real = batch.size
        for name, ref in ref_out.items():
            comparators.setdefault(name, OutputComparator(name)).update(ref[:real], test_out[name][:real])
        if use_labels:
            if label_output is None:
                label_output = next((n for n, a in ref_out.items() if is_classifier_output(a)), "")
            if label_output:
                if batch.labels is None:
                    raise DataError(f"batch {batch.index} ({batch.sources[0]} ..) has no labels")
                labels = batch.labels[:real]
                fp32_labels.update(ref_out[label_output][:real], labels)
                int8_labels.update(test_out[label_output][:real], labels)
        samples += real
        if on_batch is not None:
            on_batch(real)
    if samples == 0:
        raise DataError("the evaluation data yielded no samples")
    report = AccuracyReport(samples, batch_size, [c.result() for c in comparators.values()], notes=notes)
    if use_labels and label_output:
        report.labels = LabelReport(label_output, fp32_labels.count, fp32_labels.result(), int8_labels.result())
    elif use_labels:
        notes.append("labels ignored: no output is shaped [N, C]")
    return report
