"""``poptorch.trainingModel`` built from a config: options, pipeline annotation, optimizer.

PopTorch is imported inside the functions only, so this module imports anywhere.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from ...ops.trace_switch import FP8CustomOps, ipu_tracing
from ...training.run_config import Config
from ..cpu import TrainingModule
from ..stages import Stage, stages
from .compile_checks import check_config_compiles, check_inputs
from .fp8_custom_op import PopTorchFP8CustomOps, load_custom_op_library
from .poptorch_options import build_options
from .rewrites import PopTorchRewrites


@contextlib.contextmanager
def _poptorch_forms(fp8_ops: Optional[FP8CustomOps], tracing: bool) -> Iterator[None]:
    """While PopTorch traces: every op in its PopTorch form, and the calls PopTorch would
    refuse rewritten to exact equivalents (:mod:`.rewrites`)."""
    if not tracing:
        yield
        return
    with ipu_tracing(fp8_ops), PopTorchRewrites():
        yield


class IPUTrainingModule(TrainingModule):
    """``(output, loss)`` with the loss marked for PopTorch's autograd.

    While PopTorch traces it for the IPU (``poptorch.isRunningOnIpu()``), the model runs inside
    ``ipu_tracing()``: unit scaling's backward scales are then part of the forward graph that
    PopART differentiates, and FP8 casts are the PopART custom ops.
    """

    def __init__(self, model: nn.Module, fp8_ops: Optional[FP8CustomOps] = None):
        super().__init__(model)
        self.fp8_ops = fp8_ops

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        import poptorch

        with _poptorch_forms(self.fp8_ops, poptorch.isRunningOnIpu()):
            logits, loss = super().forward(inputs, labels)
        # The model's loss is already a mean; "none" tells PopTorch to take it as is.
        return logits, poptorch.identity_loss(loss, reduction="none")


def annotate_pipeline(model: nn.Module, split: Sequence[Stage], poptorch: Any) -> None:
    """``poptorch.BeginBlock`` on every module of every stage, one block id per IPU.

    Blocks that share a user id form one block, so each IPU holds one pipeline stage and
    ``AutoStage.AutoIncrement`` numbers the stages in IPU order.
    """
    for stage in split:
        for name in stage.modules:
            poptorch.BeginBlock(model.get_submodule(name), f"ipu{stage.index}", stage.index)


def make_ipu_optimizer(parameters: Any, config: Config) -> torch.optim.Optimizer:
    """The PopTorch optimizer for ``config.training`` (gradient clipping runs on the IPU).

    ``parameters`` may be parameter groups, each with its own ``lr`` and ``weight_decay`` (u-μP's,
    from :func:`ipu_unit_scaling.parametrization.mup_optimizers.param_groups`): PopTorch takes
    per-group values as
    torch does, and sends the groups' changed learning rates to the device on ``setOptimizer``.
    The groups' ``lr_scale`` key is for the host's schedule; PopTorch ignores keys it does not
    use.
    """
    import poptorch

    training = config.training
    classes = {
        "sgd": poptorch.optim.SGD,
        "adam": poptorch.optim.Adam,
        "adamw": poptorch.optim.AdamW,
    }
    return classes[training.optimizer](
        parameters,
        lr=training.learning_rate,
        weight_decay=training.weight_decay,
        max_grad_norm=training.grad_clip,
    )


class IPUTrainingModel:
    """A compiled-on-first-call ``poptorch.trainingModel`` with the fallback's interface."""

    def __init__(self, model: nn.Module, optimizer: Any, config: Config, use_ipu_model: bool):
        import poptorch

        self.model = model
        self.stages = stages(model, config)
        # PopTorch's own compile checks, before an IPU is asked for.
        check_config_compiles(config, self.stages, training=True, use_ipu_model=use_ipu_model)
        if config.ipu.ipus_per_replica > 1:
            annotate_pipeline(model, self.stages, poptorch)
        self.options = build_options(config, use_ipu_model)
        self.optimizer = optimizer
        fp8_ops = PopTorchFP8CustomOps()
        if config.precision.dtype == "fp8":
            load_custom_op_library()  # a missing library fails here, not mid-compilation
        self.executor = poptorch.trainingModel(
            IPUTrainingModule(model, fp8_ops), options=self.options, optimizer=optimizer
        )

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.executor(inputs, labels)

    def update_optimizer(self) -> None:
        """Send changed learning rates (or other hyperparameters) to the device."""
        self.executor.setOptimizer(self.optimizer)

    def copy_weights_to_host(self) -> None:
        self.executor.copyWeightsToHost()

    def destroy(self) -> None:
        """Release the device and take the pipeline annotations off the model."""
        import poptorch

        self.executor.destroy()
        poptorch.removeBlocks(self.model)


class IPUInferenceModule(nn.Module):
    """The model in eval mode, traced under ``ipu_tracing()`` when PopTorch traces it."""

    def __init__(self, model: nn.Module, fp8_ops: Optional[FP8CustomOps] = None):
        super().__init__()
        self.model = model
        self.fp8_ops = fp8_ops

    def forward(self, *inputs: torch.Tensor) -> Any:
        import poptorch

        with _poptorch_forms(self.fp8_ops, poptorch.isRunningOnIpu()):
            return self.model(*inputs)


class IPUInferenceModel:
    """A ``poptorch.inferenceModel`` for evaluation and sampling.

    A multi-IPU split runs as ``ShardedExecution`` (see :func:`.options.option_calls`), so a
    call takes ``rows_per_call`` rows: one micro-batch per replica and device iteration, and no
    gradient accumulation, which PopTorch refuses for inference. PopTorch compiles for the
    input shapes of the first call and refuses others; a call with new shapes compiles again.
    """

    def __init__(self, model: nn.Module, config: Config, use_ipu_model: bool):
        import poptorch

        self.model = model
        self.stages = stages(model, config)
        self.compile_options = check_config_compiles(config, self.stages, training=False,
                                                     use_ipu_model=use_ipu_model)
        self.rows_per_call = self.compile_options.rows_per_call
        if config.ipu.ipus_per_replica > 1:
            annotate_pipeline(model, self.stages, poptorch)
        if config.precision.dtype == "fp8":
            load_custom_op_library()
        model.eval()
        self.options = build_options(config, use_ipu_model, inference=True)
        self.executor: Any = None
        self._signature: Optional[Tuple[Any, ...]] = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        import poptorch

        check_inputs(self.compile_options, inputs)
        signature = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                          for x in inputs)
        if self.executor is None or signature != self._signature:
            if self.executor is not None:
                self.executor.destroy()
            self.executor = poptorch.inferenceModel(
                IPUInferenceModule(self.model, PopTorchFP8CustomOps()), options=self.options)
            self._signature = signature
        return self.executor(*inputs)

    def destroy(self) -> None:
        import poptorch

        if self.executor is not None:
            self.executor.destroy()
        poptorch.removeBlocks(self.model)
