"""``ipu-unit-scaling compare``: the precision regimes of one model trained side by side (over
seeds, or the masked-LM encoder with ``--model bert``), and their table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..training.run_config import (
    Config,
    setting_differences,
)
from .commands import (
    MODEL_NAMES,
    UsageError,
    command_overrides,
    command_run_directory,
    continued_by_running_again,
    format_number,
    load_command_config,
    read_baseline,
    runs_root,
)
from .experiments import UNTUNED_MARK, UNTUNED_NOTE


def run_compare(
    config: Config, regimes: Sequence[str], run_dir: Path, quiet: bool = False,
    counter: Optional[Any] = None, label: str = "",
    recipe_settings: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Train every regime into ``run_dir/<regime>``; returns one result row per regime.
    ``recipe_settings`` go to the recipes that read them (``regime_config``).

    ``counter`` (a :class:`~.progress.RunCounter`) counts the regimes of a larger whole (the
    seeds of ``compare --seeds``), whose progress lines name each regime followed by ``label``.

    A regime already in ``run_dir`` is reused (finished) or resumed (unfinished) only when its
    saved settings are those it would run with now; otherwise nothing runs and a RunError
    names the keys that differ. ``run_dir`` must be empty or a compare directory; the finished
    regimes it holds beyond ``regimes`` (of the same settings) stay in its table.
    """
    from ..training.config_names import REGIMES
    from ..training.data import load_corpus
    from ..training.precision import is_regime
    from ..training.run_directory import (
        COMPARE_FILES,
        RunLock,
        check_own_kind,
        make_run_dir,
        remove_temporaries,
    )

    make_run_dir(run_dir)
    with RunLock(run_dir):
        remove_temporaries(run_dir)
        check_own_kind(run_dir, "compare", COMPARE_FILES, is_regime)
        corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
        plans = [(regime, *_regime_plan(config, regime, run_dir / regime, corpus,
                                        recipe_settings))
                 for regime in regimes]
        for regime in REGIMES:  # an earlier compare's other finished regimes stay in the table
            if regime not in regimes and (run_dir / regime).is_dir():
                cfg, action = _regime_plan(config, regime, run_dir / regime, corpus,
                                           recipe_settings)
                if action == "reuse":
                    plans.append((regime, cfg, action))
        if counter is not None:
            counter.total += len(plans) - len(regimes)
        return _run_regimes(plans, run_dir, quiet, counter, label)


def _regime_plan(config: Config, regime: str, regime_dir: Path, corpus: Any,
                 recipe_settings: Optional[Dict[str, Any]] = None) -> Any:
    """The regime's resolved config, and whether to ``start``, ``resume`` or ``reuse`` it."""
    from ..loop.run_opening import (
        check_reused_tokenizer,
        file_problem,
        load_run_config,
        resolved_config,
    )
    from ..training.precision import regime_config
    from ..training.run_directory import CHECKPOINT_FILE, SUMMARY_FILE, RunError, read_json

    cfg = resolved_config(regime_config(config, regime, recipe_settings), corpus)
    checkpoint = regime_dir / CHECKPOINT_FILE
    has_checkpoint = checkpoint.exists() or checkpoint.is_symlink()
    summary = read_json(regime_dir / SUMMARY_FILE)
    if not has_checkpoint and summary is None:
        return cfg, "start"  # new, or killed before anything worth keeping
    # As train --resume: a run that saved a checkpoint is not reused nor restarted without it.
    problem = file_problem(checkpoint) if has_checkpoint else ""
    if not has_checkpoint and summary and summary.get("checkpoint_step") is not None:
        problem = (f"is missing, but its {SUMMARY_FILE} records a {summary.get('status')} run "
                   f"with a checkpoint at step {summary.get('checkpoint_step')}")
    if problem:
        raise RunError(f"cannot reuse {regime_dir}: {CHECKPOINT_FILE} {problem}; nothing was "
                       "changed: restore the checkpoint, or choose another --run-dir")
    differences = setting_differences(load_run_config(regime_dir).to_dict(), cfg.to_dict())
    if summary is not None and summary.get("data_sha256") != corpus.sha256:
        differences.append(f"data: {corpus.source} is not the text it trained on")
    if differences:
        shown = ", ".join(differences[:4]) + (", ..." if len(differences) > 4 else "")
        raise RunError(
            f"{regime_dir} was trained with other settings ({shown}); rerun with the same "
            "settings or choose another --run-dir"
        )
    status = summary.get("status") if summary else None
    if status == "diverged" or (status == "completed" and
                                summary.get("steps") == cfg.training.steps):  # type: ignore
        check_reused_tokenizer(regime_dir, corpus.tokenizer.chars)
        if has_checkpoint:  # its config.yaml is the one the checkpoint was trained with
            from ..training.run_records import check_recorded_settings, load_checkpoint

            check_recorded_settings(regime_dir, load_run_config(regime_dir),
                                    load_checkpoint(checkpoint), "reuse")
        return cfg, "reuse"
    return cfg, "resume" if has_checkpoint else "start"


