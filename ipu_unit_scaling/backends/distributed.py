"""``ipu-unit-scaling train`` on ``torch.distributed``: the processes of torchrun's runs.

Launched under torchrun, the training loop is the one of every backend, and the config's IPU
layout says how the processes share the work::

    torchrun --nproc-per-node 2 -m ipu_unit_scaling train --config tiny

The world must hold ``ipu.ipus_per_replica x ipu.replication_factor`` processes: rank r runs
stage ``r % ipus_per_replica`` of replica ``r // ipus_per_replica``. Replicas are
``DistributedDataParallel``; the stages of ``ipu.layers_per_ipu`` are
``torch.distributed.pipelining`` stages (:mod:`.pipeline`). The two are two backend objects,
torchrun's data-parallel run and its pipelined run, both named ``distributed``
(:mod:`.torchrun_backend`); this module holds what they share. Each optimizer step takes the
``gradient_accumulation x replication_factor`` micro-batches of the global batch of
``training.batch_size`` samples, replica r the r-th ``gradient_accumulation`` of them, and
averages the gradients over all of them: the numbers of a single-process run of the same config.

The run directory belongs to rank 0. It alone creates, locks (exclusively, as any run that
writes), reads and writes it, and hands every other rank what it opened (config, text,
checkpoint) or the error that stopped it, with one broadcast: the other ranks never touch the
directory, so they need neither a shared file system nor a lock of their own, and a run that
rank 0 is refused (a directory in use, a damaged checkpoint) is refused on every rank alike.
Weights and optimizer state of a pipelined run are gathered on every rank before it is
evaluated or saved, so its checkpoint is that of a single-process run: it resumes with or without
torchrun, and ``evaluate`` and ``sample`` read it. A stop request (SIGINT, SIGTERM) on any rank
stops every rank at the same step boundary: the ranks agree on it with an all-reduce.

Processes talk over gloo, on the CPU.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import (
    Any,
    Callable,
    ContextManager,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
)

import torch
import torch.distributed as dist
from torch import nn

from ..training.run_config import IPUConfig
from .pipeline_stages import Stage

__all__ = [
    "launched_world_size", "join_launched_world", "writes_run_files",
    "opened_by_rank_zero", "done_by_rank_zero", "agreed_stop", "check_launch",
    "DistributedTrainingModel", "ReplicaRunner", "DataParallelReplica", "rank_place",
    "hand_failure_to_rank_zero", "failure_of_another_rank",
]

T = TypeVar("T")

# What torchrun sets for every process it starts.
WORLD_SIZE_ENV = "WORLD_SIZE"
RANK_ENV = "RANK"


def launched_world_size() -> int:
    """The number of processes torchrun started this one among; 0 when not under torchrun."""
    text = os.environ.get(WORLD_SIZE_ENV, "")
    try:
        return max(0, int(text))
    except ValueError:
        return 0


def _world() -> Tuple[int, int]:
    """(rank, size) of the process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def writes_run_files() -> bool:
    """Whether this process writes the run directory and speaks: rank 0, or a lone process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get(RANK_ENV, "0") in ("", "0")


def join_launched_world() -> None:
    """Join the process group torchrun launched this process into (gloo, from its environment
    variables); nothing when not under torchrun or already joined."""
    from .backend_error import BackendError

    if not launched_world_size() or (dist.is_available() and dist.is_initialized()):
        return
    if not dist.is_available() or not dist.is_gloo_available():
        raise BackendError("torchrun started this process, but this torch has no "
                           "torch.distributed with gloo to join the others with")
    try:
        dist.init_process_group("gloo")
    except (ValueError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise BackendError(f"cannot join the processes torchrun started: {first}") from None


def leave_launched_world(status: int) -> None:
    """End a process that joined torchrun's world at once, its output flushed: rank 0 with
    ``status``, the other ranks with 0.

    Rank 0 speaks for the run: it says why a run stopped (what another rank met is handed to
    it, :func:`hand_failure_to_rank_zero`) and its status is the run's. A rank that ended
    with a failure of its own would make torchrun stop rank 0 at once (SIGTERM), before rank 0
    has written the summary or said why, and report a second failure.

    The gloo process group keeps threads that abort the process ("terminate called without an
    active exception", SIGABRT) when the interpreter's teardown destroys them first, now and
    then; and ``destroy_process_group`` can hang on torch 2.0.1. The command's work, its files
    and its output are complete by now, so nothing of use is skipped.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if dist.get_rank() == 0 else 0)


