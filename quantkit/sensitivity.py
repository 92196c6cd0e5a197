"""Which quantizable nodes hurt accuracy most on CPU, and which to keep in float: ``sensitivity.json``.

``quantkit sensitivity CONFIG`` and ``build.fallback.auto`` (used by ``build-engine``) run the same
search (docs/sensitivity.md):

1. score the all-INT8 CPU flavour against FP32 on the evaluation data (``bench.data``): if it meets
   the budget (``metric >= target``), nothing is kept in float;
2. local error of every quantizable node in one pass (:mod:`quantkit.qdq.sensitivity_metrics`);
3. leave-one-out for the leading candidates, greedy selection under the cap and pruning
   (:mod:`quantkit.qdq.fallback_search`).

The result is reused while its fingerprint (model, calibration, evaluation data, search settings,
exclusions, versions) is unchanged; the chosen nodes reach ``build.json`` with reason
``sensitivity`` and so drive the CPU build, TensorRT-10's FP16 layers and TensorRT-11's Casts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from quantkit.artifacts import Manifest, ModelWorkspace, library_versions, sha256_file
from quantkit.config import AutoFallbackSection, Config
from quantkit.errors import DataError, MissingArtifactError, QuantkitError
from quantkit.ui import Console

MANIFEST = "sensitivity.json"
_NOT_STORED = ("reused", "path")
CALIBRATION = "calib.json"
#: Batch of the local pass (many intermediate tensors are alive at once), at most.
LOCAL_BATCH = 8
THREADS = 2


@dataclass
class SensitivityResult:
    """What the search measured and chose; :meth:`to_json` is ``sensitivity.json``'s details.

    Attributes:
        metric / target: the budget (``metric >= target`` against FP32).
        cap: the most nodes the search could keep in float; ``quantizable``: out of how many.
        chosen: nodes to keep in float (ONNX names); ``met``: whether they meet the budget.
        baseline / final: scores (cosine, top-1 agreement, SNR) all-INT8 and with ``chosen`` in float.
        holdout: the same two scores on the held-out samples (``auto.holdout``), else None.
        nodes: one row per quantizable node: local error, rank, leave-one-out score, chosen.
        steps: the greedy steps.
        samples: how many samples selected (``select``) and reported (``holdout``), and the data path.
        evaluations: candidate models built and run; ``seconds``: wall time of the search.
    """

    metric: str
    target: float
    cap: int
    quantizable: int
    chosen: list[str]
    met: bool
    baseline: dict[str, Any]
    final: dict[str, Any]
    holdout: dict[str, Any] | None
    nodes: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    samples: dict[str, Any]
    evaluations: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    reused: bool = False  # read back from a fresh sensitivity.json (not stored)
    path: str = ""  # where sensitivity.json is (not stored)

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        for key in _NOT_STORED:
            payload.pop(key)
        return payload

    @classmethod
    def from_json(cls, details: dict[str, Any], path: str = "") -> "SensitivityResult":
        fields = {key: details[key] for key in cls.__dataclass_fields__ if key in details and key not in _NOT_STORED}
        return cls(**fields, reused=True, path=path)

    def summary(self) -> dict[str, Any]:
        """The part ``build.json`` records."""
        return {"source": MANIFEST, "metric": self.metric, "target": self.target, "cap": self.cap,
                "met": self.met, "nodes": list(self.chosen), "baseline": self.baseline, "final": self.final,
                "holdout": self.holdout}


# --------------------------------------------------------------------------- fingerprint


def auto_settings(cfg: Config) -> AutoFallbackSection:
    """``build.fallback.auto`` when present (enabled or not), else the defaults."""
    return cfg.build.fallback.auto or AutoFallbackSection()


def sensitivity_fingerprint(cfg: Config, ws: ModelWorkspace, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """Everything the search's result depends on (cheap: hashes, no model run)."""
    import onnxruntime

    def digest(name: str) -> str | None:
        path = ws.path(name)
        return sha256_file(path) if path.exists() else None

    try:
        data = _eval_dataset(cfg, auto_settings(cfg).samples)[0].fingerprint()
    except (QuantkitError, OSError):
        data = None
    return {
        "auto": auto_settings(cfg).search_settings(),
        "exclude": list(dict.fromkeys(cfg.build.fallback_patterns + list(exclude))),
        "batch": cfg.build.profile.opt,
        "data": data,
        "model_sha256": digest("model.onnx"),
        "calib_json_sha256": digest(CALIBRATION),
        "onnxruntime": onnxruntime.__version__,
        "quantkit": library_versions()["quantkit"],
    }


