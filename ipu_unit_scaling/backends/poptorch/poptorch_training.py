"""``poptorch.trainingModel`` built from a config: options, pipeline annotation, optimizer.

Every function takes the ``poptorch`` module to run against (the SDK's, or the stand-in for
the ``emulator`` backend: :mod:`ipu_unit_scaling.backends.poptorch_backend` chooses) and uses
only PopTorch's public API; none imports it, so this module imports anywhere.
"""
from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from ...ops.trace_switch import FP8CustomOps, ipu_tracing
from ...training.run_config import IPUConfig, TrainingConfig
from ..cpu import TrainingModule
from ..pipeline_stages import Stage, ipu_stages
from . import poptorch_by_name
from .compile_checks import PopTorchError, check_config_compiles, check_inputs
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


def _run(executor: Any, poptorch: ModuleType, compiled: bool, *inputs: Any) -> Any:
    """Call ``executor`` (``compiled``: it has compiled before); what PopTorch refuses while
    compiling (its ``poptorch.Error``: an op it cannot trace, a loss rule, a pipeline check) is
    a :class:`PopTorchError`, which the command line reports in one line."""
    if compiled:
        return executor(*inputs)
    try:
        return executor(*inputs)
    except poptorch.Error as error:
        raise PopTorchError(f"PopTorch refused the model while compiling it: {error}") \
            from error


class IPUTrainingModule(TrainingModule):
    """``(output, loss)`` with the loss marked for PopTorch's autograd.

    While PopTorch traces it for the IPU (``poptorch.isRunningOnIpu()``), the model runs inside
    ``ipu_tracing()``: unit scaling's backward scales are then part of the forward graph that
    PopART differentiates, and FP8 casts are the PopART custom ops.
    """

    def __init__(self, model: nn.Module, fp8_ops: Optional[FP8CustomOps] = None,
                 poptorch: str = "poptorch"):
        super().__init__(model)
        self.fp8_ops = fp8_ops
        self.poptorch_name = poptorch  # a name: PopTorch deep-copies this module

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        poptorch = poptorch_by_name(self.poptorch_name)
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


def make_ipu_optimizer(parameters: Any, training: TrainingConfig, poptorch: ModuleType
                       ) -> torch.optim.Optimizer:
    """The PopTorch optimizer ``training`` names (gradient clipping runs on the IPU).

    ``parameters`` may be parameter groups, each with its own ``lr`` and ``weight_decay`` (u-μP's,
    from :func:`ipu_unit_scaling.parametrization.mup_optimizers.param_groups`): PopTorch takes
    per-group values as
    torch does, and sends the groups' changed learning rates to the device on ``setOptimizer``.
    The groups' ``lr_scale`` key is for the host's schedule; PopTorch ignores keys it does not
    use.
    """
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


def _fp8_ops(fp8: bool, poptorch: ModuleType, needs_library: bool) -> PopTorchFP8CustomOps:
    """The custom ops through ``poptorch.custom_op``; where PopART ``needs_library``, it is
    loaded now for an ``fp8`` model (a missing one fails here, not mid-compilation)."""
    if fp8 and needs_library:
        load_custom_op_library()
    return PopTorchFP8CustomOps(poptorch=poptorch.__name__, needs_library=needs_library)


