"""The ``quantkit`` command line: thin Click commands over the stage functions.

Errors are turned into messages and exit codes in exactly one place,
:meth:`QuantkitGroup.main`: a :class:`~quantkit.errors.QuantkitError` prints one
line and exits with its code (2 usage/config, 1 runtime, 3 failed gate); any other
exception is an internal error (exit 1). ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from quantkit import __version__
from quantkit.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, QuantkitError
from quantkit.ui import Console

EXIT_CODES_HELP = "Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 3 a bench gate failed, 130 interrupted."


@dataclass
class Settings:
    workdir: Path
    console: Console
    debug: bool


class QuantkitGroup(click.Group):
    """A Click group that maps exceptions to one-line messages and exit codes."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D401
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in argv
        try:
            super().main(args=argv, prog_name=prog_name or "quantkit", complete_var=complete_var,
                         standalone_mode=False, **extra)
            code = 0
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except click.ClickException as exc:
            exc.show()
            code = exc.exit_code
        except (KeyboardInterrupt, click.exceptions.Abort):
            click.echo("interrupted: no artifact was left half-written", err=True)
            code = EXIT_INTERRUPTED
        except QuantkitError as exc:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            code = exc.exit_code
        except Exception as exc:  # noqa: BLE001 - the last line of defence: no traceback for users
            if debug:
                traceback.print_exc()
            message = str(exc).splitlines()[0] if str(exc) else ""
            click.echo(f"internal error: {type(exc).__name__}: {message} (rerun with --debug for the traceback)",
                       err=True)
            code = EXIT_RUNTIME
        if standalone_mode:
            sys.exit(code)
        return code


CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(cls=QuantkitGroup, context_settings=CONTEXT_SETTINGS, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, "--version", prog_name="quantkit")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), envvar="QUANTKIT_WORKDIR",
              default=Path("artifacts"), show_default=True, show_envvar=True,
              help="Where artifacts go: <workdir>/<model name>/.")
@click.option("-v", "--verbose", count=True, help="More detail (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and warnings.")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, workdir: Path, verbose: int, quiet: bool, debug: bool) -> None:
    """quantkit: PyTorch -> ONNX -> calibrated INT8 -> benchmark, from one YAML config.

    \b
    Stages (each reads the previous stage's artifacts):
      export        PyTorch/ONNX -> model.onnx (+ parity check)
      calibrate     model.onnx + data -> calib.cache, calib.json
      build-engine  -> model.int8.onnx (CPU) or model.engine (TensorRT), build.json
      bench         FP32 vs INT8 latency, throughput, accuracy, gates
      run           all four; skips stages whose inputs did not change

    \b
    Example:
      quantkit run configs/digits_cnn.yaml
    """
    if verbose and quiet:
        raise click.UsageError("-v and -q exclude each other")
    ctx.obj = Settings(workdir=workdir, console=Console(verbosity=-1 if quiet else verbose), debug=debug)


config_argument = click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
json_option = click.option("--json", "json_out", is_flag=True, help="Print the result as JSON on stdout.")


def _settings(ctx: click.Context, json_out: bool = False) -> Settings:
    settings: Settings = ctx.obj
    settings.console.json_mode = json_out
    return settings


def _load(config: Path, overrides: dict[str, Any] | None = None):
    from quantkit.config import load_config

    return load_config(config, overrides)


def _workspace(settings: Settings, cfg):
    from quantkit.artifacts import ModelWorkspace

    return ModelWorkspace(settings.workdir, cfg.name)


def _emit_json(payload: Any) -> None:
    click.echo(json.dumps(payload, indent=2, sort_keys=True, default=str))


@cli.command(context_settings=CONTEXT_SETTINGS)
@config_argument
@json_option
@click.pass_context
def validate(ctx: click.Context, config: Path, json_out: bool) -> None:
    """Validate CONFIG and print the merged config (defaults filled in).

    \b
    Example:
      quantkit validate configs/resnet18.yaml
    """
    from quantkit.config import ConfigError, dump_config

    settings = _settings(ctx, json_out)
    try:
        cfg = _load(config)
    except ConfigError as exc:
        for line in getattr(exc, "all_messages", [])[1:]:
            click.echo(f"error: {line}", err=True)
        raise
    if json_out:
        _emit_json(cfg.model_dump(mode="json"))
    else:
        settings.console.result(dump_config(cfg).rstrip())
        settings.console.info(f"{config}: valid")