# --------------------------------------------------------------------------- the stage


def run_sensitivity(cfg: Config, ws: ModelWorkspace, console: Console, *, exclude: Sequence[str] = (),
                    allow_stale: bool = False, force: bool = False) -> SensitivityResult:
    """Rank the quantizable nodes and choose the float set; reuse ``sensitivity.json`` when fresh.

    Args:
        cfg: the validated config; settings from ``build.fallback.auto`` (defaults when absent).
        ws: the model's artifact directory (``model.onnx``, ``calib.json``).
        console: where progress goes.
        exclude: extra patterns kept in float before the search (like ``build-engine --exclude``).
        allow_stale: use ``calib.json`` without checking that it is fresh.
        force: search again even if ``sensitivity.json`` is fresh.

    Returns:
        The result; ``sensitivity.json`` is written (unless it was reused).

    Raises:
        MissingArtifactError / StaleArtifactError: no model, no or stale calibration.
        ConfigError: top-1 agreement on a model without an [N, C] output, a pattern matching nothing.
        DataError: too few evaluation samples for the holdout split.
    """
    fingerprint = sensitivity_fingerprint(cfg, ws, exclude)
    if not force and ws.staleness(MANIFEST, fingerprint) is None:
        try:
            details = dict(Manifest.read(ws.path(MANIFEST)).details)
            result = SensitivityResult.from_json(details, str(ws.path(MANIFEST)))
        except TypeError:  # written by another version of this module: search again
            result = None
        if result is not None:
            console.info(f"sensitivity: reusing {ws.path(MANIFEST)} (inputs unchanged)")
            return result
    result = _search(cfg, ws, console, exclude, allow_stale)
    result.path = str(ws.path(MANIFEST))
    ws.write_manifest(MANIFEST, Manifest(stage="sensitivity", fingerprint=fingerprint, outputs={},
                                         versions=library_versions(), details=result.to_json()))
    return result


def auto_fallback(cfg: Config, ws: ModelWorkspace, console: Console, *, exclude: Sequence[str] = (),
                  allow_stale: bool = False) -> SensitivityResult:
    """The search for ``build-engine`` (``build.fallback.auto`` enabled); warns when the budget is not met."""
    result = run_sensitivity(cfg, ws, console, exclude=exclude, allow_stale=allow_stale)
    if not result.met:
        using = (f"building with those {len(result.chosen)} node(s) in float" if result.chosen else
                 f"building without automatic fallback (no set within the cap raised {result.metric} by more "
                 "than the evaluation data's noise)")
        console.warn(f"{unmet_message(result)}; {using}")
    return result


def unmet_message(result: SensitivityResult) -> str:
    """The budget was not met: what was reached, and with how many nodes."""
    reached = result.final.get(result.metric)
    return (f"the accuracy budget {result.metric} >= {result.target:g} cannot be met within the cap of "
            f"{result.cap} float node(s) ({_percent(result.cap, result.quantizable)} of {result.quantizable}): "
            f"best {result.metric} {_fmt(reached)} with {len(result.chosen)} node(s) "
            f"(all-INT8 {_fmt(result.baseline.get(result.metric))}); raise max_fraction/max_nodes or candidates, "
            "or improve the calibration")


