"""Terminal output: messages on stderr by verbosity, results on stdout, progress bars.

Stages never print directly; they get a :class:`Console` so that ``--quiet`` and
``--json`` behave the same everywhere.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Console:
    """Where a command reports what it does.

    Args:
        verbosity: -1 quiet (errors only), 0 normal, 1+ verbose.
        json_mode: results go to stdout as JSON, so human text goes to stderr only.
    """

    verbosity: int = 0
    json_mode: bool = False

    @property
    def quiet(self) -> bool:
        return self.verbosity < 0

    def info(self, message: str) -> None:
        """A line of progress or summary for people (stderr)."""
        if self.verbosity >= 0:
            print(message, file=sys.stderr, flush=True)

    def detail(self, message: str) -> None:
        """A line shown only with -v."""
        if self.verbosity >= 1:
            print(message, file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        """A warning; shown even with --quiet because it may change a decision."""
        print(f"warning: {message}", file=sys.stderr, flush=True)

    def result(self, text: str) -> None:
        """The command's main output (stdout), unless JSON owns stdout."""
        if not self.json_mode and self.verbosity >= 0:
            print(text, flush=True)

    @contextmanager
    def progress(self, total: int | None, desc: str, unit: str = "it") -> Iterator["_Progress"]:
        """A progress bar on stderr (tqdm), silent with --quiet."""
        from tqdm import tqdm

        if not self.quiet and not sys.stderr.isatty():
            # logs (CI) get a plain line now and then instead of carriage-return redraws
            yield _LogProgress(total, desc, unit)
            return
        bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            disable=self.quiet,
            leave=False,
            dynamic_ncols=True,
            mininterval=0.5,
        )
        try:
            yield _Progress(bar)
        finally:
            bar.close()


class _LogProgress:
    """Progress for non-terminals: one line at most every 10 s, and one at the end."""

    def __init__(self, total: int | None, desc: str, unit: str):
        import time

        self._clock = time.monotonic
        self._start = self._last = self._clock()
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        self._postfix: dict = {}

    def update(self, n: int = 1, **postfix) -> None:
        self.done += n
        self._postfix.update(postfix)
        now = self._clock()
        if now - self._last >= 10 or (self.total is not None and self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self._start, 1e-9)
            of = f"/{self.total}" if self.total is not None else ""
            extra = "".join(f", {k}={v}" for k, v in self._postfix.items())
            print(f"{self.desc}: {self.done}{of} {self.unit} ({rate:.1f} {self.unit}/s{extra})",
                  file=sys.stderr, flush=True)


class _Progress:
    def __init__(self, bar):
        self._bar = bar

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(n)


def human_size(num_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