@cli.command(context_settings=CONTEXT_SETTINGS)
@config_argument
@click.option("--opset", type=int, help="Override export.opset.")
@click.option("--no-simplify", is_flag=True, help="Skip onnxslim simplification.")
@json_option
@click.pass_context
def export(ctx: click.Context, config: Path, opset: int | None, no_simplify: bool, json_out: bool) -> None:
    """Export the model of CONFIG to <workdir>/<name>/model.onnx and check parity.

    \b
    Example:
      quantkit export configs/digits_cnn.yaml
    """
    from quantkit import export as export_stage
    settings = _settings(ctx, json_out)
    cfg = _load(config, {"export.opset": opset, "export.simplify": False if no_simplify else None})
    result = export_stage.export_model(cfg, _workspace(settings, cfg), settings.console)
    if json_out:
        _emit_json(result.to_json())
    else:
        settings.console.result(export_stage.describe(result))
        settings.console.info(f"next: quantkit calibrate {config}")


@cli.command(context_settings=CONTEXT_SETTINGS)
@config_argument
@click.option("--method", type=click.Choice(["entropy", "minmax", "percentile", "mse"]),
              help="Override calibration.method.")
@click.option("--data", type=click.Path(exists=True, path_type=Path), help="Override calibration.data.")
@click.option("--max-samples", type=int, help="Override calibration.max_samples.")
@click.option("--batch-size", type=int, help="Override calibration.batch_size.")
@json_option
@click.pass_context
def calibrate(ctx: click.Context, config: Path, method: str | None, data: Path | None, max_samples: int | None,
              batch_size: int | None, json_out: bool) -> None:
    """Compute INT8 ranges for CONFIG's model: calib.cache (TensorRT format) + calib.json.

    \b
    Example:
      quantkit calibrate configs/resnet18.yaml --method percentile --max-samples 256
    """
    from quantkit import calibrate as calibrate_stage

    settings = _settings(ctx, json_out)
    cfg = _load(config, {"calibration.method": method, "calibration.data": str(data.resolve()) if data else None,
                         "calibration.max_samples": max_samples, "calibration.batch_size": batch_size})
    result = calibrate_stage.calibrate(cfg, _workspace(settings, cfg), settings.console)
    if json_out:
        _emit_json(result.to_json())
    else:
        settings.console.result(calibrate_stage.describe(result))
        settings.console.info(f"next: quantkit build-engine {config}")


@cli.command("build-engine", context_settings=CONTEXT_SETTINGS)
@config_argument
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt"]), help="Override build.backend.")
@click.option("--exclude", "exclude", multiple=True, metavar="PATTERN",
              help="Keep in float: a node name, glob or op type (repeatable; adds to build.fallback).")
@click.option("--allow-stale", is_flag=True, help="Use a calibration whose inputs changed since it was made.")
@json_option
@click.pass_context
def build_engine(ctx: click.Context, config: Path, backend: str | None, exclude: tuple[str, ...], allow_stale: bool,
                 json_out: bool) -> None:
    """Build the INT8 artifacts for CONFIG: model.int8.onnx (CPU), model.qdq.onnx, model.engine (TensorRT).

    \b
    Example:
      quantkit build-engine configs/mobilenet_v3_small.yaml --exclude 'HardSigmoid' --exclude '/features/0/*'
    """
    from quantkit import build

    settings = _settings(ctx, json_out)
    cfg = _load(config)
    result = build.build_engine(cfg, _workspace(settings, cfg), settings.console, backend=backend,
                                exclude=list(exclude), allow_stale=allow_stale)
    if json_out:
        _emit_json(result.to_json())
    else:
        settings.console.result(build.describe(result))
        settings.console.info(f"next: quantkit bench {config}")


@cli.command(context_settings=CONTEXT_SETTINGS)
@config_argument
@click.option("--strict", is_flag=True, help="Exit 1 when the accuracy budget cannot be met within the cap.")
@click.option("--force", is_flag=True, help="Search again even if sensitivity.json is up to date.")
@click.option("--allow-stale", is_flag=True, help="Use a calibration whose inputs changed since it was made.")
@json_option
@click.pass_context
def sensitivity(ctx: click.Context, config: Path, strict: bool, force: bool, allow_stale: bool,
                json_out: bool) -> None:
    """Rank CONFIG's quantizable nodes by how much INT8 hurts them on CPU and choose which to keep in float.

    Settings come from build.fallback.auto (its defaults when absent). Writes sensitivity.json,
    which build-engine applies when build.fallback.auto is enabled. An unmet budget is a warning
    (exit 0), or exit 1 with --strict.

    \b
    Example:
      quantkit sensitivity configs/mobilenet_v3_small.yaml --strict
    """
    from quantkit import sensitivity as stage
    from quantkit.errors import QuantkitError

    settings = _settings(ctx, json_out)
    cfg = _load(config)
    result = stage.run_sensitivity(cfg, _workspace(settings, cfg), settings.console, force=force,
                                   allow_stale=allow_stale)
    if json_out:
        _emit_json(result.to_json())
    else:
        settings.console.result(stage.format_table(result))
        settings.console.info(stage.describe(result))
    if not result.met and strict:
        raise QuantkitError(stage.unmet_message(result))
    if not result.met:
        settings.console.warn(stage.unmet_message(result))
    use = "" if cfg.build.auto_fallback else " (set build.fallback.auto.enabled: true to apply the chosen nodes)"
    settings.console.info(f"next: quantkit build-engine {config}{use}")