def describe(result: SensitivityResult) -> str:
    """One summary line for the terminal."""
    where = (f"reused {result.path}" if result.reused else
             f"wrote {result.path or MANIFEST} in {result.seconds:.1f} s, {result.evaluations} candidate models")
    base, final = result.baseline.get(result.metric), result.final.get(result.metric)
    if not result.chosen and result.met:
        text = f"all-INT8 meets {result.metric} >= {result.target:g} ({_fmt(base)}): no fallback needed"
    else:
        verdict = "meets" if result.met else "does NOT meet"
        text = (f"{len(result.chosen)} of {result.quantizable} nodes in float "
                f"({_percent(len(result.chosen), result.quantizable)}, cap {result.cap}): {result.metric} "
                f"{_fmt(base)} -> {_fmt(final)}, {verdict} >= {result.target:g}")
    if result.holdout:
        held = result.holdout
        text += (f"; held-out {result.samples.get('holdout')} samples: {_fmt(held['baseline'].get(result.metric))}"
                 f" -> {_fmt(held['final'].get(result.metric))}")
    return f"{text} ({where})"


def format_table(result: SensitivityResult) -> str:
    """Every quantizable node's scores by ONNX node name, most fragile first."""
    header = ["rank", "node", "op", "SNR dB", "cosine", "own dB", "alone dB", "LOO top-1", "LOO cosine", "float"]
    rows = []
    chosen = set(result.chosen)
    for row in sorted(result.nodes, key=lambda r: (r.get("rank") is None, r.get("rank") or 0)):
        loo = row.get("leave_one_out") or {}
        rows.append([str(row.get("rank") or "-"), row["name"], row["op_type"], _fmt(row.get("snr_db"), 1),
                     _fmt(row.get("cosine"), 4), _fmt(row.get("local_snr_db"), 1), _fmt(row.get("output_snr_db"), 1),
                     "failed" if "error" in loo else _fmt(loo.get("top1_agreement"), 3),
                     "" if "error" in loo else _fmt(loo.get("cosine"), 4), "yes" if row["name"] in chosen else ""])
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the search


@dataclass
class _Problem:
    """The model, its ranges and which nodes the CPU flavour quantizes (after the config's exclusions)."""

    model: Any
    ranges: dict[str, Any]
    excluded: list[str]  # build.fallback patterns and --exclude, resolved
    quantized: list[str]  # what the CPU flavour quantizes without any fallback
    searchable: list[str]  # quantized nodes with their own Q/DQ (pass-through ops follow their input)
    op_types: dict[str, str]

    def with_float(self, float_set: Sequence[str], pad_channels: bool = True):
        """The CPU flavour with ``float_set`` kept in float as well (a ModelProto, in memory).

        ``pad_channels=False`` for the local pass: its probe compares intermediate tensors with FP32's.
        """
        from quantkit.qdq.cpu import write_cpu_qdq

        keep = set(float_set)
        return write_cpu_qdq(self.model, self.ranges, [n for n in self.quantized if n not in keep],
                             self.excluded + list(float_set), pad_channels=pad_channels)


def _problem(cfg: Config, ws: ModelWorkspace, exclude: Sequence[str], allow_stale: bool) -> _Problem:
    import onnx

    from quantkit.build import require_fresh_calibration
    from quantkit.qdq import load_ranges, placement, widen_overclipped

    if not ws.onnx_model.exists():
        raise MissingArtifactError(f"model not found: {ws.onnx_model} does not exist",
                                   hint="run 'quantkit export CONFIG' first")
    if not allow_stale:
        require_fresh_calibration(cfg, ws)
    ranges, _ = widen_overclipped(load_ranges(ws.path(CALIBRATION)))  # as the build does
    model = onnx.load(str(ws.onnx_model))
    info = placement.check_model(model)
    patterns = cfg.build.fallback_patterns + list(exclude)
    excluded = list(dict.fromkeys(n for nodes in placement.resolve_exclusions(model, patterns).values() for n in nodes))
    candidates = placement.quantizable_nodes(model, info)
    quantized = placement.select_nodes(candidates, placement.CPU, excluded)
    chosen = set(quantized)
    searchable = [c.name for c in candidates if c.reported and c.name in chosen]
    return _Problem(model, ranges, excluded, quantized, searchable, {c.name: c.op_type for c in candidates})


