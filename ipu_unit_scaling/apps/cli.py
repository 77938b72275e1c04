"""The ``ipu-unit-scaling`` command line: ``train``, ``compare``, ``sweep``, ``analyse``,
``evaluate``, ``sample`` and ``emulate``, each an entry of :data:`COMMANDS`; the process's
signals and streams are :mod:`.process`'s.

Exit status: 0 done, 1 diverged (a non-finite or exploding training loss, or non-finite sampled
logits), 2 bad arguments, config, data or run directory (one line on stderr, never a traceback),
130 Ctrl-C (SIGINT), 143 SIGTERM, 141 when what reads sample's output goes away (``| head``);
the other commands then go on without their log.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, NoReturn, Optional, Sequence

from .process import hold_ctrl_c_from_the_start

hold_ctrl_c_from_the_start()  # before the imports below, which Ctrl-C may otherwise cut

from .. import __version__  # noqa: E402  (after the handler: these imports may be cut)
from ..training.config_names import (  # noqa: E402
    FP8_RECIPE_NAMES,
    MAX_SEED,
    MODEL_KINDS,
    PRECISION_NAMES,
    REGIMES,
)
from .commands import (  # noqa: E402
    DEBUG_ENV,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_READER_LEFT,
    EXIT_USAGE,
    MAX_THREADS,
    PROG,
    REGIME_HELP,
    one_line_message,
)
from .process import (  # noqa: E402
    ReaderMayLeave,
    ctrl_c_held,
    escape_what_the_terminal_cannot_show,
    keep_standard_descriptors_taken,
    torchrun_rank_and_size,
)

__all__ = ["main", "build_parser"]


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
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def _train_parser(commands: Any) -> argparse.ArgumentParser:
    train = commands.add_parser(
        "train", help="train one model (default: unit-scaled GPT in FP8 on the embedded corpus)",
        description="Train the config's GPT. Writes config.yaml, tokenizer.json, metrics.csv, "
                    "summary.json, loss.png and checkpoint.pt into the run directory, and "
                    "tensorboard/ (TensorBoard event files) where TensorBoard is installed "
                    "(pip install tensorboard); prints "
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
    return train


def _compare_parser(commands: Any) -> argparse.ArgumentParser:
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
        "--recipes", nargs="+", choices=FP8_RECIPE_NAMES, metavar="RECIPE",
        help="instead of --regimes: fp32 and each FP8 recipe, on the plain and the unit-scaled "
             f"GPT (regimes fp8-<recipe> and unit-fp8-<recipe>); any of "
             f"{', '.join(FP8_RECIPE_NAMES)} (see docs/guide/fp8.md)",
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
    return compare


def _sweep_parser(commands: Any) -> argparse.ArgumentParser:
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
    sweep.add_argument("--keep-checkpoints", action="store_true",
                       help="keep each finished point's checkpoint.pt (by default a point keeps "
                            "its config, metrics, summary and figure, and its checkpoint only "
                            "until it finishes)")
    return sweep


def _analyse_parser(commands: Any) -> argparse.ArgumentParser:
    analyse = commands.add_parser(
        "analyse", help="compare tensor scales of the plain and unit-scaled model",
        description="Measure the scales of activations, weights and gradients of the config's "
                    "GPT built plainly and unit-scaled, and write a figure (scales.png) and a "
                    "table of the tensors nearest the edges of FP16's and FP8's ranges "
                    "(scales.txt), which it also prints.",
    )
    analyse.add_argument("--config", metavar="FILE", help="YAML config (default: the default run)")
    analyse.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="append", default=[],
                         dest="overrides", help="override config values")
    analyse.add_argument("--run-dir", metavar="DIR", type=Path,
                         help="where to write the figure and table (default: runs/analyse-...)")
    return analyse


def _health_parser(commands: Any) -> argparse.ArgumentParser:
    health = commands.add_parser(
        "health", help="is a run healthy? its FP8 telemetry per site, and its warnings",
        description="Read a run directory (finished, killed or still training) and print, per "
                    "FP8 cast site, the worst flushed and saturated fractions and their steps, "
                    "the range of its scaling bias and its SQNR; each attention layer's "
                    "largest logit; and every early warning with its step. Changes nothing.",
    )
    health.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory")
    health.add_argument("--json", action="store_true",
                        help="print a JSON document instead (its 'warnings' list has step, "
                             "site and kind)")
    health.add_argument("--params", action="store_true",
                        help="also the u-μP inspector: each parameter's role, multipliers, "
                             "init std, effective learning rate and measured update/weight "
                             "ratio, outliers flagged")
    return health


def _evaluate_parser(commands: Any) -> argparse.ArgumentParser:
    evaluate = commands.add_parser(
        "evaluate", help="a trained run's loss in fp32, fp16 and post-training FP8",
        description="Evaluate a trained run's checkpoint in each precision: fp32, fp16 "
                    "(float16 matmuls), fp8-static (FP8 casts at scale 2^0) and fp8-amax (FP8 "
                    "with per-tensor AMAX scaling), and the FP8 recipe the run trained in "
                    "when it is another (fp8-mx, fp8-block, ...). The data is the windows its "
                    "training "
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
    evaluate.add_argument("--precision", nargs="+", metavar="PRECISION",
                          help=f"precisions to evaluate: {', '.join(PRECISION_NAMES)}, and the "
                               "FP8 recipe the run trained in (fp8-mx, fp8-block, ...); "
                               "default: all of these")
    evaluate.add_argument("--scale-report", action="store_true",
                          help="also give the FP8 casts' under- and overflow fractions by role")
    evaluate.add_argument("--out", metavar="DIR", type=Path,
                          help="where to write evaluate.md and evaluate.json (default: RUN_DIR)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_threads(evaluate)
    return evaluate


def _sample_parser(commands: Any) -> argparse.ArgumentParser:
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
    sample.add_argument("--precision", choices=PRECISION_NAMES, metavar="PRECISION",
                        help=f"one of {', '.join(PRECISION_NAMES)} (default: the precision the run "
                             "trained in)")
    _add_threads(sample)
    return sample


def _add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", metavar="N", type=_thread_count, default=1,
                        help="CPU threads for torch (default 1)")


def _emulate_parser(commands: Any) -> argparse.ArgumentParser:
    # Its arguments are the program's, passed on unparsed (see main()); this is its --help.
    return commands.add_parser(
        "emulate", help="run an unchanged PopTorch program on the CPU, `import poptorch` "
        "resolved to the stand-in, on an emulated IPU-POD16 (--ipus N sets its IPUs): "
        "emulate [--ipus N] SCRIPT [ARGS...] | emulate [--ipus N] -m MODULE [ARGS...]")


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


# ------------------------------------------------------------------------ the commands
# A command's loader imports the module that runs it (when the command runs, with Ctrl-C held)
# and gives its function.
Runner = Callable[[Any], int]


def _load_train() -> Runner:
    from .commands import command_train

    return command_train


def _load_compare() -> Runner:
    from .compare import command_compare

    return command_compare


def _load_sweep() -> Runner:
    from .commands import command_sweep

    return command_sweep


def _load_analyse() -> Runner:
    from .commands import command_analyse

    return command_analyse


def _load_evaluate() -> Runner:
    from .commands import command_evaluate

    return command_evaluate


def _load_sample() -> Runner:
    from .commands import command_sample

    return command_sample


def _load_health() -> Runner:
    from .health import command_health

    return command_health


def _load_emulate() -> Runner:
    from .emulate import run_emulated

    return run_emulated


@dataclass(frozen=True)
class Command:
    """One command: its parser (added to the command line's) and its loader. A command that
    ``runs_a_program`` takes the rest of the line unparsed, as the program's own arguments,
    and the process as the program would have it (its streams, its signals, its errors)."""

    add_parser: Callable[[Any], argparse.ArgumentParser]
    load: Callable[[], Runner]
    runs_a_program: bool = False


# The command line's commands, in the order --help lists them: adding one is a line here, with
# its parser and its runner above.
COMMANDS = {
    "train": Command(_train_parser, _load_train),
    "compare": Command(_compare_parser, _load_compare),
    "sweep": Command(_sweep_parser, _load_sweep),
    "analyse": Command(_analyse_parser, _load_analyse),
    "evaluate": Command(_evaluate_parser, _load_evaluate),
    "sample": Command(_sample_parser, _load_sample),
    "health": Command(_health_parser, _load_health),
    "emulate": Command(_emulate_parser, _load_emulate, runs_a_program=True),
}


def command_for(name: str) -> Runner:
    """The function that runs the command ``name``, its module imported now."""
    return COMMANDS[name].load()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command is not None and command.runs_a_program:
        with ctrl_c_held() as held:  # the program then takes Ctrl-C as it would alone
            run_program = command.load()
        return EXIT_INTERRUPTED if held else run_program(argv[1:])
    keep_standard_descriptors_taken()
    escape_what_the_terminal_cannot_show()
    streams = sys.stdout, sys.stderr
    out = ReaderMayLeave(sys.stdout, "standard output")
    sys.stdout, sys.stderr = out, ReaderMayLeave(sys.stderr, "standard error")
    try:
        try:
            status = _run(argv)
        except KeyboardInterrupt:  # Ctrl-C before a command handles it (in its imports, say)
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        out.flush()
        if out.failed is not None and status == 0:
            # What the command printed is lost: its result, where the command's files went.
            return _fail(f"cannot write {out.name}: {out.failed.strerror} (the command ran; "
                         "what it printed was dropped)")
        return status
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
    with ctrl_c_held() as held:  # an import cut by Ctrl-C can leave a library half-loaded
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        from ..backends import BackendError
        from ..loop.run_outcomes import TrainingDiverged, TrainingInterrupted
        from ..loop.stop_signals import raise_stop_signal
        from ..training.config_files import ConfigError
        from ..training.data import DataError
        from ..training.inference import SamplingError
        from ..training.run_directory import RunError
        from .commands import UsageError

        run_command = command_for(args.command)
    if held:
        print(f"{PROG}: interrupted before {args.command} started", file=sys.stderr)
        return EXIT_INTERRUPTED

    rank, world = torchrun_rank_and_size()
    if world > 1 and args.command != "train":
        return _fail(f"{args.command} runs in one process; of the commands only train runs "
                     "under torchrun", speaks=rank == 0)
    # SIGTERM stops a command as Ctrl-C does (a training loop: at a step boundary, saved).
    # (Not where the process was started ignoring it: it stays ignored.)
    on_main_thread = threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    previous = signal.signal(signal.SIGTERM, raise_stop_signal) if on_main_thread else None
    # Under torchrun every rank meets these errors alike (rank 0 hands the others its own):
    # rank 0 says them.
    speaks = rank == 0
    try:
        return run_command(args)
    except (ConfigError, DataError, RunError, BackendError, UsageError) as error:
        return _fail(one_line_message(error), speaks)
    except (TrainingDiverged, SamplingError) as error:
        if speaks:
            print(f"{PROG}: {one_line_message(error)}", file=sys.stderr)
        return EXIT_DIVERGED
    except (TrainingInterrupted, KeyboardInterrupt) as error:
        message = one_line_message(error) or "interrupted"
        if speaks:
            print(f"{PROG}: {message}", file=sys.stderr)
        return 128 + getattr(error, "signum", EXIT_INTERRUPTED - 128)  # 130 SIGINT, 143 SIGTERM
    except BrokenPipeError:  # sample's reader has gone: nothing more to say, to no one
        return EXIT_READER_LEFT
    except OSError as error:  # a file system that refuses: full, read-only, gone
        where = f" ({error.filename})" if error.filename else ""
        return _fail(f"{error.strerror or one_line_message(error)}{where}")
    except MemoryError:
        return _fail("out of memory; make the model or the batch smaller")
    except Exception as error:  # a bug: still one line, with a way to see where
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(f"internal error ({type(error).__name__}): {one_line_message(error)}; set "
                     f"{DEBUG_ENV}=1 for the traceback")
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def command() -> NoReturn:
    """The ``ipu-unit-scaling`` console script and ``python -m ipu_unit_scaling``."""
    status = main()
    if "torch.distributed" in sys.modules:  # else no world was joined (--version, --help)
        from ..backends.distributed import leave_launched_world

        leave_launched_world(status)
    sys.exit(status)


def _fail(message: str, speaks: bool = True) -> int:
    if speaks:
        print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
