"""The CPU fallback for ``poptorch.trainingModel``, and the stage split shared by all backends.

A training model is called ``wrapper(inputs, labels)`` and returns ``(output, loss)`` after it
has run backward and stepped the optimizer, exactly as PopTorch does. The leading dimension of
``inputs`` and ``labels`` is ``device_iterations x gradient_accumulation x replication_factor x
micro_batch`` (PopTorch's batching rule). Per device iteration, the gradients of all its
micro-batches are averaged (PopTorch's ``ReductionType.Mean``) and the optimizer steps once.

Outputs follow ``poptorch.OutputMode.All``, which the IPU backend sets: ``loss`` has one entry per
micro-batch, in input order, and ``output`` is the per-micro-batch outputs concatenated on dim 0.
``loss.view(device_iterations, -1).mean(1)`` gives the loss of each optimizer step.

The model being wrapped follows the contract of ``ipu_unit_scaling.models``:
``model(input_ids, labels, return_logits=True) -> (loss, logits)``, with its transformer blocks in
an ``nn.ModuleList`` called ``layers``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .config import resolve_layers_per_ipu

if TYPE_CHECKING:
    from .config import Config

# Children that must sit with the first or last stage whatever their registration order.
INPUT_SIDE = ("embedding", "position_embedding")
OUTPUT_SIDE = ("final_norm", "head")


class TrainingModule(nn.Module):
    """Turns ``model(ids, labels, return_logits=True) -> (loss, logits)`` into PopTorch's
    ``(output, loss)`` order. The IPU backend subclasses it to mark the loss for PopTorch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        loss, logits = self.model(inputs, labels, return_logits=True)
        return logits, loss


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: IPU ``index`` of a replica, or one rank of a torch pipeline."""

    index: int
    modules: Tuple[str, ...]  # names of the model's submodules placed on this stage
    layers: Tuple[int, ...]  # indices into model.layers


def split_stages(model: nn.Module, layers_per_stage: Sequence[int]) -> List[Stage]:
    """Place ``model.layers`` by ``layers_per_stage`` (explicit counts, no ``-1``).

    Children registered before ``layers`` (embeddings) go on the first stage and those after
    it (final norm, head, loss) on the last, so activations flow one way through the stages.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no nn.ModuleList 'layers' to split")
    if sum(layers_per_stage) != len(layers) or any(c < 0 for c in layers_per_stage):
        raise ValueError(
            f"layers_per_stage {list(layers_per_stage)} must be counts summing to the "
            f"{len(layers)} layers of the model"
        )
    first: List[str] = []
    last: List[str] = []
    seen_layers = False
    for name, _ in model.named_children():
        if name == "layers":
            seen_layers = True
        elif name in INPUT_SIDE:
            first.append(name)
        elif name in OUTPUT_SIDE or seen_layers:
            last.append(name)
        else:
            first.append(name)
    stages: List[Stage] = []
    start = 0
    for index, count in enumerate(layers_per_stage):
        indices = tuple(range(start, start + count))
        names = [f"layers.{i}" for i in indices]
        if index == 0:
            names = first + names
        if index == len(layers_per_stage) - 1:
            names = names + last
        stages.append(Stage(index=index, modules=tuple(names), layers=indices))
        start += count
    return stages


def stages(model: nn.Module, config: Config) -> List[Stage]:
    """The stage split ``config.ipu.layers_per_ipu`` gives ``model`` (for inspection)."""
    counts = resolve_layers_per_ipu(
        config.ipu.layers_per_ipu, len(getattr(model, "layers", ())), config.ipu.ipus_per_replica
    )
    return split_stages(model, counts)


def stage_parameters(model: nn.Module, stage: Stage) -> Iterator[nn.Parameter]:
    for name in stage.modules:
        yield from model.get_submodule(name).parameters()


def check_no_shared_parameters(model: nn.Module, split: Sequence[Stage]) -> None:
    """Tied weights cannot live on two stages at once; say which ones are."""
    owner: Dict[int, Tuple[int, str]] = {}
    for stage in split:
        for module_name in stage.modules:
            module = model.get_submodule(module_name)
            for param_name, param in module.named_parameters():
                previous = owner.setdefault(id(param), (stage.index, module_name))
                if previous[0] != stage.index:
                    raise ValueError(
                        f"parameter {module_name}.{param_name} is shared with {previous[1]} on "
                        f"stage {previous[0]}; untie it or place both on one stage"
                    )


class CPUTrainingModel:
    """``poptorch.trainingModel`` semantics on the host (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device_iterations: int = 1,
        gradient_accumulation: int = 1,
        replication_factor: int = 1,
        max_grad_norm: Optional[float] = None,
        split: Optional[Sequence[Stage]] = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.device_iterations = device_iterations
        self.gradient_accumulation = gradient_accumulation
        self.replication_factor = replication_factor
        self.max_grad_norm = max_grad_norm
        self.stages: List[Stage] = list(split) if split is not None else []

    @property
    def micro_batches_per_step(self) -> int:
        # Replicas run their micro-batches side by side; on one host they run in turn.
        return self.gradient_accumulation * self.replication_factor

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        per_call = self.device_iterations * self.micro_batches_per_step
        if inputs.shape[0] % per_call or labels.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"leading dimension {inputs.shape[0]} (labels {labels.shape[0]}) must be equal "
                f"and a multiple of device_iterations x gradient_accumulation x "
                f"replication_factor = {self.device_iterations} x {self.gradient_accumulation} "
                f"x {self.replication_factor} = {per_call}"
            )
        self.model.train()
        outputs: List[torch.Tensor] = []
        losses: List[torch.Tensor] = []
        micro_inputs = inputs.chunk(per_call)
        micro_labels = labels.chunk(per_call)
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        n = self.micro_batches_per_step
        for step in range(self.device_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in range(step * n, (step + 1) * n):
                output, loss = self.model(micro_inputs[micro], micro_labels[micro])
                (loss / n).backward()  # mean over micro-batches, like ReductionType.Mean
                outputs.append(output.detach())
                losses.append(loss.detach().reshape(()))
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(parameters, self.max_grad_norm)
            self.optimizer.step()
        return torch.cat(outputs), torch.stack(losses)

    def update_optimizer(self) -> None:
        """Call after changing learning rates; the host optimizer is already the live one."""

    def copy_weights_to_host(self) -> None:
        """The weights already live on the host."""

    def destroy(self) -> None:
        """Nothing to release on the host."""
