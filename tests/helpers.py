"""Plain helpers and constants shared by several test files: ``from helpers import run``.

The convention: what pytest sets up and tears down around a test (a fixture) lives in
``conftest.py``, where pytest finds it by name; what a test calls itself, with its own
arguments, and shared constants live here, imported by name, so a reader sees where they
come from (``conftest.py`` is not meant to be imported). pytest puts ``tests/`` on
``sys.path`` (the default "prepend" import mode, ``tests/`` has no ``__init__.py``), so
``import helpers`` works from every test file, those in subfolders of ``tests/`` included.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import pytest
import torch

#: The repository root, whatever folder of ``tests/`` the importing test file is in.
ROOT = Path(__file__).resolve().parent.parent

#: A small text corpus for the character-level training runs.
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))

#: ``--set`` items that keep a ``tiny`` CLI run on one IPU, one micro-batch per step.
ONE_IPU = ["ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[-1]", "ipu.gradient_accumulation=1"]

#: ``--set`` items of :func:`train_args`: one IPU, one evaluation batch.
FAST = [*ONE_IPU, "training.eval_batches=1"]


def run(capsys: pytest.CaptureFixture, *argv: object) -> Tuple[int, str, str]:
    """Run the CLI in process on ``argv`` (each item made a string); return its exit status,
    stdout and stderr."""
    from ipu_unit_scaling.apps.cli import main

    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(err: str) -> bool:
    """Whether stderr is the CLI's one-line error, with no traceback and no internal error."""
    return err.startswith("ipu-unit-scaling: error: ") and err.count("\n") == 1 and \
        "Traceback" not in err and "internal error" not in err


def train_args(run_dir: Path, data: Path, *settings: str) -> List[str]:
    """CLI arguments of a quiet ``tiny`` training run on ``data`` into ``run_dir``, with
    :data:`FAST` and then ``settings`` as ``--set`` items."""
    return ["train", "--config", "tiny", "--data", str(data), "--run-dir", str(run_dir),
            "--quiet", "--set", *FAST, *settings]


def require_host_library() -> None:
    """Return if the FP8 host library is built; fail when it should be (a C++ compiler
    exists) and is not; skip visibly where there is no compiler."""
    from ipu_unit_scaling.fp8 import host_library as _host

    if _host.fused_cast_available():
        return
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(f"no C++ compiler, host library not built: {_host.fast_path_status()}")
    pytest.fail(f"host library missing although a compiler exists: {_host.fast_path_status()}")


