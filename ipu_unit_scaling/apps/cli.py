"""The ``ipu-unit-scaling`` command: ``train``, ``compare``, ``sweep``, ``analyse``,
``evaluate`` and ``sample``.

Exit status: 0 done, 1 diverged (a non-finite or exploding training loss, or non-finite sampled
logits), 2 bad arguments, config, data or run directory (one line on stderr, never a traceback),
130 Ctrl-C (SIGINT), 143 SIGTERM, 141 when what reads sample's output goes away (``| head``);
the other commands then go on without their log.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple

from .. import __version__
from ..training.run_config import (
    CONFIGS_DIR,
    MAX_SEED,
    REGIMES,
    Config,
    ConfigError,
    load_config,
    setting_differences,
)

MODEL_KINDS = ("plain", "unit", "u-mup")  # as ipu_unit_scaling.loop.training_loop.MODEL_KINDS

PROG = "ipu-unit-scaling"
EXIT_DIVERGED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_READER_LEFT = 141  # 128 + SIGPIPE, what a shell reports for a command whose pipe closed
MAX_THREADS = 1024
DEBUG_ENV = "IPU_UNIT_SCALING_DEBUG"  # set to 1: unexpected errors show their traceback

__all__ = ["main", "build_parser", "run_compare", "run_compare_seeds", "format_compare_table"]


# How tables name the three model kinds of ipu_unit_scaling.loop.training_loop.MODEL_KINDS.
MODEL_NAMES = {"plain": "plain", "unit": "unit-scaled", "u-mup": "u-μP"}

# What each regime of `compare` trains (as precision.REGIME_SETTINGS, kept in step by a test).
REGIME_HELP = {
    "fp32": "plain model", "fp16": "plain, float16 matmuls, no loss scaling",
    "fp8-naive": "plain, FP8 casts without scaling", "fp8-amax": "plain, AMAX scaling",
    "unit-fp32": "unit-scaled", "unit-fp16": "unit-scaled, float16",
    "unit-fp8": "unit-scaled, FP8 casts without scaling", "unit-fp8-amax": "unit-scaled, AMAX",
    "umup-fp32": "u-μP", "umup-fp16": "u-μP, float16", "umup-fp8": "u-μP, FP8 casts without "
    "scaling", "umup-fp8-amax": "u-μP, AMAX",
}

# Post-training precisions of `evaluate` and `sample` (inference.PRECISIONS, kept in step by a
# test: importing it here would load torch before --help).
PRECISIONS = ("fp32", "fp16", "fp8-static", "fp8-amax")


class UsageError(ValueError):
    """Arguments that parse but cannot work together."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {' '.join(message.split())} "
                              f"(see {self.prog} --help)\n")


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE",
        help="YAML config, or the name of one in configs/ (e.g. 'tiny', 'fp32'); "
             "default: the built-in default run (configs/default.yaml)",
    )
    parser.add_argument(
        "--set", metavar="KEY=VALUE", nargs="+", action="append", default=[], dest="overrides",
        help="override config values, e.g. --set training.steps=200 model.depth=2 "
             "(values are parsed as YAML; may be repeated)",
    )
    parser.add_argument(
        "--data", metavar="FILE",
        help="train on this UTF-8 text file instead of the embedded corpus "
             "(the Python standard library's pydoc help text)",
    )
    parser.add_argument(
        "--run-dir", metavar="DIR", type=Path,
        help="directory for this run's files (default: <training.checkpoint_dir or runs>/"
             "<command>-<date>-<time>); it must be new or empty",
    )
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar or log lines; errors and the result only")
    parser.add_argument(
        "--threads", metavar="N", type=_thread_count, default=1,
        help="CPU threads for torch (default 1: a model this small gains little from more "
             "threads and loses much on a busy machine)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _thread_count(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Unit scaling and FP8-AMAX for PyTorch: train a character-level GPT on "
                    "an embedded corpus, compare precisions as the papers do, inspect tensor "
                    "scales, fine-tune, evaluate and sample trained runs in FP32, FP16 and FP8. "
                    "Runs on IPUs through PopTorch when available, else on CPU.",
        epilog="Exit status: 0 done, 1 diverged (a non-finite or exploding loss, or non-finite "
               "sampled logits), 2 bad arguments, config or data, 130 interrupted (143 by "
               "SIGTERM), 141 sample's reader gone ('| head'; other commands then go on "
               "without their log). IPU_UNIT_SCALING_BACKEND overrides the backend.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    train = commands.add_parser(
        "train", help="train one model (default: unit-scaled GPT in FP8 on the embedded corpus)",
        description="Train the config's GPT. Writes config.yaml, tokenizer.json, metrics.csv, "
                    "summary.json, loss.png and checkpoint.pt into the run directory; prints "
                    "the final validation loss next to the corpus's unigram baseline. Ctrl-C "
                    "or SIGTERM saves a checkpoint and exits 130 or 143; a loss that is "
                    "non-finite or more than 10 nats above the uniform baseline stops the run "
                    "(exit 1) without touching the last good checkpoint.",
    )
    _add_config_arguments(train)
    train.add_argument(
        "--resume", metavar="RUN_DIR", type=Path,
        help="continue the run in RUN_DIR from its checkpoint, with its saved config "
             "(--set may change it, e.g. training.steps to train longer)",
    )
    train.add_argument(
        "--init-from", metavar="RUN_DIR", type=Path,
        help="fine-tune: start from the checkpoint of the run in RUN_DIR, with its config (its "
             "model cannot change; --set changes the rest, e.g. precision or training.steps) "
             "on --data (default: its own data). Characters the pretrained run lacks extend "
             "its vocabulary, their embedding and head rows starting as the mean of its rows",
    )
    train.add_argument(
        "--scale-report", metavar="N", type=_positive_int, nargs="?", const=100,
        help="record per-tensor scales every N steps (default 100) into the run directory",
    )

    compare = commands.add_parser(
        "compare", help="train one model per precision regime and compare validation losses",
        description="Train the same data, steps and seed under each regime, then print a table "
                    "of final validation losses with each regime's gap to fp32, and write "
                    "compare.md, compare.json and compare.png. Regimes: "
                    + ", ".join(f"{name} ({REGIME_HELP[name]})" for name in REGIMES) + ". Each "
                    "regime's learning rate is compare.learning_rates.<regime>, and each is "
                    "evaluated at least ten times. Rerunning with the same --run-dir reuses "
                    "finished regimes and resumes unfinished ones when their settings are the "
                    "same, and refuses (naming the keys) when they are not.",
    )
    _add_config_arguments(compare)
    compare.add_argument(
        "--regimes", nargs="+", choices=REGIMES, metavar="REGIME",
        help=f"regimes to run (default: compare.regimes); any of {', '.join(REGIMES)}",
    )
    compare.add_argument(
        "--model", choices=("gpt", "bert"), default="gpt",
        help="gpt (default): the config's character-level GPT; bert: a BERT-style encoder "
             "trained with masked-LM on padded, masked sequences by the same training loop "
             "(each run with its checkpoint, resumed when rerun), scored by validation MLM loss "
             "and accuracy (default regimes fp32 fp16 fp8-naive unit-fp16 unit-fp8; settings "
             "with --set mlm.<key>=VALUE, e.g. mlm.steps=100 or mlm.backend=emulator; no "
             "--config)",
    )
    compare.add_argument(
        "--seeds", metavar="N", type=_positive_int, default=None,
        help="run every regime with N seeds (GPT: training.seed, +1, ..., +N-1, each in RUN_DIR/"
             "seed-<seed>; default 1. BERT: seeds 0..N-1, default 3) and report the mean and "
             "standard deviation of the final validation loss and of the gap to fp32; the "
             "figure shows mean curves with +-1 std bands",
    )

    sweep = commands.add_parser(
        "sweep", help="learning-rate (or any key's) sweep across widths: does the best transfer?",
        description="Train a grid of learning rates (powers of two) x widths (x depths) for each "
                    "model (plain, unit = unit-scaled, u-mup = u-μP), then write sweep.md (final "
                    "validation losses, the best learning rate at each width, how far it moves, "
                    "and the default learning rate's loss against the best), sweep.json and "
                    "sweep.png (loss against learning rate, one curve per width). Each model's "
                    "grid is centred on its default learning rate (compare.learning_rates of its "
                    "fp32 regime). With --key KEY --values V ... the axis is that config key "
                    "instead (each model at its default learning rate) and the tables give the "
                    "best value at each width and whether it moves. Rerunning with the same "
                    "--run-dir reuses finished points.",
    )
    _add_config_arguments(sweep)
    sweep.add_argument("--models", nargs="+", choices=MODEL_KINDS, metavar="MODEL",
                       help="models to sweep (default: plain unit u-mup; with --key, those "
                            "that use the key)")
    sweep.add_argument("--widths", nargs="+", type=_positive_int, default=[64, 128, 256],
                       metavar="W", help="model.hidden_size values (default: 64 128 256)")
    sweep.add_argument("--depths", nargs="+", type=_positive_int, metavar="D",
                       help="model.depth values (default: the config's)")
    sweep.add_argument("--span", type=_positive_int, metavar="K",
                       help="learning rates 2^(c-K) .. 2^(c+K) around each model's default "
                            "2^c (default 2: five rates)")
    sweep.add_argument("--log2-lr", nargs="+", default=[], metavar="MODEL=LO:HI",
                       help="an explicit grid for a model, e.g. u-mup=-3:2 (2^-3 .. 2^2)")
    sweep.add_argument("--key", metavar="KEY",
                       help="sweep this config key instead of the learning rate, e.g. "
                            "model.residual_mult, each model at its default learning rate")
    sweep.add_argument("--values", nargs="+", metavar="VALUE",
                       help="the --key values, read as --set reads them, e.g. 0.25 0.5 1 2")

    analyse = commands.add_parser(
        "analyse", help="compare tensor scales of the plain and unit-scaled model",
        description="Measure the scales of activations, weights and gradients of the config's "
                    "GPT built plainly and unit-scaled, and write a figure and a table.",
    )
    analyse.add_argument("--config", metavar="FILE", help="YAML config (default: the default run)")
    analyse.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="append", default=[],
                         dest="overrides", help="override config values")
    analyse.add_argument("--run-dir", metavar="DIR", type=Path,
                         help="where to write the figure and table (default: runs/analyse-...)")
    _add_inference_commands(commands)
    return parser


