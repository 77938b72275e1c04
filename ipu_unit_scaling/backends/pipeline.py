"""The stages of ``ipu.layers_per_ipu`` as ``torch.distributed.pipelining`` stages, one process
each (torchrun's pipelined run, :mod:`.torchrun_backend`).

Stages reuse the model's own ``forward``: every process holds the whole model, and its stage is a
shallow copy of it whose ``layers`` keep only the stage's own layers (the others are
``nn.Identity``), sharing their parameters. While a stage runs, forward pre-hooks feed the
activation it received into its first layer and stop the forward at the input of the next
stage's first layer. The last stage takes the labels of its micro-batches in order, runs its
layers, the head and the model's own loss (a unit-scaled loss has its own backward), and
passes the loss on as its output. Parameters a stage does not own are frozen on its process,
so that its gradients, the optimizer's step and ``DistributedDataParallel`` between replicas of
the stage see exactly the stage's own. The GPipe schedule runs ``ipu.gradient_accumulation``
micro-batches per step and the gradients are their mean, as on one process.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .pipeline_stages import Stage, check_no_shared_parameters, layer_bounds, stage_parameters

__all__ = ["PipelineReplica", "StageModule", "boundary_module"]


class _StageBoundary(Exception):
    """Raised inside the model's forward to stop it at the end of a stage."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stage boundary")
        self.hidden = hidden


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no nn.ModuleList 'layers' to split")
    return layers


def boundary_module(model: nn.Module, boundary: int) -> nn.Module:
    """The module whose input is the activation after ``boundary`` layers."""
    layers = _layers(model)
    if boundary < len(layers):
        return layers[boundary]
    names = [name for name, _ in model.named_children()]
    after = names[names.index("layers") + 1:]
    tail = "final_norm" if "final_norm" in after else (after[0] if after else None)
    if tail is None:
        raise ValueError("a stage boundary after the last layer needs a module after 'layers'")
    return model.get_submodule(tail)


