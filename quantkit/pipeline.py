"""The pipeline's stages in order, as a table that ``quantkit run`` walks.

Each stage knows its manifest, how to fingerprint its inputs (cheaply, without
running anything heavy) and how to execute. ``run`` skips a stage whose manifest
fingerprint still matches and whose outputs are intact.
"""

from __future__ import annotations

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


def _export_stage() -> Stage:
    from quantkit import export

    return Stage(
        name="export",
        manifest=export.MANIFEST,
        fingerprint=lambda cfg, ws: export.export_fingerprint(cfg),
        execute=export.export_model,
        describe=export.describe,
    )


def _calibrate_stage() -> Stage:
    from quantkit import calibrate

    return Stage(
        name="calibrate",
        manifest=calibrate.MANIFEST,
        fingerprint=calibrate.calibration_fingerprint,
        execute=calibrate.calibrate,
        describe=calibrate.describe,
    )


def _bench_stage() -> Stage:
    from quantkit.bench import stage as bench

    return Stage(
        name="bench",
        manifest=bench.MANIFEST,
        fingerprint=bench.bench_fingerprint,
        execute=bench.run_bench,
        describe=bench.describe,
    )


def _build_stage() -> Stage:
    from quantkit import build

    return Stage(
        name="build-engine",
        manifest=build.MANIFEST,
        fingerprint=build.build_fingerprint,
        execute=build.build_engine,
        describe=build.describe,
    )


def stages() -> list[Stage]:
    """The stages in pipeline order."""
    return [
        _export_stage(),
        _calibrate_stage(),
        _build_stage(),
        _bench_stage(),
    ]


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
