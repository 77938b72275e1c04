"""``ipu-unit-scaling health RUN``: is this low-precision run healthy?

Reads a run directory, finished, killed or still training, and prints per cast site the worst
flushed and saturated fractions with their steps, the range of the scaling bias and the SQNR,
then each attention layer's largest logit and every early warning with its step
(:mod:`ipu_unit_scaling.training.run_health`). ``--json`` prints the same as a document with a
``warnings`` list of ``step``, ``site`` and ``kind``. ``--params`` adds the u-μP inspector
(:mod:`ipu_unit_scaling.parametrization.inspector`) on the run's model and optimizer, with each
parameter's measured update/weight ratio. It reads only: nothing in the run changes.

``python -m ipu_unit_scaling.apps.health --config FILE [--set KEY=VALUE ...]`` is the inspector
on the model and optimizer a config builds, without training.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..training.run_config import Config
from ..training.run_directory import (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    TELEMETRY_FILE,
    RunError,
    not_a_directory,
)

__all__ = ["command_health", "health_document", "health_summary", "format_health_summary",
           "inspect_parameters_of", "format_inspection", "inspect_config", "inspect_main"]

_OTHER_KINDS = {"compare.md": "compare", "compare.json": "compare", "sweep.md": "sweep",
                "sweep.json": "sweep", "scales.txt": "analyse"}


def _check_run(run_dir: Path) -> None:
    """RunError (one line) unless ``run_dir`` is a run directory of ``train``."""
    problem = not_a_directory(run_dir)
    if problem:
        raise RunError(f"cannot read {run_dir}: {problem}")
    names = set(os.listdir(run_dir))
    if CONFIG_FILE in names and (METRICS_FILE in names or TELEMETRY_FILE in names):
        return
    for name, command in _OTHER_KINDS.items():
        if name in names:
            raise RunError(f"{run_dir} is a directory of {command}, not one run: give one of "
                           "its runs' directories")
    raise RunError(f"{run_dir} is not a run directory (no {CONFIG_FILE} and {METRICS_FILE})")


def health_document(run_dir: Path) -> Dict[str, Any]:
    """The run's health (see :func:`ipu_unit_scaling.training.run_health.run_health`) with its
    directory, status, whether it recorded telemetry, and ``problems``: one line for each file
    found damaged or cut short, whose readable part is still reported. RunError for a
    directory that is not a run, TelemetryFileError for a telemetry file damaged inside."""
    from ..training.run_directory import read_json
    from ..training.run_health import run_health
    from ..training.telemetry_log import cut_short_row, read_telemetry

    run_dir = Path(run_dir)
    _check_run(run_dir)
    problems: List[str] = []
    summary = read_json(run_dir / SUMMARY_FILE)
    if summary is None and os.path.lexists(run_dir / SUMMARY_FILE):
        status = f"unknown ({SUMMARY_FILE} is damaged)"
        problems.append(f"{SUMMARY_FILE} is damaged (not a JSON object): the run's status, "
                        "steps and losses are unknown")
    else:
        status = (summary or {}).get("status", "running or killed before its first checkpoint")
    path = run_dir / TELEMETRY_FILE
    if not path.exists():
        return {"run_dir": str(run_dir), "status": status, "problems": problems,
                "telemetry": False, "sampled_steps": [], "as_if_cast": False, "sites": [],
                "attention": [], "warnings": []}
    rows = read_telemetry(path)
    cut = cut_short_row(path)
    if cut is not None:
        step = cut.split(",", 1)[0] if "," in cut else ""
        where = (f"in a row of step {step}" if step.isdigit() else
                 f"after step {rows[-1]['step']}" if rows else "in its first row")
        why = ("the run completed: the file was damaged or cut" if status == "completed" else
               "a kill while it was written, or a row being written now")
        problems.append(f"{TELEMETRY_FILE} ends {where} cut short ({why}): the rows from there "
                        "on are missing; what comes before is reported")
    document = run_health(rows)
    return {"run_dir": str(run_dir), "status": status, "problems": problems,
            "telemetry": True, **document}


def health_summary(run_dir: Path) -> Dict[str, Any]:
    """A run's health in three figures, for a table beside its loss: the worst flushed and
    saturated fractions over its cast sites and sampled steps (None where it recorded no
    telemetry or no casts the run made), and its number of warnings."""
    from ..training.run_health import run_health
    from ..training.telemetry_log import TelemetryFileError, read_telemetry

    path = Path(run_dir) / TELEMETRY_FILE
    try:
        rows = read_telemetry(path) if path.exists() else []
    except TelemetryFileError:
        rows = []
    made = [row for row in rows if row["kind"] != "cast" or not row["note"]]
    health = run_health(made)
    sites = health["sites"]
    worst = {key: max((s[key] for s in sites if s[key] is not None), default=None)
             for key in ("worst_flushed", "worst_saturated")}
    return {"worst_flushed": worst["worst_flushed"],
            "worst_saturated": worst["worst_saturated"],
            "warnings": len(health["warnings"]) if rows else None}


def format_health_summary(summary: Dict[str, Any]) -> str:
    """``health_summary`` as a table cell: ``flushed 61% / saturated 0%, 9 warnings``."""
    if summary.get("warnings") is None:
        return "-"
    parts = []
    if summary.get("worst_flushed") is not None:
        parts.append(f"flushed {summary['worst_flushed']:.1%} / saturated "
                     f"{summary['worst_saturated']:.1%}")
    count = summary["warnings"]
    parts.append(f"{count} warning{'s' if count != 1 else ''}")
    return ", ".join(parts)


def _measured_ratios(run_dir: Path) -> Dict[str, float]:
    """Each parameter's median update/weight ratio over the run's sampled steps."""
    from ..training.telemetry_log import read_telemetry

    path = run_dir / TELEMETRY_FILE
    if not path.exists():
        return {}
    ratios: Dict[str, List[float]] = {}
    for row in read_telemetry(path):
        if row["kind"] == "param" and math.isfinite(row["update_ratio"]):
            ratios.setdefault(row["site"], []).append(row["update_ratio"])
    return {name: statistics.median(values) for name, values in ratios.items()}


def check_inspected_step(step: int, steps: int) -> None:
    """ValueError (one line) unless ``step`` is a step of a ``steps``-step schedule."""
    if not 1 <= step <= steps:
        raise ValueError(f"--step {step} is not a step of the schedule: give 1 to {steps} "
                         f"(training.steps)")


def inspect_parameters_of(config: Config, step: Optional[int] = None,
                          update_ratios: Optional[Dict[str, float]] = None,
                          model: Optional[Any] = None) -> Dict[str, Any]:
    """The inspector on the model and optimizer ``config`` builds (or ``model``, as
    initialised), at the scheduled learning rate of ``step`` (1 to ``training.steps``, as the
    training log counts; default: the first step at the peak rate, after warmup), with a run's
    measured ``update_ratios``: a document of the step, its global rate, the optimizer, the
    parametrization, the number flagged and one row per parameter."""
    import torch

    from ..backends import make_optimizer
    from ..parametrization.inspector import inspect_parameters
    from ..parametrization.mup_optimizers import set_learning_rate
    from ..training.precision import build_model
    from ..training.run_config import scheduled_learning_rate, warmup_steps

    training = config.training
    at = max(1, warmup_steps(training)) if step is None else step
    check_inspected_step(at, training.steps)
    torch.manual_seed(training.seed)
    if model is None:
        model = build_model(config)
    optimizer = make_optimizer(model, config, "cpu")
    lr = scheduled_learning_rate(training, at - 1)  # step s runs at the rate of s - 1, 0-based
    set_learning_rate(optimizer, lr)
    reports = inspect_parameters(model, optimizer, lr, update_ratios,
                                 decoupled_decay=training.optimizer != "adam")
    return {"step": at, "learning_rate": lr, "optimizer": training.optimizer,
            "parametrization": config.model.parametrization,
            "flagged": sum(1 for r in reports if r.flags),
            "parameters": [dataclasses.asdict(r) for r in reports]}


def format_inspection(inspection: Dict[str, Any]) -> str:
    """:func:`inspect_parameters_of`'s document as the inspector's head line and table."""
    from ..parametrization.inspector import ParameterReport, format_parameter_table

    reports = [ParameterReport(**row) for row in inspection["parameters"]]
    head = (f"{len(reports)} parameters at step {inspection['step']} (global learning rate "
            f"{inspection['learning_rate']:.4g}, {inspection['optimizer']}, parametrization "
            f"{inspection['parametrization']}); {inspection['flagged']} flagged")
    return head + "\n" + format_parameter_table(reports)


def inspect_config(config: Config, step: Optional[int] = None,
                   update_ratios: Optional[Dict[str, float]] = None,
                   model: Optional[Any] = None) -> str:
    """The inspector's table (see :func:`inspect_parameters_of`)."""
    return format_inspection(inspect_parameters_of(config, step, update_ratios, model))