class StageModule(nn.Module):
    """The part of ``model.forward`` from layer ``start`` to layer ``end``.

    ``forward(x)`` takes token ids on the first stage and the hidden state on later ones. It
    returns the hidden state at the stage's end, or on the last stage the loss (shape ``[1]``)
    of the next labels given to :meth:`expect` (recorded in ``losses``).
    """

    def __init__(self, model: nn.Module, start: int, end: int):
        super().__init__()
        layers = _layers(model)
        depth = len(layers)
        own = nn.ModuleList([layer if start <= index < end else nn.Identity()
                             for index, layer in enumerate(layers)])
        stage_model = _shallow_copy(model)
        stage_model._modules["layers"] = own
        self.model = stage_model
        self.is_first = start == 0
        self.is_last = end == depth
        self._inject = None if self.is_first else boundary_module(stage_model, start)
        self._capture = None if self.is_last else boundary_module(stage_model, end)
        self._labels: List[torch.Tensor] = []
        self.losses: List[torch.Tensor] = []

    def expect(self, labels: Sequence[torch.Tensor]) -> None:
        """The labels of the micro-batches the next schedule step runs, in order."""
        self._labels = list(labels)
        self.losses = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        labels = None
        if self.is_last:
            if len(self.losses) >= len(self._labels):
                raise RuntimeError("the last pipeline stage ran more micro-batches than it has "
                                   "labels for")
            labels = self._labels[len(self.losses)]
        ids = x if self.is_first else torch.zeros(x.shape[:2], dtype=torch.long)

        def pre_hook(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
            if module is self._inject:
                args = (x,) + tuple(args[1:])
            if module is self._capture:
                raise _StageBoundary(args[0])
            return args

        points = {id(m): m for m in (self._inject, self._capture) if m is not None}
        handles = [point.register_forward_pre_hook(pre_hook) for point in points.values()]
        try:
            result = self.model(ids) if labels is None else self.model(ids, labels)
        except _StageBoundary as boundary:
            return boundary.hidden
        finally:
            for handle in handles:
                handle.remove()
        if labels is None:
            raise RuntimeError("a pipeline stage ran past its end")
        self.losses.append(result.detach())
        return result.reshape(1)


def _shallow_copy(model: nn.Module) -> nn.Module:
    """``model`` with a children mapping of its own: its parameters, buffers and hooks shared."""
    copy = model.__class__.__new__(model.__class__)
    copy.__dict__.update(model.__dict__)
    copy.__dict__["_modules"] = dict(model._modules)
    return copy


def _boundary_examples(model: nn.Module, micro_batch: Tuple[int, int],
                       boundaries: Sequence[int]) -> Tuple[Dict[int, torch.Tensor], torch.Tensor]:
    """Tensors shaped as the activations entering each boundary, and the loss, of one
    micro-batch: what the stages send each other (and gradients of), known before the first
    step."""
    examples: Dict[int, torch.Tensor] = {}
    handles = []
    for boundary in boundaries:
        def record(module: nn.Module, args: Tuple[Any, ...], boundary: int = boundary) -> None:
            examples.setdefault(boundary, torch.zeros_like(args[0]).requires_grad_())
        handles.append(boundary_module(model, boundary).register_forward_pre_hook(record))
    ids = torch.zeros(micro_batch, dtype=torch.long)
    was_training = model.training
    try:
        # (no randomness drawn: the run's random stream stays that of a run on one process)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            loss = model(ids, ids)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return examples, torch.zeros_like(loss).reshape(1).requires_grad_()


class PipelineReplica:
    """This process's stage of one replica's pipeline; replicas of a stage are
    ``DistributedDataParallel`` over the ranks that run it."""

    def __init__(self, model: nn.Module, split: List[Stage], micro_batch: Tuple[int, int],
                 replicas: int, accumulation: int, replica: int, stage_index: int):
        from torch.distributed import pipelining
        from torch.nn.parallel import DistributedDataParallel

        check_no_shared_parameters(model, split)
        self.model = model
        self.num_stages = len(split)
        self.replicas = replicas
        self.replica = replica
        self.accumulation = accumulation
        self.pipeline_group, data_parallel_group = self._groups(stage_index)

        owned = {id(p) for p in stage_parameters(model, split[stage_index])}
        self.owned = [name for name, p in model.named_parameters() if id(p) in owned]
        for parameter in model.parameters():
            if id(parameter) not in owned:
                parameter.requires_grad_(False)

        bounds = layer_bounds(split)
        start, end = bounds[stage_index]
        examples, loss_example = _boundary_examples(
            model, micro_batch, sorted({first for first, _ in bounds[1:]}))
        self.module = StageModule(model, start, end)
        runner: nn.Module = self.module
        if self.replicas > 1 and self.owned:
            runner = DistributedDataParallel(self.module, process_group=data_parallel_group)
        ids_example = torch.zeros(micro_batch, dtype=torch.long)
        stage = pipelining.PipelineStage(
            runner, stage_index, self.num_stages, torch.device("cpu"),
            input_args=ids_example if self.module.is_first else examples[start],
            output_args=loss_example if self.module.is_last else examples[end],
            group=self.pipeline_group,
        )
        options: Dict[str, Any] = {}
        if "scale_grads" in inspect.signature(pipelining.ScheduleGPipe).parameters:
            options["scale_grads"] = False  # the loss below is already the mean's share
        self.schedule = pipelining.ScheduleGPipe(
            stage, n_microbatches=self.accumulation, loss_fn=self._loss, **options)

    def _groups(self, stage_index: int) -> Tuple[Optional[Any], Optional[Any]]:
        """This replica's pipeline group and this stage's data-parallel group (every rank
        creates every group, in the same order, as ``new_group`` requires)."""
        if self.replicas == 1:
            return None, None  # the whole world is the one pipeline
        pipeline_group = data_parallel_group = None
        for replica in range(self.replicas):
            group = dist.new_group([replica * self.num_stages + s
                                    for s in range(self.num_stages)])
            if replica == self.replica:
                pipeline_group = group
        for stage in range(self.num_stages):
            group = dist.new_group([r * self.num_stages + stage for r in range(self.replicas)])
            if stage == stage_index:
                data_parallel_group = group
        return pipeline_group, data_parallel_group

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.sum() / self.accumulation

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor
                         ) -> Tuple[Optional[List[torch.Tensor]], None]:
        """One step's forward and backward of this stage over the replica's micro-batches;
        the last stage returns their losses."""
        self.module.train()
        if not self.module.is_last:
            self.schedule.step(*((inputs,) if self.module.is_first else ()))
            return None, None
        self.module.expect(labels.chunk(self.accumulation))
        self.schedule.step(target=labels)
        return self.module.losses, None

    def clip_gradients(self, parameters: List[nn.Parameter], max_norm: float) -> None:
        """Scale the gradients as ``clip_grad_norm_`` on the whole model would: the norm is
        over every stage of the pipeline."""
        grads = [p.grad for p in parameters if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32)
        for grad in grads:
            squares = squares + torch.linalg.vector_norm(grad.detach(), 2).float() ** 2
        dist.all_reduce(squares, group=self.pipeline_group)
        scale = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(scale.to(grad.dtype))

    def gather_weights(self, optimizer: torch.optim.Optimizer) -> None:
        """Every stage's weights and optimizer state from the first replica, on every rank."""
        parameters = dict(self.model.named_parameters())
        mine = {}
        if self.replica == 0:
            mine = {name: (parameters[name].detach().clone(), optimizer.state.get(parameters[name]))
                    for name in self.owned}
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        owned = set(self.owned)
        for part in gathered:
            for name, (weights, state) in part.items():
                if name in owned:
                    continue
                parameter = parameters[name]
                with torch.no_grad():
                    parameter.copy_(weights)
                if state is None:
                    optimizer.state.pop(parameter, None)
                else:
                    optimizer.state[parameter] = state