@cli.command(context_settings=CONTEXT_SETTINGS)
@config_argument
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt"]), help="Override build.backend.")
@click.option("--batch-sizes", help="Comma-separated batch sizes, e.g. 1,8,32 (override bench.batch_sizes).")
@click.option("--duration", type=float, help="Seconds of timing per run, at least (override bench.duration_s).")
@click.option("--threads", type=int, help="Intra-op threads (override bench.threads).")
@click.option("--json", "json_path", help="Also write bench.json to PATH; '-' prints it on stdout.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Also write bench.md to PATH.")
@click.option("--gate", "gates", multiple=True, help="Extra gate, e.g. 'speedup@32>=1.5' (repeatable).")
@click.option("--compare", type=click.Path(exists=True, dir_okay=False), help="Baseline bench.json: report regressions.")
@click.pass_context
def bench(ctx: click.Context, config: Path, backend: str | None, batch_sizes: str | None, duration: float | None,
          threads: int | None, json_path: str | None, markdown_path: str | None, gates: tuple[str, ...],
          compare: str | None) -> None:
    """Benchmark FP32 against INT8 for CONFIG: latency, throughput, accuracy, gates.

    \b
    Example:
      quantkit bench configs/resnet18.yaml --batch-sizes 1,32 --gate 'speedup@32>=2' --json -
    """
    from quantkit.bench.stage import describe, parse_batch_sizes, run_bench

    settings = _settings(ctx, json_path == "-")
    cfg = _load(config)
    result = run_bench(cfg, _workspace(settings, cfg), settings.console, backend=backend,
                       batch_sizes=parse_batch_sizes(batch_sizes) if batch_sizes else None, duration=duration,
                       threads=threads, gates=gates, compare=compare, json_path=json_path,
                       markdown_path=markdown_path)
    settings.console.info(describe(result))


@cli.command(context_settings=CONTEXT_SETTINGS)
@config_argument
@click.option("--force", is_flag=True, help="Rerun every stage even if its inputs did not change.")
@click.option("--stop-after", type=click.Choice(["export", "calibrate", "build-engine", "bench"]),
              help="Stop after this stage.")
@json_option
@click.pass_context
def run(ctx: click.Context, config: Path, force: bool, stop_after: str | None, json_out: bool) -> None:
    """Run export, calibrate, build-engine and bench in order, skipping unchanged stages.

    \b
    Example:
      quantkit run configs/digits_cnn.yaml
    """
    from quantkit.pipeline import run_pipeline

    settings = _settings(ctx, json_out)
    cfg = _load(config)
    outcomes = run_pipeline(cfg, _workspace(settings, cfg), settings.console, force=force, stop_after=stop_after)
    if json_out:
        _emit_json([vars(o) for o in outcomes])


@cli.command(context_settings=CONTEXT_SETTINGS)
@click.argument("cache", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("other", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option("--rtol", type=float, default=0.0, show_default=True,
              help="With two files: scales within this relative difference count as equal.")
@json_option
@click.pass_context
def inspect(ctx: click.Context, cache: Path, other: Path | None, rtol: float, json_out: bool) -> None:
    """Print a calibration cache (TensorRT text cache or calib.json), or diff two.

    \b
    Example:
      quantkit inspect artifacts/resnet18/calib.cache trtexec.cache
    """
    from quantkit.cache_tools import cache_table, diff_table, load_scales

    settings = _settings(ctx, json_out)
    first = load_scales(cache)
    if other is None:
        if json_out:
            _emit_json({"path": str(cache), "version": first.version, "algorithm": first.algorithm,
                        "scales": first.scales})
        else:
            settings.console.result(cache_table(cache, first))
        return
    text, payload = diff_table(cache, first, other, load_scales(other), rtol)
    if json_out:
        _emit_json(payload)
    else:
        settings.console.result(text)


def main() -> None:
    """Console-script entry point."""
    cli.main(prog_name="quantkit")
