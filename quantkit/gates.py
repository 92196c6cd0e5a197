"""Benchmark gate expressions such as ``top1_drop<=0.5`` or ``speedup@32>=1.5``.

Parsed when the config is loaded, so a typo fails before any work is done.
"""

from __future__ import annotations

import difflib
import operator
import re
from dataclasses import dataclass
from typing import Callable

# metric -> (description, needs labels)
GATE_METRICS: dict[str, tuple[str, bool]] = {
    "top1": ("INT8 top-1 accuracy against labels, in percent", True),
    "top5": ("INT8 top-5 accuracy against labels, in percent", True),
    "top1_drop": ("FP32 top-1 minus INT8 top-1, in points", True),
    "top5_drop": ("FP32 top-5 minus INT8 top-5, in points", True),
    "top1_agreement": ("fraction of samples where INT8 and FP32 agree on the top-1 class", False),
    "cosine": ("lowest cosine similarity of INT8 vs FP32 outputs over all outputs", False),
    "snr_db": ("lowest signal-to-noise ratio of INT8 vs FP32 outputs, in dB", False),
    "max_abs_err": ("largest absolute INT8 vs FP32 difference over all outputs", False),
    "mean_abs_err": ("largest mean absolute INT8 vs FP32 difference over all outputs", False),
    "speedup": ("INT8 / FP32 throughput (lowest over batch sizes, or @N for one batch size)", False),
    "p99_ms": ("INT8 p99 latency in ms (highest over batch sizes, or @N)", False),
}

_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}

_GATE_RE = re.compile(
    r"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)(?:@(?P<batch>\d+))?\s*"
    r"(?P<op><=|>=|==|<|>)\s*(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


@dataclass(frozen=True)
class Gate:
    """One parsed gate: ``metric[@batch] op threshold``."""

    metric: str
    op: str
    threshold: float
    batch_size: int | None = None
    text: str = ""

    @property
    def needs_labels(self) -> bool:
        return GATE_METRICS[self.metric][1]

    def check(self, value: float) -> bool:
        return _OPERATORS[self.op](value, self.threshold)


def parse_gate(text: str) -> Gate:
    """Parse a gate expression.

    Raises:
        ValueError: with a message saying what was expected (and a close metric name).
    """
    match = _GATE_RE.match(text)
    if not match:
        raise ValueError(
            f"gate {text!r} does not parse: expected METRIC[@BATCH] OP NUMBER, e.g. 'top1_drop<=0.5'"
        )
    metric = match["metric"]
    if metric not in GATE_METRICS:
        close = difflib.get_close_matches(metric, GATE_METRICS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(GATE_METRICS)}"
        raise ValueError(f"gate {text!r} names unknown metric {metric!r}{hint}")
    batch = int(match["batch"]) if match["batch"] else None
    if batch is not None and metric not in ("speedup", "p99_ms"):
        raise ValueError(f"gate {text!r}: only speedup and p99_ms take @BATCH")
    return Gate(metric, match["op"], float(match["value"]), batch, text.strip())
