"""The CPU backend: ``poptorch.trainingModel`` semantics on the host.

A training model is called ``wrapper(inputs, labels)`` and returns ``(output, loss)`` after it
has run backward and stepped the optimizer, exactly as PopTorch does. The leading dimension of
``inputs`` and ``labels`` is ``device_iterations x gradient_accumulation x replication_factor x
micro_batch`` (PopTorch's batching rule). Per device iteration, the gradients of all its
micro-batches are averaged (PopTorch's ``ReductionType.Mean``) and the optimizer steps once.

Outputs follow ``poptorch.OutputMode.All``, which the IPU backend sets: ``loss`` has one entry per
micro-batch, in input order, and ``output`` is the per-micro-batch outputs concatenated on dim 0.
``loss.view(device_iterations, -1).mean(1)`` gives the loss of each optimizer step.

The model being wrapped follows the contract of ``ipu_unit_scaling.models.gpt``:
``model(input_ids, labels, return_logits=True) -> (loss, logits)``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..training.run_config import Config
from .pipeline_stages import Stage, ipu_stages
from .registry import TrainingBackend


class TrainingModule(nn.Module):
    """Turns ``model(ids, labels, return_logits=True) -> (loss, logits)`` into PopTorch's
    ``(output, loss)`` order. The IPU backend subclasses it to mark the loss for PopTorch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        loss, logits = self.model(inputs, labels, return_logits=True)
        return logits, loss


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


class CPUBackend(TrainingBackend):
    """``cpu``: eager PyTorch on the host, with PopTorch's batching (:class:`CPUTrainingModel`)."""

    name = "cpu"

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> CPUTrainingModel:
        ipu = config.ipu
        return CPUTrainingModel(
            TrainingModule(model),
            optimizer,
            device_iterations=ipu.device_iterations,
            gradient_accumulation=ipu.gradient_accumulation,
            replication_factor=ipu.replication_factor,
            max_grad_norm=config.training.grad_clip,
            split=ipu_stages(model, ipu),
        )


CPU_BACKEND = CPUBackend()