# Where a rank other than 0 leaves rank 0 the error that stopped it (in the store of the
# process group, which torchrun's agent or rank 0 holds).
_FAILURE_KEY = "ipu-unit-scaling/failure"


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # (a private function: without it, no hand-over)
        return None


def hand_failure_to_rank_zero(error: BaseException) -> None:
    """On a rank other than 0, leave ``error`` (what stopped this rank) for rank 0 to report
    (:func:`failure_of_another_rank`); nothing on rank 0 or without a world."""
    rank, size = _world()
    if size == 1 or rank == 0:
        return
    import pickle

    store = _store()
    if store is None:
        return
    try:
        store.set(_FAILURE_KEY, pickle.dumps(_Failure(error)))
    except Exception:  # (the store is gone: rank 0 is too)
        pass


def failure_of_another_rank(wait_s: float = 3.0) -> Optional[BaseException]:
    """On rank 0, the error another rank stopped with (handed over by
    :func:`hand_failure_to_rank_zero`), waiting up to ``wait_s`` for it; None if there is
    none, or not on rank 0 of a world."""
    import datetime
    import pickle

    rank, size = _world()
    store = _store() if size > 1 and rank == 0 else None
    if store is None:
        return None
    try:
        store.wait([_FAILURE_KEY], datetime.timedelta(seconds=wait_s))
        failure = pickle.loads(store.get(_FAILURE_KEY))
    except Exception:
        return None
    return failure.error() if isinstance(failure, _Failure) else None


def _has_pipelining() -> bool:
    try:
        importlib.import_module("torch.distributed.pipelining")
    except ImportError:
        return False
    return True


def check_launch(ipu: Optional[IPUConfig] = None) -> None:
    """Refuse, in one line, a ``distributed`` run that cannot work: not under torchrun, a world
    that is not ``ipu``'s layout, or stages without torch.distributed.pipelining."""
    from .backend_error import BackendError

    world = launched_world_size()
    if not world:
        raise BackendError(
            "backend 'distributed' runs under torchrun, which sets WORLD_SIZE: e.g. torchrun "
            "--nproc-per-node 2 -m ipu_unit_scaling train ...; without it use 'auto' or 'cpu'")
    if ipu is None:
        return
    layout = ipu.ipus_per_replica * ipu.replication_factor
    if world != layout:
        hint = ""
        if world % ipu.ipus_per_replica == 0:
            hint = f" or set ipu.replication_factor={world // ipu.ipus_per_replica}"
        raise BackendError(
            f"torchrun started {world} processes, but the config lays the model out on "
            f"ipu.ipus_per_replica x ipu.replication_factor = {ipu.ipus_per_replica} x "
            f"{ipu.replication_factor} = {layout}: launch --nproc-per-node {layout}{hint}")
    if ipu.ipus_per_replica > 1 and not _has_pipelining():
        raise BackendError(
            f"ipu.ipus_per_replica = {ipu.ipus_per_replica} pipelines the model over "
            f"{ipu.ipus_per_replica} processes, which needs torch.distributed.pipelining, "
            f"missing from torch {torch.__version__}: train the stages on one process "
            "(without torchrun), or data-parallel only (ipu.ipus_per_replica=1 "
            "ipu.layers_per_ipu=[-1])")


# ------------------------------------------------------------------ one opening for all ranks


class _Failure:
    """An exception as it crosses to other processes: class, arguments and attributes (a
    class whose ``__init__`` takes other arguments than ``args`` pickles badly)."""

    def __init__(self, error: BaseException):
        self.kind = type(error)
        self.args = error.args
        self.attributes = dict(vars(error))

    def error(self) -> BaseException:
        error = self.kind.__new__(self.kind)
        error.args = self.args
        vars(error).update(self.attributes)
        return error


