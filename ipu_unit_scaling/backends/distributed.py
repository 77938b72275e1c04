"""Scale-out without IPUs: a config's IPU layout run with ``torch.distributed``.

The ``ipu.layers_per_ipu`` split becomes ``torch.distributed.pipelining`` stages, one process per
stage, with ``ipu.gradient_accumulation`` micro-batches per step (GPipe schedule) and
``ipu.replication_factor`` pipelines side by side as data parallelism (gradients averaged over
replicas). One optimizer step per batch of ``training.batch_size`` samples, the same numbers as
the single-process fallback. Launch one process per stage and replica::

    torchrun --nproc-per-node 2 -m ipu_unit_scaling.backends.distributed --config configs/tiny.yaml

Stages reuse the model's own ``forward``: every process builds the whole model from the same
seed, replaces the layers it does not own by ``nn.Identity`` and, with forward pre-hooks, feeds
the activations it receives into its first layer and stops at the input of the next stage's
first layer. The last stage computes the model's own loss; labels reach it as the schedule's target.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import (
    Config,
    load_config,
    resolve_layers_per_ipu,
    scheduled_learning_rate,
    with_steps,
)
from ..optim import set_learning_rate
from .stages import Stage, check_no_shared_parameters, split_stages, stage_parameters

Batch = Tuple[torch.Tensor, torch.Tensor]


def _pipelining() -> Any:
    try:
        import torch.distributed.pipelining as pipelining
    except ImportError as error:  # added in torch 2.4
        raise RuntimeError(
            f"pipeline scale-out needs torch.distributed.pipelining (torch >= 2.4); this is "
            f"torch {torch.__version__}. Use the CPU fallback or an IPU backend instead."
        ) from error
    return pipelining


class _StageBoundary(Exception):
    """Raised inside the model's forward to stop it at the end of this stage."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stage boundary")
        self.hidden = hidden


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no nn.ModuleList 'layers' to split")
    return layers


def _boundary_module(model: nn.Module, boundary: int) -> nn.Module:
    """The module whose input is the activation after ``boundary`` layers."""
    layers = _layers(model)
    if boundary < len(layers):
        return layers[boundary]
    names = [name for name, _ in model.named_children()]
    after = names[names.index("layers") + 1 :]
    tail = "final_norm" if "final_norm" in after else (after[0] if after else None)
    if tail is None:
        raise ValueError("a stage boundary after the last layer needs a module after 'layers'")
    return model.get_submodule(tail)