def _search(cfg: Config, ws: ModelWorkspace, console: Console, exclude: Sequence[str],
            allow_stale: bool) -> SensitivityResult:
    from quantkit.qdq.fallback_search import (OutputScorer, adjacent_nodes, check_metric, search_fallback,
                                              significant_gain)
    from quantkit.qdq.sensitivity_metrics import local_errors, rank_by_local_error

    start = time.perf_counter()
    settings = auto_settings(cfg)
    problem = _problem(cfg, ws, exclude, allow_stale)
    count = len(problem.searchable)
    cap = min(settings.cap(count), count)
    select, holdout, data_path, notes = evaluation_batches(cfg, settings)
    console.info(f"sensitivity: {count} quantizable nodes, budget {settings.metric} >= {settings.target:g}, "
                 f"cap {cap} in float; {_count(select)} samples from {data_path}"
                 + (f" (+{_count(holdout)} held out)" if holdout else ""))
    scorer = OutputScorer(problem.model, select, THREADS)
    check_metric(settings.metric, scorer)
    all_int8 = problem.with_float([])
    tick = time.perf_counter()
    errors = local_errors(problem.model, problem.with_float([], pad_channels=False), problem.searchable,
                          _rebatch(select, LOCAL_BATCH, cfg), THREADS)
    console.info(f"sensitivity: local error of {len(errors)} nodes in {time.perf_counter() - tick:.1f} s")
    measured = {e.name for e in errors}
    ranked = rank_by_local_error(errors) + [n for n in problem.searchable if n not in measured]  # unmeasured last
    with console.progress(None, "sensitivity", unit="model") as bar:
        def score_set(float_set: Sequence[str]):
            score = scorer.score(problem.with_float(float_set) if float_set else all_int8)
            bar.update(1)
            return score

        search = search_fallback(score_set, ranked, metric=settings.metric, target=settings.target, cap=cap,
                                 candidates=settings.candidates, on_step=console.detail,
                                 neighbours=adjacent_nodes(problem.model, problem.searchable),
                                 min_gain=significant_gain(settings.metric, _count(select)))
    held = None
    if holdout:
        held_scorer = OutputScorer(problem.model, holdout, THREADS)
        final = problem.with_float(search.chosen) if search.chosen else all_int8
        held = {"baseline": held_scorer.score(all_int8).to_json(), "final": held_scorer.score(final).to_json()}
    failed = [name for name, score in search.leave_one_out.items() if score.error]
    if failed:
        notes.append(f"{len(failed)} candidate model(s) were refused by ONNX Runtime and skipped "
                     f"(e.g. {failed[0]!r}: {search.leave_one_out[failed[0]].error})")
    return SensitivityResult(
        metric=settings.metric, target=settings.target, cap=cap, quantizable=count, chosen=search.chosen,
        met=search.met, baseline=search.baseline.to_json(), final=search.final.to_json(), holdout=held,
        nodes=_node_rows(problem, errors, ranked, search), steps=search.steps,
        samples={"select": _count(select), "holdout": _count(holdout), "data": data_path},
        evaluations=scorer.evaluations, seconds=round(time.perf_counter() - start, 2), notes=notes)


def _node_rows(problem: _Problem, errors, ranked: Sequence[str], search) -> list[dict[str, Any]]:
    """One row per searchable node: local figures, rank, leave-one-out score, chosen."""
    rank = {name: index + 1 for index, name in enumerate(ranked)}
    local = {e.name: e.to_json() for e in errors}
    rows = []
    for name in problem.searchable:
        row = {"name": name, "op_type": problem.op_types[name]}
        row.update({k: v for k, v in local.get(name, {}).items() if k not in ("name", "op_type")})
        loo = search.leave_one_out.get(name)
        row.update(rank=rank.get(name), leave_one_out=loo.to_json() if loo else None, chosen=name in search.chosen)
        rows.append(row)
    return rows