def _run_regimes(plans: Sequence[Any], run_dir: Path, quiet: bool,
                 counter: Optional[Any] = None, label: str = "") -> List[Dict[str, Any]]:
    from ..loop.run_outcomes import TrainingDiverged
    from ..loop.training_loop import train
    from ..training.plots import plot_compare
    from ..training.precision import model_kind
    from ..training.run_directory import SUMMARY_FILE, atomic_write, read_json
    from .health import health_summary
    from .progress import RunCounter

    rows: List[Dict[str, Any]] = []
    curves: Dict[str, List[Any]] = {}
    baseline = None
    counter = counter or RunCounter("compare", len(plans), quiet)
    for regime, cfg, action in plans:
        regime_dir = run_dir / regime
        index, name = counter.done + 1, regime + label
        counter.start(index, name, {"reuse": f"reusing the finished run in {regime_dir}",
                                    "resume": "resuming", "start": "training"}[action])
        if action != "reuse":
            try:
                train(cfg, regime_dir, resume=action == "resume", quiet=quiet, desc=regime)
            except TrainingDiverged as error:
                if not quiet:
                    print(f"{regime}: {error}")
        data = read_json(regime_dir / SUMMARY_FILE) or {}
        loss = data.get("final_val_loss")
        counter.finish(index, name, f"final validation loss {loss:.4f}"
                       if data.get("status") == "completed" and loss is not None
                       else str(data.get("status", "missing")), trained=action != "reuse")
        baseline = data.get("unigram_baseline", baseline)
        curves[regime] = [tuple(p) for p in data.get("val_curve", [])]
        rows.append({
            "regime": regime,
            "model": MODEL_NAMES[model_kind(cfg.model)],
            "precision": _precision_name(cfg),
            "learning_rate": cfg.training.learning_rate,
            "status": data.get("status", "missing"),
            "steps": data.get("steps"),
            "final_val_loss": data.get("final_val_loss") if data.get("status") == "completed"
            else None,
            "elapsed_s": data.get("elapsed_s"),
            "message": data.get("message", ""),
            "untuned": untuned(cfg, regime),
            "health": health_summary(regime_dir),
        })
    reference = next((r["final_val_loss"] for r in rows if r["regime"] == "fp32"), None)
    for row in rows:
        loss = row["final_val_loss"]
        row["gap_to_fp32_percent"] = (
            100.0 * (loss - reference) / reference if loss is not None and reference else None
        )
    table = format_compare_table(rows, baseline)
    atomic_write(run_dir / "compare.md", (table + "\n").encode("utf-8"))
    atomic_write(run_dir / "compare.json", json.dumps(
        {"unigram_baseline": baseline, "regimes": rows}, indent=2).encode("utf-8"))
    plot_compare(curves, run_dir / "compare.png", baseline,
                 labels={row["regime"]: f"{row['regime']} {UNTUNED_MARK}" for row in rows
                         if row["untuned"]})
    return rows


def untuned(config: Config, regime: str) -> bool:
    """Whether ``regime`` is a u-μP regime run with u-μP's default hyperparameters: the
    default learning rate and every multiplier 1 (``config`` is the regime's config)."""
    from ..training.precision import model_kind
    from ..training.run_config import UMUP_MULTIPLIERS, CompareConfig

    if model_kind(config.model) != "u-mup":
        return False
    default_rate = CompareConfig().learning_rates.get(regime)
    return (config.training.learning_rate == default_rate and
            all(getattr(config.model, name) == 1.0 for name in UMUP_MULTIPLIERS))


def _precision_name(config: Config) -> str:
    dtype = config.precision.dtype
    if dtype != "fp8":
        return dtype
    fp8 = config.precision.fp8
    if fp8.scaling in ("static", "amax"):
        return f"fp8 {fp8.scaling}"
    # The recipes beyond the IPU's name their element formats (mx's may be FP8, FP6 or FP4).
    formats = "/".join(dict.fromkeys((fp8.activation_format, fp8.weight_format,
                                      fp8.gradient_format)))
    extra = (" round-up" if fp8.scale_rounding == "up" else "") + (
        " hp-wgrad" if fp8.grad_weight_high_precision else "")
    if fp8.scaling == "block" and fp8.block_size is not None:  # a size the run was given
        extra += f" {fp8.block_size}"
    elif fp8.scaling == "delayed":
        extra += f" {fp8.amax_reduction} of {fp8.amax_history_length}"
    return f"{fp8.scaling}{extra} {formats}"


