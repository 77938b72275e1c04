"""What the ``ipu-unit-scaling`` subcommands run (train, sweep, analyse, evaluate, sample), and
the helpers, exit codes and names they share with :mod:`.compare` and :mod:`.cli`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Sequence, Tuple

from ..training.config_files import CONFIGS_DIR, ConfigError
from ..training.config_names import MODEL_KINDS, PRECISION_NAMES

if TYPE_CHECKING:  # the schema imports torch: loaded when a command runs, not for --help
    from ..training.run_config import Config


PROG = "ipu-unit-scaling"
EXIT_DIVERGED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_READER_LEFT = 141  # 128 + SIGPIPE, what a shell reports for a command whose pipe closed
MAX_THREADS = 1024
DEBUG_ENV = "IPU_UNIT_SCALING_DEBUG"  # set to 1: unexpected errors show their traceback

# How tables name the three model kinds of training.config_names.MODEL_KINDS.
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



class UsageError(ValueError):
    """Arguments that parse but cannot work together."""


# ------------------------------------------------------------------------------ helpers


def command_overrides(args: argparse.Namespace) -> List[str]:
    """The ``--set`` overrides of the command line, in order."""
    return [item for group in args.overrides for item in group]


def _config_path(args: argparse.Namespace) -> Optional[str]:
    """``--config``, else ``configs/default.yaml`` where the configs directory is installed."""
    if args.config is not None:
        return str(args.config)
    return "default" if (CONFIGS_DIR / "default.yaml").is_file() else None


def load_command_config(args: argparse.Namespace) -> Config:
    """The config of ``--config``, ``--set`` and ``--data``, its data path made absolute."""
    from ..training.run_config import absolute_path, load_config

    config = load_config(_config_path(args), command_overrides(args))
    data = getattr(args, "data", None)
    if data is not None and not data.strip():
        raise UsageError("--data needs a file name (leave it out for the embedded corpus)")
    if data is None:
        data = config.data.path
    # the path is saved absolute: readable from anywhere
    return dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                path=absolute_path(data)))


@contextlib.contextmanager
def command_run_directory(chosen: Optional[Path], root: str, command: str) -> Iterator[Path]:
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
def continued_by_running_again(command: str, run_dir: Path) -> Iterator[None]:
    """A regime or point stopped by a signal is taken up by the same command, which resumes it
    and runs the rest; ``train --resume`` on it alone would leave the rest undone."""
    from ..loop.run_outcomes import TrainingInterrupted

    try:
        yield
    except TrainingInterrupted as error:
        stopped = str(error).split("; continue with:")[0]
        raise TrainingInterrupted(
            f"{stopped}; to continue, run the same {command} command again with --run-dir "
            f"{run_dir}: it reuses what finished and resumes the rest",
            error.step, error.checkpoint, error.signum) from error


def runs_root(config: Config) -> str:
    """Where a command makes its run directories: ``training.checkpoint_dir``, else ``runs``."""
    return config.training.checkpoint_dir or "runs"


def one_line_message(error: BaseException, most: int = 5) -> str:
    """``error`` as one line of the command's error output (at most ``most`` problems)."""
    if isinstance(error, ConfigError):
        problems = [f"{path}: {message}" if path else message for path, message in error.errors]
        more = len(problems) - most
        text = "; ".join(problems[:most]) + (f"; and {more} more" if more > 0 else "")
        return "invalid config: " + " ".join(text.split())
    return " ".join(str(error).split())