def _eval_dataset(cfg: Config, samples: int | None):
    """The evaluation data (``bench.data``, else the calibration data) and a note when it is the latter."""
    from quantkit.data import open_dataset

    notes = []
    if cfg.bench.data is not None:
        path, fmt = cfg.bench.data, "auto"
    else:
        path, fmt = cfg.calibration.data, cfg.calibration.format
        notes.append("bench.data is not set: the budget is measured on the calibration data, which flatters INT8")
    dataset = open_dataset(path, cfg.model.inputs, fmt=fmt, preprocess=cfg.calibration.preprocess,
                           max_samples=samples, on_bad_file=cfg.calibration.on_bad_file)
    return dataset, str(path), notes


def evaluation_batches(cfg: Config, settings: AutoFallbackSection):
    """The evaluation samples the search uses, in memory, split in data order.

    Args:
        cfg: the config (``bench.data``, preprocessing, ``build.profile.opt`` as the batch size).
        settings: ``samples`` (how many, all when None) and ``holdout`` (the fraction held out, last).

    Returns:
        (selection batches, holdout batches, data path, notes); batches are
        :class:`~quantkit.qdq.fallback_search.EvalBatch`, padded only for a fixed batch axis.

    Raises:
        DataError: no samples, or too few to split.
    """
    from quantkit.qdq.fallback_search import EvalBatch

    dataset, path, notes = _eval_dataset(cfg, settings.samples)
    arrays: dict[str, list[np.ndarray]] = {}
    for batch in dataset.batches(cfg.build.profile.opt, remainder="keep"):
        for name, array in batch.inputs.items():
            arrays.setdefault(name, []).append(array[:batch.size])
    inputs = {name: np.concatenate(parts) for name, parts in arrays.items()}
    total = len(next(iter(inputs.values()))) if inputs else 0
    held = int(round(total * settings.holdout))
    if total == 0 or (settings.holdout and (held < 1 or held >= total)):
        raise DataError(f"{path}: {total} evaluation sample(s) cannot be split with holdout {settings.holdout:g}"
                        if total else f"{path}: no evaluation samples")
    first = {name: array[:total - held] for name, array in inputs.items()}
    last = {name: array[total - held:] for name, array in inputs.items()}
    batch, fixed = cfg.build.profile.opt, isinstance(cfg.model.inputs[0].shape[0], int)
    select = [EvalBatch(f, n) for f, n in _split(first, batch, pad=fixed)]
    holdout = [EvalBatch(f, n) for f, n in _split(last, batch, pad=fixed)] if held else []
    return select, holdout, path, notes


def _rebatch(batches, size: int, cfg: Config):
    """The selection samples again in batches of ``size`` (the model's batch when it is fixed)."""
    first = cfg.model.inputs[0].shape[0]
    size = first if isinstance(first, int) else min(size, cfg.build.profile.opt)
    for batch in batches:
        real = {name: array[:batch.size] for name, array in batch.inputs.items()}
        for feeds, _ in _split(real, size, pad=isinstance(first, int)):
            yield feeds


def _split(inputs: dict[str, np.ndarray], size: int, pad: bool):
    """(feeds, real samples) in batches of ``size``; with ``pad`` the last one repeats its last sample."""
    total = len(next(iter(inputs.values())))
    for begin in range(0, total, size):
        part = {name: array[begin:begin + size] for name, array in inputs.items()}
        real = len(next(iter(part.values())))
        if pad and real < size:
            part = {name: np.concatenate([array, np.repeat(array[-1:], size - real, axis=0)])
                    for name, array in part.items()}
        yield {name: np.ascontiguousarray(array) for name, array in part.items()}, real


def _count(batches) -> int:
    return sum(batch.size for batch in batches)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf"
    return f"{value:.{digits}f}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"