def format_compare_table(rows: Sequence[Dict[str, Any]], baseline: Optional[float]) -> str:
    """A Markdown table: regime, model, precision, lr, final validation loss, gap to fp32,
    health (the worst flushed and saturated fractions of its FP8 casts, and its warnings: see
    ``ipu-unit-scaling health``), time."""
    from .health import format_health_summary

    lines = [
        "| regime | model | precision | learning rate | final val loss | gap to fp32 | health "
        "| time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "completed":
            loss = format_number(row["final_val_loss"])
        else:
            loss = f"{row['status']} at step {row['steps']}"
        gap = row.get("gap_to_fp32_percent")
        gap_text = "-" if gap is None else f"{gap:+.1f}%"
        seconds = row.get("elapsed_s")
        time_text = "-" if seconds is None else f"{seconds:.0f} s"
        model = f"{row['model']} {UNTUNED_MARK}" if row.get("untuned") else row["model"]
        lines.append(
            f"| {row['regime']} | {model} | {row['precision']} | "
            f"{row['learning_rate']:g} | {loss} | {gap_text} | "
            f"{format_health_summary(row.get('health') or {})} | {time_text} |"
        )
    if baseline is not None:
        lines.append("")
        lines.append(f"Unigram baseline (validation): {baseline:.4f} nats per character.")
    if any(row.get("untuned") for row in rows):
        lines.append("")
        lines.append(UNTUNED_NOTE)
    return "\n".join(lines)


def command_compare_bert(args: argparse.Namespace) -> int:
    """``compare --model bert``: the masked-LM comparison."""
    from ..training.run_config import absolute_path
    from .mlm import MLM_REGIMES, MLMConfig, check_mlm_regimes, format_mlm_table, run_mlm_compare

    if args.config:
        raise UsageError("--model bert takes its settings from --set mlm.<key>=VALUE, not "
                         "--config")
    overrides = command_overrides(args)
    if args.data:
        overrides.append(f"mlm.data={json.dumps(str(args.data))}")
    regimes = list(args.regimes or MLM_REGIMES)
    try:
        config = MLMConfig().with_overrides(overrides)
        # the path is saved absolute: readable from anywhere
        config = config.with_setting("data", absolute_path(config.data))
        check_mlm_regimes(regimes)
    except ValueError as error:
        raise UsageError(str(error)) from error
    seeds = list(range(args.seeds if args.seeds is not None else 3))
    if len(set(regimes)) != len(regimes):
        raise UsageError("--regimes lists each regime once")
    with command_run_directory(args.run_dir, "runs", "compare-bert") as run_dir, \
            continued_by_running_again("compare", run_dir):
        rows = run_mlm_compare(config, regimes, seeds, run_dir, quiet=args.quiet)
    print(format_mlm_table(rows, seeds))
    print(f"curves: {run_dir / 'compare.png'}; table: {run_dir / 'compare.md'}")
    return 0


def command_compare(args: argparse.Namespace) -> int:
    """``compare``: the regimes trained side by side, over one seed or several."""
    if args.model == "bert":
        return command_compare_bert(args)
    recipes = getattr(args, "recipes", None)
    recipe_settings: Dict[str, Any] = {}
    if recipes:
        args, recipe_settings = _held_recipe_settings(args)
    config = load_command_config(args)
    seeds = args.seeds or 1
    regimes = list(args.regimes or config.compare.regimes)
    if recipes:
        from ..training.precision import recipe_regimes

        if args.regimes:
            raise UsageError("give --regimes or --recipes, not both")
        if len(set(recipes)) != len(recipes):
            raise UsageError(f"--recipes lists a recipe twice: {' '.join(recipes)}")
        regimes = recipe_regimes(recipes)
        _check_recipe_settings(config, recipes, regimes, recipe_settings,
                               command_overrides(args))
    if len(set(regimes)) != len(regimes):
        raise UsageError(f"--regimes lists a regime twice: {' '.join(regimes)}")
    with command_run_directory(args.run_dir, runs_root(config), "compare") as run_dir, \
            continued_by_running_again("compare", run_dir):
        if seeds == 1:
            rows = run_compare(config, regimes, run_dir, quiet=args.quiet,
                               recipe_settings=recipe_settings)
            table = format_compare_table(rows, read_baseline(run_dir))
        else:
            table = run_compare_seeds(config, regimes, run_dir, seeds, quiet=args.quiet,
                                      recipe_settings=recipe_settings)
    print(table)
    print(f"curves: {run_dir / 'compare.png'}; table: {run_dir / 'compare.md'}")
    return 0


def _held_recipe_settings(args: argparse.Namespace) -> Any:
    """``args`` without the ``--set`` items of the FP8 fields only some recipes read (block
    size, amax history), and those items' values: with ``--recipes`` they go to the recipes
    that read them, not to the base config, whose scaling may not."""
    from ..fp8.fp8_config import RECIPE_TUNING_FIELDS
    from ..training.config_files import parse_override_value

    kept: List[str] = []
    held: Dict[str, Any] = {}
    for item in command_overrides(args):
        key = item.partition("=")[0].strip()
        name = key[len("precision.fp8."):]
        if key.startswith("precision.fp8.") and name in RECIPE_TUNING_FIELDS:
            held[name] = parse_override_value(key, item.partition("=")[2])
        else:
            kept.append(item)
    return argparse.Namespace(**{**vars(args), "overrides": [kept]}), held


def _check_recipe_settings(config: Config, recipes: Sequence[str], regimes: Sequence[str],
                           recipe_settings: Dict[str, Any], overrides: Sequence[str]) -> None:
    """UsageError (one line) for a ``--set`` that no recipe reads, one that makes a recipe's
    config invalid, or one that a recipe replaces with its own value: a comparison never runs
    a setting other than the one given."""
    from ..fp8.fp8_config import RECIPES, field_is_free
    from ..training.precision import regime_config, regime_settings

    for name in recipe_settings:
        if not any(field_is_free(name, RECIPES[r]["scaling"]) for r in recipes):
            readers = sorted(r for r in RECIPES if field_is_free(name, RECIPES[r]["scaling"]))
            raise UsageError(f"--set precision.fp8.{name}: none of the recipes "
                             f"{' '.join(recipes)} reads it (only {' and '.join(readers)} "
                             f"read{'s' if len(readers) == 1 else ''} it)")
    given = [item.partition("=")[0].strip()[len("precision.fp8."):] for item in overrides
             if item.startswith("precision.fp8.")]
    for regime in regimes:
        _, dtype, recipe = regime_settings(regime)
        if dtype != "fp8":
            continue
        try:
            fp8 = regime_config(config, regime, recipe_settings).precision.fp8
        except ValueError as error:
            raise UsageError(f"recipe {recipe}: {error}") from None
        for name in given:
            if hasattr(fp8, name) and getattr(fp8, name) != getattr(config.precision.fp8, name):
                raise UsageError(
                    f"--set precision.fp8.{name}: recipe {recipe} sets it to "
                    f"{getattr(fp8, name)!r}, not {getattr(config.precision.fp8, name)!r}; "
                    "name the recipe you mean in --recipes, or leave the setting out")


def run_compare_seeds(config: Config, regimes: Sequence[str], run_dir: Path, seeds: int,
                      quiet: bool = False,
                      recipe_settings: Optional[Dict[str, Any]] = None) -> str:
    """``compare`` once per seed (``run_dir/seed-<seed>``), then the mean ± std table; returns
    it (also in ``compare.md``, with ``compare.json`` and ``compare.png``)."""
    from ..training.run_directory import COMPARE_FILES, RunLock, check_own_kind, make_run_dir
    from .experiments import write_seed_results
    from .progress import RunCounter

    per_seed: Dict[int, List[Dict[str, Any]]] = {}
    seed_dirs: Dict[int, Path] = {}
    counter = RunCounter("compare", seeds * len(regimes), quiet)  # every seed's regimes
    make_run_dir(run_dir)
    with RunLock(run_dir):
        check_own_kind(run_dir, "compare", COMPARE_FILES,
                       lambda name: re.fullmatch(r"seed-[0-9]+", name))
        for offset in range(seeds):
            seed = config.training.seed + offset
            seeded = dataclasses.replace(
                config, training=dataclasses.replace(config.training, seed=seed))
            seed_dirs[seed] = run_dir / f"seed-{seed}"
            if not quiet:
                print(f"compare: seed {seed} ({offset + 1} of {seeds})")
            per_seed[seed] = run_compare(seeded, regimes, seed_dirs[seed], quiet=quiet,
                                         counter=counter, label=f" seed {seed}",
                                         recipe_settings=recipe_settings)
        _, table = write_seed_results(run_dir, per_seed, seed_dirs)
    return table
