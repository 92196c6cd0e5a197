"""The pipeline's stages in order, as a table that ``quantkit run`` walks.

Each stage knows its manifest, how to fingerprint its inputs (cheaply, without
running anything heavy) and how to execute. ``run`` skips a stage whose manifest
fingerprint still matches and whose outputs are intact.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from quantkit.artifacts import ModelWorkspace
from quantkit.config import Config
from quantkit.ui import Console


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        name: the CLI command name.
        manifest: the JSON file (in the model's artifact dir) recording what produced the outputs.
        fingerprint: cfg, ws -> everything the outputs depend on.
        execute: cfg, ws, console -> a result object.
        describe: result -> one summary line.
    """

    name: str
    manifest: str
    fingerprint: Callable[[Config, ModelWorkspace], dict[str, Any]]
    execute: Callable[[Config, ModelWorkspace, Console], Any]
    describe: Callable[[Any], str]


# name, module, fingerprint function, execute function (each module also has MANIFEST and describe)
_STAGE_TABLE = [
    ("export", "quantkit.export", "export_fingerprint", "export_model"),
    ("calibrate", "quantkit.calibrate", "calibration_fingerprint", "calibrate"),
    ("build-engine", "quantkit.build", "build_fingerprint", "build_engine"),
    ("bench", "quantkit.bench.stage", "bench_fingerprint", "run_bench"),
]


def stages() -> list[Stage]:
    """The stages in pipeline order (modules are imported here, not at quantkit start-up)."""
    table = []
    for name, module_name, fingerprint, execute in _STAGE_TABLE:
        module = importlib.import_module(module_name)
        table.append(Stage(name, module.MANIFEST, getattr(module, fingerprint), getattr(module, execute),
                           module.describe))
    return table


def stage(name: str) -> Stage:
    return next(s for s in stages() if s.name == name)


@dataclass
class StageOutcome:
    name: str
    skipped: bool
    reason: str
    summary: str


def run_pipeline(cfg: Config, ws: ModelWorkspace, console: Console, force: bool = False,
                 stop_after: str | None = None) -> list[StageOutcome]:
    """Run every stage in order (up to ``stop_after``), skipping those whose inputs did not change."""
    outcomes = []
    for step in stages():
        fingerprint = step.fingerprint(cfg, ws)
        reason = ws.staleness(step.manifest, fingerprint) if fingerprint else "not recorded"
        if reason is None and not force:
            console.info(f"[{step.name}] up to date, skipped")
            outcomes.append(StageOutcome(step.name, True, "up to date", ""))
            if step.name == stop_after:
                break
            continue
        console.info(f"[{step.name}] running ({'forced' if force else reason})")
        result = step.execute(cfg, ws, console)
        summary = step.describe(result)
        console.info(f"[{step.name}] {summary}")
        outcomes.append(StageOutcome(step.name, False, reason or "forced", summary))
        if step.name == stop_after:
            break
    return outcomes