def _add_inference_commands(commands: Any) -> None:
    evaluate = commands.add_parser(
        "evaluate", help="a trained run's loss in fp32, fp16 and post-training FP8",
        description="Evaluate a trained run's checkpoint in each precision: fp32, fp16 "
                    "(float16 matmuls), fp8-static (FP8 casts at scale 2^0) and fp8-amax (FP8 "
                    "with per-tensor AMAX scaling). The data is the windows its training "
                    "validated on (so its own precision gives its final validation loss "
                    "exactly), or any text file. Prints a table of loss and gap to fp32 and "
                    "writes evaluate.md and evaluate.json.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                          help="a run directory holding a checkpoint")
    evaluate.add_argument("--data", metavar="FILE",
                          help="evaluate on this UTF-8 text instead, every character after the "
                               "first predicted once; it may hold only characters the run's "
                               "tokenizer knows")
    evaluate.add_argument("--precision", nargs="+", choices=PRECISIONS, metavar="PRECISION",
                          help=f"precisions to evaluate (default: all of {', '.join(PRECISIONS)})")
    evaluate.add_argument("--scale-report", action="store_true",
                          help="also give the FP8 casts' under- and overflow fractions by role")
    evaluate.add_argument("--out", metavar="DIR", type=Path,
                          help="where to write evaluate.md and evaluate.json (default: RUN_DIR)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")

    sample = commands.add_parser(
        "sample", help="write text with a trained run's checkpoint",
        description="Continue a prompt with characters drawn one at a time from a trained "
                    "run's model, printed as they come. The model sees a window of "
                    "model.seq_len characters that slides along the text, so memory stays one "
                    "window however long the text. The same --seed writes the same text.",
    )
    sample.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="a run directory holding a checkpoint")
    sample.add_argument("--prompt", metavar="TEXT",
                        help="text to continue, of characters the run's tokenizer knows "
                             "(default: a newline, to start a new paragraph)")
    sample.add_argument("--tokens", metavar="N", type=_positive_int, default=500,
                        help="characters to write (default 500)")
    sample.add_argument("--temperature", metavar="T", type=_temperature, default=1.0,
                        help="divides the logits before the draw (default 1.0); 0 always takes "
                             "the most likely character")
    sample.add_argument("--top-k", metavar="K", type=_positive_int,
                        help="draw only among the K most likely characters (default: all)")
    sample.add_argument("--seed", metavar="S", type=_seed, default=0,
                        help="seed of the draws, 0 to 2**63 - 1 as training.seed (default 0)")
    sample.add_argument("--precision", choices=PRECISIONS, metavar="PRECISION",
                        help=f"one of {', '.join(PRECISIONS)} (default: the precision the run "
                             "trained in)")
    for parser in (evaluate, sample):
        parser.add_argument("--threads", metavar="N", type=_thread_count, default=1,
                            help="CPU threads for torch (default 1)")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63 - 1, got {text!r}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