def _run_parameters(run_dir: Path) -> Dict[str, Any]:
    """The inspector on a run's model as it initialised (its init std), at the rate of the
    last step it took, with its measured update/weight ratios."""
    from ..loop.run_opening import load_run_config
    from ..loop.tasks import read_task
    from ..training.run_directory import CHECKPOINT_FILE
    from ..training.run_records import load_checkpoint

    config = load_run_config(run_dir, action="inspect")
    task = read_task(run_dir, "inspect")
    import torch

    torch.manual_seed(config.training.seed)
    model = task.build_model(config)
    step: Optional[int] = None
    if (run_dir / CHECKPOINT_FILE).exists():
        done = int(load_checkpoint(run_dir / CHECKPOINT_FILE)["step"])
        step = min(max(done, 1), config.training.steps)
    return inspect_parameters_of(config, step, _measured_ratios(run_dir), model=model)


def command_health(args: argparse.Namespace) -> int:
    """``health``: the health table (or ``--json`` document) of a run directory."""
    run_dir = Path(args.run_dir)
    document = health_document(run_dir)
    if args.params:
        document["inspector"] = _run_parameters(run_dir)
    if args.json:
        print(json.dumps(_json_safe(document), indent=1))
        return 0
    if document["telemetry"]:
        print(f"{run_dir}: {document['status']}")
    for problem in document["problems"]:
        print(f"warning: {problem}")
    if not document["telemetry"]:
        print(f"{run_dir} recorded no telemetry (it trained with telemetry.interval 0, or "
              "before its first sampled step)")
    else:
        from ..training.run_health import format_health_table

        print(format_health_table(document))
    if args.params:
        print()
        print(format_inspection(document["inspector"]))
    return 0