def wide_range_input(size: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal samples spread over many binades, so casts hit FP8 subnormals and zero too."""
    generator = torch.Generator().manual_seed(size)
    spread = torch.exp((torch.randn(size, generator=generator) * 3.0).clamp(-14.0, 7.0))
    return (torch.randn(size, generator=generator) * spread).to(dtype)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error ``|a - b| / |b|`` in the 2-norm."""
    return float((a - b).norm() / b.norm())


def run_op(fn: Callable, shapes: Sequence[Tuple[int, ...]], seed: int = 0
           ) -> Tuple[float, List[float]]:
    """Std of the output and of each input's gradient for unit-normal inputs and output grad."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(*s, generator=gen, requires_grad=True) for s in shapes]
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=gen))
    return out.std().item(), [x.grad.std().item() for x in inputs]


def files_in(directory: Path, skip: Sequence[str] = ()) -> Dict[str, bytes]:
    """The bytes of every file under ``directory`` (a run's ``tensorboard/`` included, where
    TensorBoard is installed) by relative path, less the files named in ``skip``."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in skip}


def run_files(run_dir: Path) -> Dict[str, bytes]:
    """:func:`files_in` less the run's ``.lock``: what a refused command must leave as it was."""
    return files_in(run_dir, skip=(".lock",))


def train_in_process(data: Path, run_dir: Path, settings: Sequence[str]) -> Path:
    """Train the ``tiny`` config with ``settings`` on ``data`` into ``run_dir`` in this
    process (the loop itself, no command line); return ``run_dir``."""
    from dataclasses import replace

    from ipu_unit_scaling.loop.training_loop import train
    from ipu_unit_scaling.training.run_config import load_config

    config = load_config("tiny", list(settings))
    config = replace(config, data=replace(config.data, path=str(data)))
    train(config, run_dir, quiet=True)
    return run_dir


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the 2-norm, computed in float64 (0 / 0 is 0)."""
    reference = b.detach().double().norm().item()
    return (a.detach().double() - b.detach().double()).norm().item() / max(reference, 1e-30)


# ------------------------------------------------------------------ runs under torchrun
# (tests/conftest.py's ``word_text`` fixture is their data.)

#: Steps of :data:`DATA_PARALLEL`.
DATA_PARALLEL_STEPS = 12
#: In FP32: a distributed run sums gradients in another order than one process, and FP8 casts
#: would round a last-bit difference to a different FP8 value, which then grows step by step.
FP32 = "precision.dtype=fp32"
#: A data-parallel run: two replicas of one stage, two micro-batches each per step.
DATA_PARALLEL = ["ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[-1]", "ipu.replication_factor=2",
                 "ipu.gradient_accumulation=2", f"training.steps={DATA_PARALLEL_STEPS}",
                 "training.eval_interval=4", "training.checkpoint_interval=4",
                 "training.grad_clip=0.5", FP32]

needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available()
                                     and torch.distributed.is_gloo_available()),
                                reason="no torch.distributed with gloo")


def _has_pipelining() -> bool:
    try:
        import torch.distributed.pipelining  # noqa: F401
    except ImportError:
        return False
    return True


needs_pipelining = pytest.mark.skipif(
    not _has_pipelining(), reason=f"torch {torch.__version__} has no torch.distributed.pipelining")


def torchrun_environment(**extra: str) -> Dict[str, str]:
    """This process's environment without a backend choice or a torchrun rank, on one thread,
    with the repository on ``PYTHONPATH``, and ``extra``."""
    from ipu_unit_scaling.backends import BACKEND_ENV

    env = {k: v for k, v in os.environ.items()
           if k not in (BACKEND_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
    return env


def tiny_train_arguments(data: Path, run_dir: Path, settings: Sequence[str]) -> List[str]:
    """CLI arguments of a quiet ``tiny`` training run with ``settings`` (and nothing else)."""
    return ["train", "--config", "tiny", "--data", str(data), "--run-dir", str(run_dir),
            "--quiet", "--set", *settings]


def as_a_foreground_job() -> None:
    """``preexec_fn`` for a command a test sends Ctrl-C: SIGINT's default action, as an
    interactive shell's foreground job has it. A test process started in a script's
    background (``pytest ... &``) inherits SIGINT ignored, and the command would keep it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def torchrun(arguments: Sequence[str], processes: int = 2) -> subprocess.Popen:
    """``python -m ipu_unit_scaling ARGUMENTS`` under torchrun, ``processes`` workers."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(processes), "-m", "ipu_unit_scaling", *arguments]
    # (a session of its own: its workers go with it if the test must kill it)
    return subprocess.Popen(command, cwd=ROOT, env=torchrun_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=as_a_foreground_job)


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL the process's session (its workers too) if it still runs."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    """The output of ``process`` once it ends; fail the test if it runs past ``timeout``."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process)
        output, _ = process.communicate()
        pytest.fail(f"timed out:\n{output[-3000:]}")
    finally:
        kill_session(process)  # workers left behind
    return output


def metric_rows(run_dir: Path) -> int:
    """Rows in the run's metrics.csv so far (0 before it exists)."""
    try:
        return len((run_dir / "metrics.csv").read_text().splitlines()) - 1
    except FileNotFoundError:
        return 0


def wait_for_rows(run_dir: Path, rows: int, processes: Sequence[subprocess.Popen]) -> None:
    """Wait until metrics.csv has ``rows`` rows; fail if a process ends or 240 s pass first."""
    deadline = time.monotonic() + 240
    while metric_rows(run_dir) < rows:
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            pytest.fail(f"the run ended or stalled before step {rows}")
        time.sleep(0.01)


def child_pids(pid: int) -> List[int]:
    """The process ids whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def worker_of_rank(launcher: subprocess.Popen, rank: int) -> int:
    """The process id of torchrun's worker of ``rank``."""
    for pid in child_pids(launcher.pid):
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun")


def backward_nodes(tensor: torch.Tensor) -> List[str]:
    """The names of the autograd nodes `tensor`'s backward pass runs: a Python Function's
    ``_NameBackward`` (its class name: torch 2.0's Python nodes refuse ``name()``), a C++
    node's ``name()`` (``torch::autograd::CppNode<...::Name>`` for a custom one)."""
    seen, names, stack = set(), [], [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        python_node = isinstance(node, torch.autograd.function.BackwardCFunction)
        names.append(type(node).__name__ if python_node else node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def built_native_layers():
    """The compiled layer nodes (`ops.native_layers`). Skips the test only where they are
    switched off or cannot be built for want of a C++ compiler or ninja; a build that fails
    with both at hand fails the test."""
    from ipu_unit_scaling.ops import native_layers

    extension = native_layers.module()
    if extension is None:
        if native_layers.switched_off() or not (shutil.which("c++") and shutil.which("ninja")):
            pytest.skip(native_layers.status())
        pytest.fail(native_layers.status())
    return extension


def transformers_with_torch():
    """transformers, or a skip where it is absent or has no PyTorch models for this torch
    (transformers 5 turns them off below torch 2.6; the Poplar SDK's torch is 2.0.1)."""
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        pytest.skip(f"transformers {transformers.__version__} has no PyTorch models for torch "
                    f"{torch.__version__}")
    return transformers


#: Optimum Graphcore's environment (``.ci/optimum-graphcore`` makes it): its pins are not ours.
OPTIMUM_VENV = Path(os.environ.get("IPU_UNIT_SCALING_OPTIMUM_VENV") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "ipu-unit-scaling" / "venv-optimum-graphcore")
OPTIMUM_PYTHON = OPTIMUM_VENV / "bin" / "python"


def optimum_graphcore_installed() -> bool:
    """Whether Optimum Graphcore imports in :data:`OPTIMUM_VENV`."""
    if not OPTIMUM_PYTHON.exists():
        return False
    found = subprocess.run(
        [str(OPTIMUM_PYTHON), "-c", "import importlib.util as u; "
         "print(u.find_spec('optimum.graphcore') is not None)"],
        capture_output=True, text=True, timeout=120)
    return found.stdout.strip() == "True"


def torch_before(major: int, minor: int) -> bool:
    """Whether this torch is older than ``major.minor`` (the Poplar SDK's is 2.0.1)."""
    return tuple(int(part) for part in torch.__version__.split(".")[:2]) < (major, minor)