def _broadcast_from_rank_zero(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def opened_by_rank_zero(open_run: Callable[[], ContextManager[T]]) -> Iterator[T]:
    """What ``open_run()`` opens, for every rank: rank 0 enters it (it takes the run's lock and
    reads and writes the run directory) and broadcasts the result, or the exception that stopped
    it, which the other ranks raise in turn. Without a world of several processes, just
    ``open_run()``."""
    rank, size = _world()
    if size == 1:
        with open_run() as opened:
            yield opened
        return
    if rank != 0:
        received = _broadcast_from_rank_zero(None)
        if isinstance(received, _Failure):
            raise received.error()
        yield received
        return
    with contextlib.ExitStack() as stack:
        try:
            opened = stack.enter_context(open_run())
        except BaseException as error:
            _broadcast_from_rank_zero(_Failure(error))
            raise
        _broadcast_from_rank_zero(opened)
        yield opened


def done_by_rank_zero(work: Callable[[], None]) -> None:
    """``work()`` (reading or writing the run directory) on rank 0 alone; the exception that
    stopped it, if any, is raised on every rank. Without a world of several processes, just
    ``work()``."""
    rank, size = _world()
    if size == 1:
        work()
        return
    failure: Optional[_Failure] = None
    if rank == 0:
        try:
            work()
        except BaseException as error:
            failure = _Failure(error)
            _broadcast_from_rank_zero(failure)
            raise
    received = _broadcast_from_rank_zero(failure)
    if rank != 0 and isinstance(received, _Failure):
        raise received.error()


def agreed_stop(signum: Optional[int]) -> Optional[int]:
    """The stop request of the whole world: a signal any rank received (the largest number if
    several), on every rank, so that all stop at the same step; ``signum`` itself alone."""
    if _world()[1] == 1:
        return signum
    flag = torch.tensor([signum or 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None


# ------------------------------------------------------------------------- the training model


def rank_place(ipu: IPUConfig) -> Tuple[int, int]:
    """(replica, stage) of this rank in ``ipu``'s layout: rank r runs stage
    ``r % ipus_per_replica`` of replica ``r // ipus_per_replica``."""
    return divmod(_world()[0], ipu.ipus_per_replica)


class ReplicaRunner(Protocol):
    """This rank's share of one replica's step: what torchrun's data-parallel run
    (:class:`DataParallelReplica`) and its pipelined run
    (:class:`~ipu_unit_scaling.backends.pipeline.PipelineReplica`) each bring."""

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor
                         ) -> Tuple[Optional[List[torch.Tensor]], Optional[torch.Tensor]]:
        """Forward and backward over the replica's micro-batches of one step: their losses
        (None on a rank that holds none) and this rank's outputs (None where it has none)."""
        ...

    def clip_gradients(self, parameters: List[nn.Parameter], max_norm: float) -> None:
        ...

    def gather_weights(self, optimizer: torch.optim.Optimizer) -> None:
        """Give this rank the whole model's weights and optimizer state."""
        ...


class DistributedTrainingModel:
    """``poptorch.trainingModel``'s call, ``wrapper(inputs, labels) -> (output, loss)``, with
    this rank's share of the work (see the module docstring).

    ``inputs`` and ``labels`` are the whole call's samples, the same on every rank, as the CPU
    backend takes them. ``loss`` holds every micro-batch's loss, of every replica, in input
    order (gathered from the last stages), so ``loss.view(device_iterations, -1).mean(1)`` is
    each step's loss on every rank. ``output`` holds this rank's outputs only: the logits of
    its micro-batches with one stage, nothing (an empty tensor) on pipeline stages.

    ``ipu`` lays the model out, in the ``split`` of its stages; ``runner`` runs this rank's
    share of a step (the torchrun run that builds the model chooses it, after
    :func:`check_launch`); ``grad_clip`` is the training's gradient clipping and ``dropout``
    the model's.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ipu: IPUConfig,
                 runner: ReplicaRunner, split: Sequence[Stage], *, grad_clip: Optional[float],
                 dropout: float):
        self.model = model
        self.optimizer = optimizer
        self.device_iterations = ipu.device_iterations
        self.gradient_accumulation = ipu.gradient_accumulation
        self.replicas = ipu.replication_factor
        self.num_stages = ipu.ipus_per_replica
        self.max_grad_norm = grad_clip
        self.world_size = _world()[1]
        self.replica, self.stage_index = rank_place(ipu)
        self.stages = list(split)
        self.fresh_dropout = dropout > 0
        self._runner = runner

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        accumulation, replicas = self.gradient_accumulation, self.replicas
        per_step = accumulation * replicas
        per_call = self.device_iterations * per_step
        if inputs.shape[0] % per_call or labels.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"leading dimension {inputs.shape[0]} (labels {labels.shape[0]}) must be equal "
                f"and a multiple of device_iterations x gradient_accumulation x "
                f"replication_factor = {self.device_iterations} x {accumulation} x {replicas} "
                f"= {per_call}")
        micro = inputs.shape[0] // per_call
        share = accumulation * micro  # this replica's samples of one step
        outputs: List[torch.Tensor] = []
        local_losses = torch.zeros(self.device_iterations, accumulation)
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        for step in range(self.device_iterations):
            start = (step * per_step + self.replica * accumulation) * micro
            mine = slice(start, start + share)
            self.optimizer.zero_grad(set_to_none=True)
            with self._replica_randomness():
                losses, output = self._runner.forward_backward(inputs[mine], labels[mine])
            if losses is not None:
                local_losses[step] = torch.stack([x.detach().float().reshape(()) for x in losses])
            if output is not None:
                outputs.append(output)
            if self.max_grad_norm is not None:
                self._runner.clip_gradients(parameters, self.max_grad_norm)
            self.optimizer.step()
        output = torch.cat(outputs) if outputs else torch.empty(0)
        return output, self._all_losses(local_losses)

    @contextlib.contextmanager
    def _replica_randomness(self) -> Iterator[None]:
        """Dropout that differs between replicas, from the random stream every rank shares (and
        the checkpoint saves): a seed drawn from it, offset by the replica."""
        if not self.fresh_dropout:
            yield
            return
        seed = int(torch.randint(0, 2**62, (1,)).item())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + self.replica)
            yield

    def _all_losses(self, local: torch.Tensor) -> torch.Tensor:
        """Every replica's micro-batch losses, in input order, from the ranks that hold them."""
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        last = self.num_stages - 1
        per_replica = [gathered[replica * self.num_stages + last]
                       for replica in range(self.replicas)]
        return torch.stack(per_replica, 1).reshape(-1)

    def update_optimizer(self) -> None:
        """Call after changing learning rates; the optimizer here is the live one."""

    def copy_weights_to_host(self) -> None:
        """Give every rank the whole model and optimizer state (a pipeline's stages train
        apart), as a single-process run holds them: for evaluation and checkpoints."""
        self._runner.gather_weights(self.optimizer)

    def destroy(self) -> None:
        """The process group outlives the model: the command leaves it when it ends."""


class DataParallelReplica:
    """One replica of a model on one process: ``DistributedDataParallel`` averages the
    gradients of the replicas, once per step, after the last micro-batch."""

    def __init__(self, model: nn.Module, accumulation: int):
        from torch.nn.parallel import DistributedDataParallel

        from .cpu import TrainingModule

        self.accumulation = accumulation
        self.module = DistributedDataParallel(TrainingModule(model))

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor
                         ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        self.module.train()
        losses, outputs = [], []
        micro_inputs = inputs.chunk(self.accumulation)
        micro_labels = labels.chunk(self.accumulation)
        for index, (micro, micro_label) in enumerate(zip(micro_inputs, micro_labels)):
            last = index == self.accumulation - 1
            with contextlib.nullcontext() if last else self.module.no_sync():
                output, loss = self.module(micro, micro_label)
                (loss / self.accumulation).backward()  # the mean over micro-batches
            losses.append(loss.detach())
            outputs.append(output.detach())
        return losses, torch.cat(outputs)

    def clip_gradients(self, parameters: List[nn.Parameter], max_norm: float) -> None:
        # Every replica holds the averaged gradients: the norm of the whole model.
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def gather_weights(self, optimizer: torch.optim.Optimizer) -> None:
        """Replicas hold the same weights and optimizer state after every step."""
