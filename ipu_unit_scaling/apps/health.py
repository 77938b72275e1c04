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
           "inspect_config", "inspect_main"]

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
    directory, status and whether it recorded telemetry; RunError for a directory that is not
    a run, TelemetryFileError for a damaged telemetry file."""
    from ..training.run_directory import read_json
    from ..training.run_health import run_health
    from ..training.telemetry_log import read_telemetry

    run_dir = Path(run_dir)
    _check_run(run_dir)
    summary = read_json(run_dir / SUMMARY_FILE) or {}
    status = summary.get("status", "running or killed before its first checkpoint")
    path = run_dir / TELEMETRY_FILE
    if not path.exists():
        return {"run_dir": str(run_dir), "status": status, "telemetry": False,
                "sampled_steps": [], "sites": [], "attention": [], "warnings": []}
    document = run_health(read_telemetry(path))
    return {"run_dir": str(run_dir), "status": status, "telemetry": True, **document}


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


def inspect_config(config: Config, step: Optional[int] = None,
                   update_ratios: Optional[Dict[str, float]] = None,
                   model: Optional[Any] = None) -> str:
    """The inspector's table for the model and optimizer ``config`` builds (or ``model``, as
    initialised), at the scheduled learning rate of ``step`` (default: the end of warmup, the
    peak), with a run's measured ``update_ratios``."""
    import torch

    from ..backends import make_optimizer
    from ..parametrization.inspector import format_parameter_table, inspect_parameters
    from ..parametrization.mup_optimizers import set_learning_rate
    from ..training.precision import build_model
    from ..training.run_config import scheduled_learning_rate, warmup_steps

    torch.manual_seed(config.training.seed)
    if model is None:
        model = build_model(config)
    optimizer = make_optimizer(model, config, "cpu")
    at = warmup_steps(config.training) if step is None else step
    lr = scheduled_learning_rate(config.training, min(at, config.training.steps - 1))
    set_learning_rate(optimizer, lr)
    reports = inspect_parameters(model, optimizer, lr, update_ratios,
                                 decoupled_decay=config.training.optimizer != "adam")
    flagged = sum(1 for r in reports if r.flags)
    head = (f"{len(reports)} parameters at step {at} (global learning rate {lr:.4g}, "
            f"{config.training.optimizer}, parametrization {config.model.parametrization}); "
            f"{flagged} flagged")
    return head + "\n" + format_parameter_table(reports)


def _run_parameters(run_dir: Path) -> str:
    from ..loop.run_opening import load_run_config
    from ..loop.tasks import read_task
    from ..training.run_directory import CHECKPOINT_FILE
    from ..training.run_records import load_checkpoint

    config = load_run_config(run_dir, action="inspect")
    task = read_task(run_dir, "inspect")
    import torch

    torch.manual_seed(config.training.seed)
    model = task.build_model(config)  # as the run initialised it: its init std
    step: Optional[int] = None
    if (run_dir / CHECKPOINT_FILE).exists():
        step = int(load_checkpoint(run_dir / CHECKPOINT_FILE)["step"])
    return inspect_config(config, step, _measured_ratios(run_dir), model=model)


def command_health(args: argparse.Namespace) -> int:
    """``health``: the health table (or ``--json`` document) of a run directory."""
    run_dir = Path(args.run_dir)
    document = health_document(run_dir)
    if args.json:
        print(json.dumps(_json_safe(document), indent=1))
        return 0
    if not document["telemetry"]:
        print(f"{run_dir} recorded no telemetry (it trained with telemetry.interval 0, or "
              "before its first sampled step)")
    else:
        from ..training.run_health import format_health_table

        print(f"{run_dir}: {document['status']}")
        print(format_health_table(document))
    if args.params:
        print()
        print(_run_parameters(run_dir))
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
                        help="the step whose scheduled learning rate to show (default: the "
                             "end of warmup)")
    args = parser.parse_args(argv)
    overrides = [item for group in args.overrides for item in group]
    try:
        config = load_config(args.config, overrides)
        print(inspect_config(config, args.step))
    except (ConfigError, ValueError, RunError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(inspect_main())