class PipelineStageModule(nn.Module):
    """The part of ``model.forward`` between layer ``start`` and layer ``end``.

    ``forward(x)`` takes token ids on the first stage and the hidden state on later ones, and
    returns the hidden state at the stage's end. The last stage returns its input unchanged
    and does its work in ``loss(hidden, labels)``, the pipeline's loss function, because only
    there are the labels at hand; that runs its layers, the head and the model's own loss.
    """

    def __init__(self, model: nn.Module, start: int, end: int):
        super().__init__()
        layers = _layers(model)
        depth = len(layers)
        for index in range(depth):
            if not start <= index < end:
                layers[index] = nn.Identity()  # not ours: pass through, hold no weights
        self.model = model
        self.is_first = start == 0
        self.is_last = end == depth
        self._incoming: Optional[torch.Tensor] = None
        inject = None if self.is_first else _boundary_module(model, start)
        capture = None if self.is_last else _boundary_module(model, end)

        def pre_hook(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
            if module is inject and self._incoming is not None:
                args = (self._incoming,) + tuple(args[1:])
            if module is capture:
                raise _StageBoundary(args[0])
            return args

        for point in {id(m): m for m in (inject, capture) if m is not None}.values():
            point.register_forward_pre_hook(pre_hook)

    def _run(self, x: torch.Tensor, labels: Optional[torch.Tensor]) -> Any:
        if self.is_first:
            ids = x
        else:
            # Later stages still call the whole forward; the ids only feed embeddings whose
            # output the injected hidden state replaces, so any ids of the right shape do.
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
            self._incoming = x
        try:
            return self.model(ids) if labels is None else self.model(ids, labels)
        except _StageBoundary as boundary:
            return boundary.hidden
        finally:
            self._incoming = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_last:
            return x.view_as(x)
        return self._run(x, None)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._run(output, labels)


def stage_bounds(counts: Sequence[int], stage: int) -> Tuple[int, int]:
    start = sum(counts[:stage])
    return start, start + counts[stage]


class PipelineTrainer:
    """One process's share of a pipelined, replicated training run.

    Needs an initialised default process group of ``ipus_per_replica x replication_factor``
    ranks; rank r runs stage ``r % ipus_per_replica`` of replica ``r // ipus_per_replica``.
    """

    def __init__(self, model: nn.Module, config: Config, device: Optional[torch.device] = None):
        from . import make_optimizer

        pipelining = _pipelining()
        ipu = config.ipu
        self.config = config
        self.num_stages = ipu.ipus_per_replica
        self.replicas = ipu.replication_factor
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != self.num_stages * self.replicas:
            raise ValueError(
                f"world size {world} must equal ipu.ipus_per_replica x ipu.replication_factor "
                f"= {self.num_stages} x {self.replicas}"
            )
        self.stage_index = rank % self.num_stages
        self.replica = rank // self.num_stages
        self.device = device or torch.device("cpu")

        counts = resolve_layers_per_ipu(ipu.layers_per_ipu, len(_layers(model)), self.num_stages)
        split: List[Stage] = split_stages(model, counts)
        check_no_shared_parameters(model, split)
        owned = list(stage_parameters(model, split[self.stage_index]))
        start, end = stage_bounds(counts, self.stage_index)
        self.module = PipelineStageModule(model, start, end).to(self.device)

        # Every rank creates every group, in the same order, as new_group requires.
        self.pipeline_group = self.data_parallel_group = None
        for replica in range(self.replicas):
            ranks = [replica * self.num_stages + s for s in range(self.num_stages)]
            group = dist.new_group(ranks)
            if replica == self.replica:
                self.pipeline_group = group
        for stage in range(self.num_stages):
            ranks = [r * self.num_stages + stage for r in range(self.replicas)]
            group = dist.new_group(ranks)
            if stage == self.stage_index:
                self.data_parallel_group = group

        self.parameters = owned
        self.optimizer = make_optimizer(owned, config, backend="cpu", model=model)
        stage = pipelining.PipelineStage(
            self.module,
            self.stage_index,
            self.num_stages,
            self.device,
            group=self.pipeline_group,
        )
        self.schedule = pipelining.ScheduleGPipe(
            stage, n_microbatches=ipu.gradient_accumulation, loss_fn=self.module.loss
        )
        self.step_count = 0
        self.learning_rate = 0.0  # of the last step

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on a global batch (same on every rank); returns its mean loss."""
        training = self.config.training
        if self.step_count >= training.steps:
            # The schedule has reached zero there: a step would change nothing, silently.
            raise ValueError(f"step {self.step_count + 1} is past training.steps = "
                             f"{training.steps}, where the learning-rate schedule ends; "
                             "set training.steps to the number of steps to run")
        self.learning_rate = scheduled_learning_rate(training, self.step_count)
        set_learning_rate(self.optimizer, self.learning_rate)
        inputs, labels = self._replica_slice(inputs), self._replica_slice(labels)
        self.optimizer.zero_grad(set_to_none=True)
        losses: List[torch.Tensor] = []
        args = (inputs.to(self.device),) if self.stage_index == 0 else ()
        if self.stage_index == self.num_stages - 1:
            self.schedule.step(*args, target=labels.to(self.device), losses=losses)
        else:
            self.schedule.step(*args)
        self._average_gradients_over_replicas()
        if training.grad_clip is not None:
            self._clip_gradients(training.grad_clip)
        self.optimizer.step()
        self.step_count += 1

        # Mean over micro-batches (the schedule already averaged the gradients likewise) and
        # replicas; only last stages hold a loss, so the sum over all ranks is that mean.
        local = torch.stack([x.detach().float().reshape(()) for x in losses]).mean() if losses \
            else torch.zeros(())
        total = (local / self.replicas).to(self.device)
        dist.all_reduce(total)
        return float(total)

    def _replica_slice(self, batch: torch.Tensor) -> torch.Tensor:
        share = batch.shape[0] // self.replicas
        return batch[self.replica * share : (self.replica + 1) * share]

    def _average_gradients_over_replicas(self) -> None:
        if self.replicas == 1:
            return
        for param in self.parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self.data_parallel_group)
            param.grad /= self.replicas

    def _clip_gradients(self, max_norm: float) -> None:
        grads = [p.grad for p in self.parameters if p.grad is not None]
        squares = sum((g.float() ** 2).sum() for g in grads) if grads else torch.zeros(())
        squares = torch.as_tensor(squares, device=self.device)
        dist.all_reduce(squares, group=self.pipeline_group)  # the whole model's norm
        scale = max_norm / (float(squares.sqrt()) + 1e-6)
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)


def train_pipeline(
    model: nn.Module, config: Config, batches: Iterable[Batch], steps: Optional[int] = None
) -> List[float]:
    """Run ``steps`` pipelined steps (default ``training.steps``), with the learning-rate
    schedule of a run of that length; every rank returns the same per-step losses."""
    if steps is not None and steps != config.training.steps:
        config = with_steps(config, steps)
    steps = config.training.steps
    trainer = PipelineTrainer(model, config)
    losses = []
    for _, (inputs, labels) in zip(range(steps), batches):
        losses.append(trainer.step(inputs, labels))
    return losses


def _default_model(config: Config) -> nn.Module:
    from dataclasses import asdict

    from ..models import GPTConfig, build_gpt  # type: ignore[attr-defined]

    return build_gpt(GPTConfig(**asdict(config.model)))


def _text_batches(config: Config, seed: int) -> Iterable[Batch]:
    """Random windows of a byte-level corpus: ``data.path`` or the embedded default."""
    if config.data.path is not None:
        with open(config.data.path, "rb") as handle:
            tokens = torch.tensor(list(handle.read()), dtype=torch.long)
    else:
        try:
            from ..data import load_tokens  # type: ignore[attr-defined]
        except ImportError as error:
            raise RuntimeError("no embedded corpus here; set data.path to a text file") from error
        tokens = torch.as_tensor(load_tokens(config), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    length = config.model.seq_len
    while True:
        starts = torch.randint(0, tokens.numel() - length - 1, (config.training.batch_size,),
                               generator=generator)
        window = torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def config_from_arguments(argv: Optional[Sequence[str]] = None) -> Config:
    """The run's config from the command line: ``--config``, ``--set``, and ``--steps``, which
    is ``training.steps`` (so that the schedule follows the steps run)."""
    parser = argparse.ArgumentParser(description="Pipelined training under torchrun.")
    parser.add_argument("--config", default=None, help="YAML file or configs/ name")
    parser.add_argument("--set", dest="overrides", nargs="+", action="append", default=[],
                        metavar="KEY=VALUE", help="override config keys, as the "
                        "ipu-unit-scaling command's --set (may be repeated)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="steps to train, and the length of the learning-rate schedule "
                             "(sets training.steps; default: training.steps)")
    args = parser.parse_args(argv)
    config = load_config(args.config, [item for group in args.overrides for item in group])
    return config if args.steps is None else with_steps(config, args.steps)


def main(
    argv: Optional[Sequence[str]] = None,
    model_factory: Optional[Callable[[Config], nn.Module]] = None,
) -> List[float]:
    config = config_from_arguments(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.manual_seed(config.training.seed)  # identical weights on every rank
        model = (model_factory or _default_model)(config)
        steps = config.training.steps
        device = torch.device("cuda") if backend == "nccl" else None
        trainer = PipelineTrainer(model, config, device)
        losses = []
        batches = _text_batches(config, config.training.seed)
        for step, (inputs, labels) in zip(range(steps), batches):
            losses.append(trainer.step(inputs, labels))
            if dist.get_rank() == 0 and (step + 1) % config.training.log_interval == 0:
                print(f"step {step + 1}/{steps} loss {losses[-1]:.4f} "
                      f"lr {trainer.learning_rate:.6g}", flush=True)
        return losses
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