# ------------------------------------------------------------------------------ helpers


def _overrides(args: argparse.Namespace) -> List[str]:
    return [item for group in args.overrides for item in group]


def _config_path(args: argparse.Namespace) -> Optional[str]:
    """``--config``, else ``configs/default.yaml`` where the configs directory is installed."""
    if args.config is not None:
        return str(args.config)
    return "default" if (CONFIGS_DIR / "default.yaml").is_file() else None


def _load(args: argparse.Namespace) -> Config:
    config = load_config(_config_path(args), _overrides(args))
    data = getattr(args, "data", None)
    if data is not None:
        if not data.strip():
            raise UsageError("--data needs a file name (leave it out for the embedded corpus)")
        config.data.path = data
    return config


@contextlib.contextmanager
def _run_directory(chosen: Optional[Path], root: str, command: str) -> Iterator[Path]:
    """The run directory, created now: ``chosen``, else a new ``root/<command>-<date>-<time>``
    (``-2``, ``-3``, ... after it when runs start in the same second). If the command fails
    before its run wrote anything of use, what it created is removed again."""
    from ..backends.distributed import writes_run_files
    from ..training.run_directory import make_run_dir, make_unique_run_dir, remove_refused_start

    if not writes_run_files():
        # Under torchrun, rank 0 names, creates and opens the run; the other ranks never
        # touch a directory of their own.
        yield chosen if chosen is not None else Path(root)
        return
    if chosen is not None:
        run_dir, created = chosen, make_run_dir(chosen)
    else:
        run_dir, created = make_unique_run_dir(Path(root),
                                               f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        yield run_dir
    except BaseException:
        remove_refused_start(created)
        raise


@contextlib.contextmanager
def _continued_by_running_again(command: str, run_dir: Path) -> Iterator[None]:
    """A regime or point stopped by a signal is taken up by the same command, which resumes it
    and runs the rest; ``train --resume`` on it alone would leave the rest undone."""
    from ..loop.training_loop import TrainingInterrupted

    try:
        yield
    except TrainingInterrupted as error:
        stopped = str(error).split("; continue with:")[0]
        raise TrainingInterrupted(
            f"{stopped}; to continue, run the same {command} command again with --run-dir "
            f"{run_dir}: it reuses what finished and resumes the rest",
            error.step, error.checkpoint, error.signum) from error


def _runs_root(config: Config) -> str:
    return config.training.checkpoint_dir or "runs"


def _one_line(error: BaseException, most: int = 5) -> str:
    if isinstance(error, ConfigError):
        problems = [f"{path}: {message}" if path else message for path, message in error.errors]
        more = len(problems) - most
        text = "; ".join(problems[:most]) + (f"; and {more} more" if more > 0 else "")
        return "invalid config: " + " ".join(text.split())
    return " ".join(str(error).split())


def _fmt(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if math.isfinite(value) else str(value)


# ------------------------------------------------------------------------------ commands


def _cmd_train(args: argparse.Namespace) -> int:
    from ..loop.training_loop import train

    if args.scale_report:
        try:
            from ..analysis import ScaleReporter  # type: ignore[attr-defined]  # noqa: F401
        except ImportError as error:
            raise UsageError(
                "--scale-report needs ipu_unit_scaling.analysis, which this installation lacks"
            ) from error
    directory: Any
    if args.resume is not None:
        if args.config is not None or args.data is not None or args.run_dir is not None \
                or args.init_from is not None:
            raise UsageError("--resume continues a run with its own config, data, directory "
                             "and start; change settings with --set")
        config = None  # the run's own, read under its lock
        directory = contextlib.nullcontext(args.resume)
    elif args.init_from is not None:
        config = _fine_tuning_config(args)
        directory = _run_directory(args.run_dir, _runs_root(config), "finetune")
    else:
        config = _load(args)
        directory = _run_directory(args.run_dir, _runs_root(config), "train")
    from ..backends.distributed import writes_run_files

    with directory as run_dir:
        summary = train(config, run_dir, resume=args.resume is not None,
                        overrides=_overrides(args), quiet=args.quiet,
                        scale_report=args.scale_report, log=print, init_from=args.init_from)
    if not writes_run_files():
        return 0  # rank 0 of the torchrun world reports
    print(f"final validation loss {_fmt(summary.final_val_loss)} nats per character "
          f"(best {_fmt(summary.best_val_loss)}); unigram baseline "
          f"{_fmt(summary.unigram_baseline)}, uniform {_fmt(summary.uniform_baseline)}")
    print(f"{summary.steps} steps in {summary.elapsed_s:.1f} s "
          f"({summary.tokens_per_s:.0f} tokens/s, {summary.backend}); run directory: {run_dir}")
    return 0


def _fine_tuning_config(args: argparse.Namespace) -> Config:
    """The pretrained run's config with --set and --data: the config of ``--init-from``."""
    from ..loop.training_loop import load_run_config
    from ..training.run_directory import RunError, not_a_directory

    if args.config is not None:
        raise UsageError("--init-from fine-tunes with the pretrained run's config, whose model "
                         "it keeps; change other settings with --set")
    problem = not_a_directory(args.init_from)
    if problem:
        raise RunError(f"cannot fine-tune from {args.init_from}: {problem}")
    config = load_run_config(args.init_from, _overrides(args), "fine-tune from")
    if args.data is not None:
        if not args.data.strip():
            raise UsageError("--data needs a file name (leave it out for the pretrained "
                             "run's data)")
        config.data.path = args.data
    return config


def run_compare(
    config: Config, regimes: Sequence[str], run_dir: Path, quiet: bool = False,
) -> List[Dict[str, Any]]:
    """Train every regime into ``run_dir/<regime>``; returns one result row per regime.

    A regime already in ``run_dir`` is reused (finished) or resumed (unfinished) only when its
    saved settings are those it would run with now; otherwise nothing runs and a RunError
    names the keys that differ.
    """
    from ..training.data import load_corpus
    from ..training.run_directory import RunLock, make_run_dir, remove_temporaries

    make_run_dir(run_dir)
    with RunLock(run_dir):
        remove_temporaries(run_dir)
        corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
        plans = [(regime, *_regime_plan(config, regime, run_dir / regime, corpus))
                 for regime in regimes]
        return _run_regimes(plans, run_dir, quiet)


def _regime_plan(config: Config, regime: str, regime_dir: Path, corpus: Any) -> Any:
    """The regime's resolved config, and whether to ``start``, ``resume`` or ``reuse`` it."""
    from ..loop.training_loop import (
        check_reused_tokenizer,
        load_run_config,
        regime_config,
        resolved_config,
    )
    from ..training.run_directory import CHECKPOINT_FILE, SUMMARY_FILE, RunError, read_json

    cfg = resolved_config(regime_config(config, regime), corpus)
    has_checkpoint = (regime_dir / CHECKPOINT_FILE).exists()
    summary = read_json(regime_dir / SUMMARY_FILE)
    if not has_checkpoint and summary is None:
        return cfg, "start"  # new, or killed before anything worth keeping
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
        return cfg, "reuse"
    return cfg, "resume" if has_checkpoint else "start"


def _run_regimes(plans: Sequence[Any], run_dir: Path, quiet: bool) -> List[Dict[str, Any]]:
    from ..loop.training_loop import TrainingDiverged, model_kind, train
    from ..training.plots import plot_compare
    from ..training.run_directory import SUMMARY_FILE, atomic_write, read_json

    rows: List[Dict[str, Any]] = []
    curves: Dict[str, List[Any]] = {}
    baseline = None
    for regime, cfg, action in plans:
        regime_dir = run_dir / regime
        if action == "reuse":
            if not quiet:
                print(f"{regime}: reusing the finished run in {regime_dir}")
        else:
            try:
                train(cfg, regime_dir, resume=action == "resume", quiet=quiet, desc=regime)
            except TrainingDiverged as error:
                if not quiet:
                    print(f"{regime}: {error}")
        data = read_json(regime_dir / SUMMARY_FILE) or {}
        baseline = data.get("unigram_baseline", baseline)
        curves[regime] = [tuple(p) for p in data.get("val_curve", [])]
        rows.append({
            "regime": regime,
            "model": MODEL_NAMES[model_kind(cfg)],
            "precision": _precision_name(cfg),
            "learning_rate": cfg.training.learning_rate,
            "status": data.get("status", "missing"),
            "steps": data.get("steps"),
            "final_val_loss": data.get("final_val_loss") if data.get("status") == "completed"
            else None,
            "elapsed_s": data.get("elapsed_s"),
            "message": data.get("message", ""),
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
    plot_compare(curves, run_dir / "compare.png", baseline)
    return rows


def _precision_name(config: Config) -> str:
    dtype = config.precision.dtype
    if dtype != "fp8":
        return dtype
    return f"fp8 {config.precision.fp8.scaling}"


def format_compare_table(rows: Sequence[Dict[str, Any]], baseline: Optional[float]) -> str:
    """A Markdown table: regime, model, precision, lr, final validation loss, gap to fp32."""
    lines = [
        "| regime | model | precision | learning rate | final val loss | gap to fp32 | time |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["status"] == "completed":
            loss = _fmt(row["final_val_loss"])
        else:
            loss = f"{row['status']} at step {row['steps']}"
        gap = row.get("gap_to_fp32_percent")
        gap_text = "-" if gap is None else f"{gap:+.1f}%"
        seconds = row.get("elapsed_s")
        time_text = "-" if seconds is None else f"{seconds:.0f} s"
        lines.append(
            f"| {row['regime']} | {row['model']} | {row['precision']} | "
            f"{row['learning_rate']:g} | {loss} | {gap_text} | {time_text} |"
        )
    if baseline is not None:
        lines.append("")
        lines.append(f"Unigram baseline (validation): {baseline:.4f} nats per character.")
    return "\n".join(lines)


def _cmd_compare_bert(args: argparse.Namespace) -> int:
    from .mlm import MLM_REGIMES, MLMConfig, check_mlm_regimes, format_mlm_table, run_mlm_compare

    if args.config:
        raise UsageError("--model bert takes its settings from --set mlm.<key>=VALUE, not "
                         "--config")
    overrides = _overrides(args)
    if args.data:
        overrides.append(f"mlm.data={json.dumps(str(args.data))}")
    regimes = list(args.regimes or MLM_REGIMES)
    try:
        config = MLMConfig().with_overrides(overrides)
        check_mlm_regimes(regimes)
    except ValueError as error:
        raise UsageError(str(error)) from error
    seeds = list(range(args.seeds if args.seeds is not None else 3))
    if len(set(regimes)) != len(regimes):
        raise UsageError("--regimes lists each regime once")
    with _run_directory(args.run_dir, "runs", "compare-bert") as run_dir, \
            _continued_by_running_again("compare", run_dir):
        rows = run_mlm_compare(config, regimes, seeds, run_dir, quiet=args.quiet)
    print(format_mlm_table(rows, seeds))
    print(f"curves: {run_dir / 'compare.png'}; table: {run_dir / 'compare.md'}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.model == "bert":
        return _cmd_compare_bert(args)
    config = _load(args)
    seeds = args.seeds or 1
    regimes = list(args.regimes or config.compare.regimes)
    if len(set(regimes)) != len(regimes):
        raise UsageError(f"--regimes lists a regime twice: {' '.join(regimes)}")
    with _run_directory(args.run_dir, _runs_root(config), "compare") as run_dir, \
            _continued_by_running_again("compare", run_dir):
        if seeds == 1:
            rows = run_compare(config, regimes, run_dir, quiet=args.quiet)
            table = format_compare_table(rows, _read_baseline(run_dir))
        else:
            table = run_compare_seeds(config, regimes, run_dir, seeds, quiet=args.quiet)
    print(table)
    print(f"curves: {run_dir / 'compare.png'}; table: {run_dir / 'compare.md'}")
    return 0


def run_compare_seeds(config: Config, regimes: Sequence[str], run_dir: Path, seeds: int,
                      quiet: bool = False) -> str:
    """``compare`` once per seed (``run_dir/seed-<seed>``), then the mean ± std table; returns
    it (also in ``compare.md``, with ``compare.json`` and ``compare.png``)."""
    from ..training.run_directory import RunLock, make_run_dir
    from .experiments import write_seed_results

    per_seed: Dict[int, List[Dict[str, Any]]] = {}
    seed_dirs: Dict[int, Path] = {}
    make_run_dir(run_dir)
    with RunLock(run_dir):
        for offset in range(seeds):
            seeded = copy.deepcopy(config)
            seed = seeded.training.seed = config.training.seed + offset
            seed_dirs[seed] = run_dir / f"seed-{seed}"
            if not quiet:
                print(f"compare: seed {seed} ({offset + 1} of {seeds})")
            per_seed[seed] = run_compare(seeded, regimes, seed_dirs[seed], quiet=quiet)
        _, table = write_seed_results(run_dir, per_seed, seed_dirs)
    return table


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .experiments import default_exponents, run_sweep, sweep_report

    config = _load(args)
    key, values = _sweep_key(args, config)
    exponents = {kind: default_exponents(config, kind, args.span or 2) for kind in args.models}
    for item in args.log2_lr:
        kind, _, bounds = item.partition("=")
        low, _, high = bounds.partition(":")
        try:
            grid = list(range(int(low), int(high) + 1))
        except ValueError:
            grid = []
        if kind not in args.models or not grid:
            raise UsageError(f"--log2-lr {item!r}: expected MODEL=LO:HI with MODEL one of "
                             f"{', '.join(args.models)} and integers LO <= HI")
        exponents[kind] = grid
    depths = args.depths or [config.model.depth]
    for width in args.widths:
        if width % config.model.heads:
            raise UsageError(f"--widths {width}: model.heads ({config.model.heads}) must "
                             "divide every width")
    with _run_directory(args.run_dir, _runs_root(config), "sweep") as run_dir, \
            _continued_by_running_again("sweep", run_dir):
        points = run_sweep(config, args.models, args.widths, depths, exponents, run_dir,
                           quiet=args.quiet, key=key, values=values)
    print(sweep_report(config, points))
    print(f"transfer plot: {run_dir / 'sweep.png'}; table: {run_dir / 'sweep.md'}")
    return 0


def _sweep_key(args: argparse.Namespace, config: Config) -> Tuple[Optional[str], List[Any]]:
    """``--key`` and its parsed ``--values`` (None, [] for a learning-rate sweep); fills in
    ``args.models`` where it was left out."""
    from .experiments import kinds_using, parse_sweep_values

    if args.key is None:
        if args.values:
            raise UsageError("--values needs --key, the config key they are values of")
        args.models = args.models or list(MODEL_KINDS)
        return None, []
    if not args.values:
        raise UsageError(f"--key {args.key} needs --values, e.g. --values 0.5 1 2")
    if args.log2_lr or args.span is not None:
        raise UsageError("--log2-lr and --span set a learning-rate grid; with --key each model "
                         "trains at its default learning rate (compare.learning_rates)")
    values = parse_sweep_values(config, args.key, args.values)
    if args.models is None:
        args.models = kinds_using(config, args.key, values) or list(MODEL_KINDS)
        if len(args.models) < len(MODEL_KINDS) and not args.quiet:
            print(f"sweep: {args.key} acts in {' and '.join(args.models)} only; sweeping "
                  f"{'it' if len(args.models) == 1 else 'them'}")
    return args.key, values


def _read_baseline(run_dir: Path) -> Optional[float]:
    from ..training.run_directory import read_json

    data = read_json(run_dir / "compare.json") or {}
    value = data.get("unigram_baseline")
    return float(value) if value is not None else None


def _cmd_analyse(args: argparse.Namespace) -> int:
    from ..training.memory import check_memory

    config = load_config(_config_path(args), _overrides(args))
    try:
        from ..analysis import analyse  # type: ignore[attr-defined]
    except ImportError as error:
        raise UsageError(
            "'analyse' needs ipu_unit_scaling.analysis, which this installation lacks"
        ) from error
    check_memory(config)
    with _run_directory(args.run_dir, _runs_root(config), "analyse") as run_dir:
        table, figure = analyse(config, run_dir)
    print(table)
    print(f"figure: {figure}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from ..training.run_directory import RunLock

    precisions = list(args.precision or PRECISIONS)
    if len(set(precisions)) != len(precisions):
        raise UsageError(f"--precision lists a precision twice: {' '.join(precisions)}")
    if args.data is not None and not args.data.strip():
        raise UsageError("--data needs a file name (leave it out for the run's validation data)")
    # Shared with other readers; a run writing the directory refuses it, and is refused by it
    # until the results are written, so they name the checkpoint that is there.
    with RunLock(args.run_dir, shared=True, action="evaluate"):
        return _evaluate_locked(args, precisions)


def _evaluate_locked(args: argparse.Namespace, precisions: List[str]) -> int:
    from ..training.data import DataError, out_of_memory
    from .pretrained import evaluate_run, format_evaluation, open_run, write_evaluation

    run = open_run(args.run_dir, "evaluate")
    progress = _Progress("evaluate", quiet=args.quiet)
    if args.data is not None:
        progress.say(f"reading {args.data}")

    def start(description: str, total: int) -> None:
        progress.say(f"checkpoint at step {run.step}; {description}; {total} batches over "
                     f"{len(precisions)} precision(s)")
        progress.start(total)

    try:
        evaluation = evaluate_run(run, precisions, args.data, scale_report=args.scale_report,
                                  on_start=start, on_batch=progress.update)
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        raise DataError("out of memory while evaluating; evaluate a smaller --data file, or "
                        "free memory") from None
    finally:
        progress.close()
    out = args.out or args.run_dir
    if args.out is not None:
        from ..training.run_directory import make_run_dir

        make_run_dir(out)
    table = format_evaluation(evaluation)
    markdown, data = write_evaluation(evaluation, out)
    print(table)
    print(f"table: {markdown}; data: {data}")
    return 0


class _Progress:
    """Progress of long work on stderr: a bar on a terminal, else a line every
    ``interval`` seconds (logs of batch jobs); nothing with ``quiet``."""

    def __init__(self, desc: str, quiet: bool, interval: float = 30.0) -> None:
        self.desc, self.quiet, self.interval = desc, quiet, interval
        self.done, self.total = 0, 0
        self.bar: Any = None
        self.last = time.monotonic()

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"{self.desc}: {text}", file=sys.stderr, flush=True)

    def start(self, total: int) -> None:
        self.done, self.total, self.last = 0, total, time.monotonic()
        if not self.quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=self.desc, unit="batch", total=total, leave=False)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        elif time.monotonic() - self.last >= self.interval:
            self.last = time.monotonic()
            share = 100 * self.done / max(self.total, 1)
            self.say(f"{self.done}/{self.total} batches ({share:.1f}%)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _cmd_sample(args: argparse.Namespace) -> int:
    from ..training.run_directory import RunLock
    from .pretrained import check_prompt, default_prompt, open_run, sample_run

    with RunLock(args.run_dir, shared=True, action="sample"):
        run = open_run(args.run_dir, "sample")
        prompt = default_prompt(run.tokenizer) if args.prompt is None else args.prompt
        check_prompt(run.tokenizer, prompt)  # before anything is printed: an error is one line

        def show(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
            if getattr(sys.stdout, "left", False):  # `sample ... | head`: nobody reads on
                raise BrokenPipeError(errno.EPIPE, "the reader of the output has gone")

        show(prompt)
        text = sample_run(run, prompt, args.tokens, temperature=args.temperature,
                          top_k=args.top_k, seed=args.seed, precision=args.precision,
                          on_text=show)
        show("" if text.endswith("\n") else "\n")
    return 0


COMMANDS = {"train": _cmd_train, "compare": _cmd_compare, "sweep": _cmd_sweep,
            "analyse": _cmd_analyse, "evaluate": _cmd_evaluate, "sample": _cmd_sample}


class _ReaderMayLeave:
    """stdout or stderr, whose reader may go away (``... | head``): from then on what is
    written is dropped (``left`` says so), so that a run goes on to its end and its files
    instead of dying of its log."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.left = False

    def write(self, text: str) -> int:
        if not self.left:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self.left:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self.left = True
        try:  # the interpreter flushes the stream once more at exit: into the null device
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture)
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _escape_what_the_terminal_cannot_show()
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ReaderMayLeave(sys.stdout), _ReaderMayLeave(sys.stderr)
    try:
        return _run(argv)
    finally:
        sys.stdout, sys.stderr = streams


def _run(argv: List[str]) -> int:
    if not argv:
        *others, last = COMMANDS
        print(f"{PROG}: error: no command; use '{PROG} train' to train the default config, or "
              f"see '{PROG} --help' for {', '.join(others)} and {last}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0), or one line on bad arguments (2)
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    from ..backends import BackendError
    from ..loop.training_loop import (
        RunError,
        TrainingDiverged,
        TrainingInterrupted,
        raise_stop_signal,
    )
    from ..training.data import DataError
    from ..training.inference import SamplingError

    rank, world = _torchrun_rank_and_size()
    if world > 1 and args.command != "train":
        return _fail(f"{args.command} runs in one process; of the commands only train runs "
                     "under torchrun", speaks=rank == 0)
    # SIGTERM stops a command as Ctrl-C does (a training loop: at a step boundary, saved).
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_stop_signal) if on_main_thread else None
    # Under torchrun every rank meets these errors alike (rank 0 hands the others its own):
    # rank 0 says them.
    speaks = rank == 0
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError, RunError, BackendError, UsageError) as error:
        return _fail(_one_line(error), speaks)
    except (TrainingDiverged, SamplingError) as error:
        if speaks:
            print(f"{PROG}: {_one_line(error)}", file=sys.stderr)
        return EXIT_DIVERGED
    except (TrainingInterrupted, KeyboardInterrupt) as error:
        message = _one_line(error) or "interrupted"
        if speaks:
            print(f"{PROG}: {message}", file=sys.stderr)
        return 128 + getattr(error, "signum", EXIT_INTERRUPTED - 128)  # 130 SIGINT, 143 SIGTERM
    except BrokenPipeError:  # sample's reader has gone: nothing more to say, to no one
        return EXIT_READER_LEFT
    except OSError as error:  # a file system that refuses: full, read-only, gone
        where = f" ({error.filename})" if error.filename else ""
        return _fail(f"{error.strerror or _one_line(error)}{where}")
    except MemoryError:
        return _fail("out of memory; make the model or the batch smaller")
    except Exception as error:  # a bug: still one line, with a way to see where
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(f"internal error ({type(error).__name__}): {_one_line(error)}; set "
                     f"{DEBUG_ENV}=1 for the traceback")
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def command() -> NoReturn:
    """The ``ipu-unit-scaling`` console script and ``python -m ipu_unit_scaling``."""
    status = main()
    from ..backends.distributed import leave_launched_world

    leave_launched_world(status)
    sys.exit(status)


def _escape_what_the_terminal_cannot_show() -> None:
    # Characters the output's encoding lacks (u-μP where it is ASCII, a path of undecodable
    # bytes) come out as backslash escapes instead of stopping the command with a traceback.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot change now: leave it
                pass


def _fail(message: str, speaks: bool = True) -> int:
    if speaks:
        print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _torchrun_rank_and_size() -> Tuple[int, int]:
    """This process's rank and the number of processes, as torchrun set them; (0, 1) when it
    did not start this one."""
    try:
        return int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 0, 1


if __name__ == "__main__":
    sys.exit(main())