def format_number(value: Optional[float], digits: int = 4) -> str:
    """A loss for a table or a log line: ``digits`` decimals, ``-`` for None."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if math.isfinite(value) else str(value)


# ------------------------------------------------------------------------------ commands


def command_train(args: argparse.Namespace) -> int:
    """``train``: train, resume or fine-tune one run."""
    from ..loop.training_loop import train
    from ..training.run_config import absolute_path_override

    directory: Any
    if args.resume is not None:
        if args.config is not None or args.data is not None or args.run_dir is not None \
                or args.init_from is not None:
            raise UsageError("--resume continues a run with its own config, data, directory "
                             "and start; change settings with --set")
        config = None  # the run's own, read under its lock
        directory = contextlib.nullcontext(args.resume)
        args.overrides = [[absolute_path_override(item) for item in command_overrides(args)]]
    elif args.init_from is not None:
        config = _fine_tuning_config(args)
        directory = command_run_directory(args.run_dir, runs_root(config), "finetune")
    else:
        config = load_command_config(args)
        directory = command_run_directory(args.run_dir, runs_root(config), "train")
    from ..backends.distributed import writes_run_files

    with directory as run_dir:
        summary = train(config, run_dir, resume=args.resume is not None,
                        overrides=command_overrides(args), quiet=args.quiet,
                        scale_report=args.scale_report, log=print, init_from=args.init_from)
    if not writes_run_files():
        return 0  # rank 0 of the torchrun world reports
    print(f"final validation loss {format_number(summary.final_val_loss)} nats per character "
          f"(best {format_number(summary.best_val_loss)}); unigram baseline "
          f"{format_number(summary.unigram_baseline)}, uniform "
          f"{format_number(summary.uniform_baseline)}")
    print(f"{summary.steps} steps in {summary.elapsed_s:.1f} s "
          f"({summary.tokens_per_s:.0f} tokens/s, {summary.backend}); run directory: {run_dir}")
    return 0


def _fine_tuning_config(args: argparse.Namespace) -> Config:
    """The pretrained run's config with --set and --data: the config of ``--init-from``."""
    from ..loop.run_opening import load_run_config
    from ..training.run_config import absolute_path
    from ..training.run_directory import RunError, not_a_directory

    if args.config is not None:
        raise UsageError("--init-from fine-tunes with the pretrained run's config, whose model "
                         "it keeps; change other settings with --set")
    problem = not_a_directory(args.init_from)
    if problem:
        raise RunError(f"cannot fine-tune from {args.init_from}: {problem}")
    config = load_run_config(args.init_from, command_overrides(args), "fine-tune from")
    if args.data is not None and not args.data.strip():
        raise UsageError("--data needs a file name (leave it out for the pretrained "
                         "run's data)")
    data = config.data.path if args.data is None else args.data
    return dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                path=absolute_path(data)))


def command_sweep(args: argparse.Namespace) -> int:
    """``sweep``: train a grid of widths, depths and learning rates."""
    from .sweep import default_exponents, run_sweep, sweep_report

    config = load_command_config(args)
    chosen = args.models
    key, values = _sweep_key(args, config)
    if config.model.factory is not None:
        _given_model_kinds(args, chosen)
    exponents = {kind: default_exponents(config, kind, args.span or 2) for kind in args.models}
    for item in args.log2_lr:
        kind, _, bounds = item.partition("=")
        low, _, high = bounds.partition(":")
        try:
            grid = range(int(low), int(high) + 1)  # a range: no list of a huge span is made
        except ValueError:
            grid = range(0)
        if kind not in args.models or not grid:
            raise UsageError(f"--log2-lr {item!r}: expected MODEL=LO:HI with MODEL one of "
                             f"{', '.join(args.models)} and integers LO <= HI")
        exponents[kind] = list(_in_learning_rate_range(f"--log2-lr {item}", grid))
    for kind in args.models:
        _in_learning_rate_range(f"--span {args.span or 2} around {kind}'s default",
                                exponents[kind])
    depths = args.depths or [config.model.depth]
    for width in args.widths:
        if width % config.model.heads:
            raise UsageError(f"--widths {width}: model.heads ({config.model.heads}) must "
                             "divide every width")
    with command_run_directory(args.run_dir, runs_root(config), "sweep") as run_dir, \
            continued_by_running_again("sweep", run_dir):
        points = run_sweep(config, args.models, args.widths, depths, exponents, run_dir,
                           quiet=args.quiet, key=key, values=values,
                           keep_checkpoints=args.keep_checkpoints)
    print(sweep_report(config, points))
    print(f"transfer plot: {run_dir / 'sweep.png'}; table: {run_dir / 'sweep.md'}")
    return 0


def _in_learning_rate_range(what: str, grid: Sequence[int]) -> Sequence[int]:
    """``grid``, the log2 learning rates of a sweep, unless a rate is one no run takes."""
    from ..training.run_config import (
        LEARNING_RATE_RANGE,
        MAX_LEARNING_RATE,
        MIN_LEARNING_RATE,
    )

    low, high = math.log2(MIN_LEARNING_RATE), math.log2(MAX_LEARNING_RATE)
    if grid and not low <= grid[0] <= grid[-1] <= high:  # grid is in increasing order
        raise UsageError(f"{what}: learning rates 2^{grid[0]} .. 2^{grid[-1]}; allowed: "
                         f"{LEARNING_RATE_RANGE} (float32 numbers in the optimizer step)")
    return grid