def _json_safe(value: Any) -> Any:
    """Infinities and NaN as strings: JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def inspect_main(argv: Optional[Sequence[str]] = None) -> int:
    """The inspector on a config, without training (see the module docstring)."""
    from ..training.config_files import ConfigError
    from ..training.run_config import load_config
    from .commands import one_line_message

    parser = argparse.ArgumentParser(
        prog="python -m ipu_unit_scaling.apps.health",
        description="The u-μP inspector: each parameter's role, multipliers, init std and "
                    "effective learning rate for the model and optimizer a run config builds, "
                    "outliers flagged; nothing is trained.")
    parser.add_argument("--config", metavar="FILE", help="YAML config, or the name of one in "
                        "configs/ (default: the default run)")
    parser.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="append", default=[],
                        dest="overrides", help="override config values")
    parser.add_argument("--step", type=int, metavar="N",
                        help="the step whose scheduled learning rate to show, 1 to "
                             "training.steps as the training log counts (default: the first "
                             "step at the peak rate, after warmup)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead")
    args = parser.parse_args(argv)
    overrides = [item for group in args.overrides for item in group]
    try:
        config = load_config(args.config, overrides)
        inspection = inspect_parameters_of(config, args.step)
    except (ConfigError, ValueError, RunError) as error:
        print(f"{parser.prog}: error: {one_line_message(error)}", file=sys.stderr)
        return 2
    print(json.dumps(_json_safe(inspection), indent=1) if args.json else
          format_inspection(inspection))
    return 0


if __name__ == "__main__":
    from .process import ReaderMayLeave

    # '| head' takes what it wants and goes: the rest is dropped, as the health command does.
    sys.stdout = ReaderMayLeave(sys.stdout, "standard output")  # type: ignore[assignment]
    raise SystemExit(inspect_main())