class IPUTrainingModel:
    """A compiled-on-first-call ``poptorch.trainingModel`` with the fallback's interface.

    Built from the config's ``ipu`` section; ``fp8``: whether the model casts to FP8 (its
    custom ops then need PopART's library). ``poptorch`` is the module to run against;
    ``needs_library``: whether PopART needs ``custom_ops/``'s library for the custom ops (not
    on the stand-in). A step calls PopTorch once, and ``setOptimizer`` when the learning rates
    change.
    """

    def __init__(self, model: nn.Module, optimizer: Any, ipu: IPUConfig, *, fp8: bool,
                 use_ipu_model: bool, poptorch: ModuleType, needs_library: bool = True):
        self.poptorch = poptorch
        self._compiled = False
        self.model = model
        self.stages = ipu_stages(model, ipu)
        # PopTorch's own compile checks, before an IPU is asked for.
        check_config_compiles(ipu, self.stages, training=True, use_ipu_model=use_ipu_model)
        if ipu.ipus_per_replica > 1:
            annotate_pipeline(model, self.stages, poptorch)
        self.options = build_options(ipu, use_ipu_model, poptorch=poptorch)
        self.optimizer = optimizer
        module = IPUTrainingModule(model, _fp8_ops(fp8, poptorch, needs_library),
                                   poptorch.__name__)
        self.executor = poptorch.trainingModel(module, options=self.options,
                                               optimizer=optimizer)

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Any:
        out = _run(self.executor, self.poptorch, self._compiled, inputs, labels)
        self._compiled = True
        return out

    def update_optimizer(self) -> None:
        """Send changed learning rates (or other hyperparameters) to the device."""
        self.executor.setOptimizer(self.optimizer)

    def copy_weights_to_host(self) -> None:
        self.executor.copyWeightsToHost()

    def destroy(self) -> None:
        """Release the device and take the pipeline annotations off the model."""
        self.executor.destroy()
        self.poptorch.removeBlocks(self.model)


class IPUInferenceModule(nn.Module):
    """The model in eval mode, traced under ``ipu_tracing()`` when PopTorch traces it."""

    def __init__(self, model: nn.Module, fp8_ops: Optional[FP8CustomOps] = None,
                 poptorch: str = "poptorch"):
        super().__init__()
        self.model = model
        self.fp8_ops = fp8_ops
        self.poptorch_name = poptorch  # as in IPUTrainingModule

    def forward(self, *inputs: torch.Tensor) -> Any:
        poptorch = poptorch_by_name(self.poptorch_name)
        with _poptorch_forms(self.fp8_ops, poptorch.isRunningOnIpu()):
            return self.model(*inputs)


class IPUInferenceModel:
    """A ``poptorch.inferenceModel`` for evaluation and sampling.

    A multi-IPU split runs as ``ShardedExecution`` (see :func:`.poptorch_options.option_calls`), so
    a call takes ``rows_per_call`` rows: one micro-batch per replica and device iteration, and no
    gradient accumulation, which PopTorch refuses for inference. PopTorch compiles for the
    input shapes of the first call and refuses others; a call with new shapes compiles again.
    """

    def __init__(self, model: nn.Module, ipu: IPUConfig, *, fp8: bool, use_ipu_model: bool,
                 poptorch: ModuleType, needs_library: bool = True):
        self.poptorch = poptorch
        self.model = model
        self.stages = ipu_stages(model, ipu)
        self.compile_options = check_config_compiles(ipu, self.stages, training=False,
                                                     use_ipu_model=use_ipu_model)
        self.rows_per_call = self.compile_options.rows_per_call
        if ipu.ipus_per_replica > 1:
            annotate_pipeline(model, self.stages, poptorch)
        self.fp8_ops = _fp8_ops(fp8, poptorch, needs_library)
        model.eval()
        self.options = build_options(ipu, use_ipu_model, inference=True, poptorch=poptorch)
        self.executor: Any = None
        self._signature: Optional[Tuple[Any, ...]] = None
        self._compiled = False

    def __call__(self, *inputs: torch.Tensor) -> Any:
        poptorch = self.poptorch
        check_inputs(self.compile_options, inputs)
        signature = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                          for x in inputs)
        if self.executor is None or signature != self._signature:
            if self.executor is not None:
                self.executor.destroy()
            self.executor = poptorch.inferenceModel(
                IPUInferenceModule(self.model, self.fp8_ops, poptorch.__name__),
                options=self.options)
            self._signature = signature
            self._compiled = False
        compiled, self._compiled = self._compiled, True
        return _run(self.executor, poptorch, compiled, *inputs)

    def destroy(self) -> None:
        if self.executor is not None:
            self.executor.destroy()
        self.poptorch.removeBlocks(self.model)