def _sweep_key(args: argparse.Namespace, config: Config) -> Tuple[Optional[str], List[Any]]:
    """``--key`` and its parsed ``--values`` (None, [] for a learning-rate sweep); fills in
    ``args.models`` where it was left out."""
    from .sweep import kinds_using, parse_sweep_values

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


def _given_model_kinds(args: argparse.Namespace, chosen: Optional[List[str]]) -> None:
    """A given model (``model.factory``) has one form, so ``plain`` would train it again under
    another name; ``unit`` and ``u-mup`` differ in the optimizer's rates (one rate, or u-μP's
    per-tensor rates from each parameter's ``mup_type``)."""
    if chosen and "plain" in chosen:
        raise UsageError("--models plain: model.factory builds one model whatever the kind; "
                         "sweep it as unit (one learning rate) or u-mup (u-μP's per-tensor "
                         "rates)")
    if "plain" in args.models:
        args.models = [kind for kind in args.models if kind != "plain"]
        if not args.quiet:
            print(f"sweep: model.factory gives one model; sweeping it as "
                  f"{' and '.join(args.models)}")


def read_baseline(run_dir: Path) -> Optional[float]:
    """The unigram baseline a comparison's compare.json recorded, or None."""
    from ..training.run_directory import read_json

    data = read_json(run_dir / "compare.json") or {}
    value = data.get("unigram_baseline")
    return float(value) if value is not None else None


def command_analyse(args: argparse.Namespace) -> int:
    """``analyse``: the scale report of the config's model."""
    from ..training.memory import check_memory
    from ..training.run_config import load_config

    config = load_config(_config_path(args), command_overrides(args))
    from ..analysis import analyse
    check_memory(config)
    with command_run_directory(args.run_dir, runs_root(config), "analyse") as run_dir:
        table, figure = analyse(config, run_dir)
    print(table)
    print(f"figure: {figure}; table: {figure.with_name('scales.txt')}")
    return 0


def command_evaluate(args: argparse.Namespace) -> int:
    """``evaluate``: a trained run's validation loss in each precision."""
    from ..training.run_directory import RunLock

    precisions = list(args.precision or [])
    if len(set(precisions)) != len(precisions):
        raise UsageError(f"--precision lists a precision twice: {' '.join(precisions)}")
    unknown = [name for name in precisions
               if name not in PRECISION_NAMES and not name.startswith("fp8-")]
    if unknown:
        raise UsageError(f"--precision {unknown[0]}: allowed: {', '.join(PRECISION_NAMES)}, "
                         "or the FP8 recipe the run trained in (fp8-mx, fp8-block, ...)")
    if args.data is not None and not args.data.strip():
        raise UsageError("--data needs a file name (leave it out for the run's validation data)")
    if args.out is not None:  # before the evaluation, which may take minutes
        from ..training.run_directory import not_a_directory

        problem = not_a_directory(args.out)
        if problem and problem != "no such directory":  # a new one is made
            raise UsageError(f"--out {args.out}: {problem}")
    # Shared with other readers; a run writing the directory refuses it, and is refused by it
    # until the results are written, so they name the checkpoint that is there.
    with RunLock(args.run_dir, shared=True, action="evaluate"):
        return _evaluate_locked(args, precisions)


def _evaluate_locked(args: argparse.Namespace, precisions: List[str]) -> int:
    from ..training.data import DataError, out_of_memory
    from .pretrained import evaluate_run, format_evaluation, open_run, write_evaluation

    run = open_run(args.run_dir, "evaluate")
    other = [name for name in precisions if name not in run.precisions]
    if other:
        raise UsageError(f"--precision {other[0]}: {args.run_dir} trained in {run.precision}; "
                         f"allowed: {', '.join(run.precisions)}")
    precisions = precisions or run.precisions
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


def command_sample(args: argparse.Namespace) -> int:
    """``sample``: text generated by a trained run."""
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
                failed = getattr(sys.stdout, "failed", None)
                if failed is not None:  # closed (>&-) or full (>/dev/full): the text is lost
                    raise OSError(failed.errno, f"cannot write {failed.filename}: "
                                                f"{failed.strerror}")
                raise BrokenPipeError(errno.EPIPE, "the reader of the output has gone")

        show(prompt)
        text = sample_run(run, prompt, args.tokens, temperature=args.temperature,
                          top_k=args.top_k, seed=args.seed, precision=args.precision,
                          on_text=show)
        show("" if text.endswith("\n") else "\n")
    return 0
