"""``poptorch.PoplarExecutor``: what ``trainingModel`` and ``inferenceModel`` return.

The executor keeps the device's copy of the model's parameters and buffers (PopTorch's
weights on the IPU): made when the model compiles, trained by each call, and copied back into
the user's model when PopTorch would (``copyWeightsToHost``, implicitly before the trained
model's parameters, buffers or ``forward`` are read, on ``detachFromDevice`` and
``destroy``). A call takes ``deviceIterations x replicationFactor x gradientAccumulation``
micro-batches on the leading dimension of every input (PopART's order: device iteration,
then accumulation, then replica), runs one optimizer step per device iteration on gradients
reduced over accumulation and replicas (mean or sum:
``accumulationAndReplicationReductionType``) and returns what the output mode asks for: All
(every micro-batch, concatenated; scalars stacked), Final (the last iteration's), Sum (summed
over iterations), EveryN (every N-th iteration's). Defaults: Final for training, All for inference.
"""
from __future__ import annotations

import contextlib
import datetime
import time
import types
from typing import Any, Dict, List, Optional

import torch

from . import _device_optimizer, _impl, _optimizer_state, enums
from ._args import Args, ArgsParser
from ._compile import CompiledGraph, compile_graph
from ._numerics import HalfKernels
from .options import Options, PipelinedExecution, ShardedExecution
from .poptorch_core import _validateOptions

__all__ = ["PoplarExecutor", "NO_EXECUTABLE_ERR"]

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."


def _join(values: List[Any]) -> Any:
    first = values[0]
    if len(values) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.stack(values) if first.dim() == 0 else torch.cat(values)
    return first


def _sum(values: List[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        total = values[0].clone()
        for value in values[1:]:
            total = total + value
        return total.to(first.dtype)
    return first


def _combine(outputs: List[Any], how: Any) -> Any:
    """Combine each leaf of the per-micro-batch output structures with ``how``."""
    first = outputs[0]
    if isinstance(first, torch.Tensor) or first is None:
        return how(outputs) if first is not None else None
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_combine(list(p), how) for p in zip(*outputs)))
    if isinstance(first, (tuple, list)):
        return type(first)(_combine(list(p), how) for p in zip(*outputs))
    if isinstance(first, dict):
        joined = type(first)() if type(first) is not dict else {}
        for key in first:
            joined[key] = _combine([o[key] for o in outputs], how)
        return joined
    return first


class PoplarExecutor:
    """A PopTorch model: compiled on its first call (or :meth:`compile`), then run."""

    def __init__(self, model: torch.nn.Module, options: Optional[Options], training: bool,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 user_model: Optional[torch.nn.Module] = None):
        if options is not None:
            if not isinstance(options, Options):
                raise _impl.createPoptorchError(
                    f"Invalid type: 'options' is of type {type(options)} "
                    "(Expected poptorch.Options)")
            options._freeze()
            options = options.clone()
        else:
            options = Options()
        self._user_model = user_model or model
        self._model = model
        self._training = training
        if training:
            if options.defaultOutputMode():
                options.outputMode(enums.OutputMode.Final)
            if not optimizer:
                from . import optim

                optimizer = optim.SGD(self._user_model.parameters(), lr=0.01)
        else:
            if options.defaultOutputMode():
                options.outputMode(enums.OutputMode.All)
            if options.Training.gradient_accumulation != 1:
                message = ("You must set poptorch.Options().Training.gradientAccumulation to 1 "
                           "or leave it as its default value (1) when running a "
                           "poptorch.inferenceModel().")
                strategy = options._execution_strategy
                if isinstance(strategy, PipelinedExecution) and not isinstance(
                        strategy, ShardedExecution):
                    message += (" Use poptorch.Options().deviceIterations to process a "
                                "sufficient number of batches each run for pipelined "
                                "execution instead.")
                raise _impl.createPoptorchError(message)
            assert not optimizer, "Optimizer should be None for inference"
        self._options = options
        self._options._freeze()
        self._args_parser = ArgsParser(model)
        self._optimizer = optimizer
        self._device_optimizer: Optional[torch.optim.Optimizer] = None
        self._graph: Optional[CompiledGraph] = None
        self._device_parameters: List[torch.Tensor] = []
        self._device_buffers: List[torch.Tensor] = []
        self._executable_inputs: Optional[Args] = None
        self._is_attached = False
        self._dirty_host_weights = False
        self._host_weights_version = 0
        self._anchor_memory: Dict[str, torch.Tensor] = {}
        self._compilation_time = datetime.timedelta(0)
        self.per_replica_params: Dict[str, Any] = {}
        if training:
            assert optimizer is not None
            self.setOptimizer(optimizer)
            self._wrap()

    def _wrap(self) -> None:
        if not _impl.isWrapped(self._user_model):
            _impl.wrap_trained_model(self._user_model, self.copyWeightsToHostIfNeeded,
                                     lambda: self._host_weights_version, self.destroy)

    # ------------------------------------------------------------------ attributes
    @property
    def model(self) -> torch.nn.Module:
        return self._user_model

    @property
    def options(self) -> Options:
        return self._options

    @property
    def training(self) -> bool:
        return self._training

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_user_model", "_model"):
            raise AttributeError(name)
        return getattr(self._user_model, name)

    def __repr__(self) -> str:
        from . import module_repr

        return module_repr(self._user_model)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        assert short_name in self._anchor_memory, f"No tensor with name {short_name} found."
        return self._anchor_memory[short_name]

    def isCompiled(self) -> bool:
        return self._graph is not None

    def isAttachedToDevice(self) -> bool:
        return self.isCompiled() and self._is_attached

    def _require_compiled(self) -> None:
        if not self.isCompiled():
            raise _impl.createPoptorchError(NO_EXECUTABLE_ERR)

    # ------------------------------------------------------------------ weights
    def _pairs(self) -> List[Any]:
        """(host tensor, device tensor) for every parameter and buffer of the graph."""
        assert self._graph is not None
        return list(zip(self._graph.parameters + self._graph.buffers,
                        self._device_parameters + self._device_buffers))

    def copyWeightsToHostIfNeeded(self) -> bool:
        if self._dirty_host_weights:
            self.copyWeightsToHost()
            return True
        return False

    def copyWeightsToHost(self) -> None:
        """Copy the device's weights and buffers into the user's model."""
        self._require_compiled()
        self._dirty_host_weights = False
        with torch.no_grad():
            for host, device in self._pairs():
                if host.shape == device.shape and host.dtype == device.dtype:
                    host.copy_(device)
                else:
                    host.data = device.detach().clone()
        self._host_weights_version += 1

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model's weights and buffers to the device."""
        self._require_compiled()
        self._dirty_host_weights = False
        with torch.no_grad():
            for host, device in self._pairs():
                device.copy_(host)

    def copyNamedBuffersToDevice(self) -> None:
        self._require_compiled()
        names = self._options._Popart.options.get("updatableNamedBuffers")
        if not names:
            raise _impl.createPoptorchError(
                "No named buffers marked as updatable via updatableNamedBuffers option")
        assert self._graph is not None
        prefix = "model."
        device = {n[len(prefix):]: d for n, d in zip(self._graph.trace.buffer_names,
                                                     self._device_buffers)}
        host = dict(self._model.named_buffers())
        with torch.no_grad():
            for name in names:
                device[name].copy_(host[name])

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:
        out = self._user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return out

    # ------------------------------------------------------------------ optimizer
    def _map_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` as the device runs it (:func:`._device_optimizer.to_ipu_optimizer`),
        over the device copy's parameters; the state of the previous device optimizer carries
        over."""

        assert self._graph is not None
        mapping = {id(h): d for h, d in zip(self._graph.parameters, self._device_parameters)}
        device = _device_optimizer.to_ipu_optimizer(optimizer, previous=self._device_optimizer,
                                                    popart_options=self._options._Popart.options)
        for group in device.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        return device

    def _apply_optimizer_options(self, optimizer: Any) -> None:
        """PopTorch's reduction strategy for a float16 accumulator (Running), set while the
        model is not compiled and refused afterwards."""

        if optimizer is None or not _device_optimizer.requires_running_mean_reduction(optimizer):
            return
        running = enums.MeanReductionStrategy.Running
        training = self._options.Training
        if not self.isCompiled():
            self._options._unfreeze()
            training.setMeanAccumulationAndReplicationReductionStrategy(running)
            self._options._freeze()
        elif training.meanAccumulationAndReplicationReductionStrategy != running:
            raise ValueError(
                "Invalid optimizer: the new optimizer would require changing options.Training."
                "meanAccumulationAndReplicationReductionStrategy to "
                "poptorch.MeanReductionStrategy.Running but the executable is already compiled.")

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Set the optimizer (a new one, or the same one with changed hyperparameters): it
        reaches the device now; later changes to it only through another ``setOptimizer``."""
        from . import optim

        _device_optimizer.check_ipu_optimizer(optimizer)
        self._apply_optimizer_options(optimizer)
        previous = self._optimizer
        if previous is not None and previous is not optimizer and isinstance(
                previous, optim.Optimizer) and self.isCompiled():
            # The old optimizer keeps the device state it had, and stops reading it; a new
            # one's own state (a checkpoint's) is written to the device.
            self._read_optimizer_state(previous)
            previous.__dict__.pop("state_dict", None)
            if isinstance(optimizer, optim.Optimizer):
                optimizer.ipu_state_is_dirty = True
        self._optimizer = optimizer
        if isinstance(optimizer, optim.Optimizer):
            optimizer.state_dict = types.MethodType(  # type: ignore[method-assign]
                lambda opt: self._read_optimizer_state(opt), optimizer)
        if self._device_optimizer is not None:
            self._device_optimizer = self._map_optimizer(optimizer)
            self._write_optimizer_state(optimizer)

    def _named_device_parameters(self) -> Dict[str, torch.Tensor]:
        assert self._graph is not None
        prefix = "model."
        return {n[len(prefix):] if n.startswith(prefix) else n: p
                for n, p in zip(self._graph.trace.parameter_names, self._device_parameters)}

    def _read_optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        """``optimizer.state_dict()`` once compiled: the device's state if it ran since."""
        _optimizer_state.state_to_host(optimizer, self._device_optimizer,
                                       self._named_device_parameters)
        return optimizer.get_state_dict()

    def _write_optimizer_state(self, optimizer: Any, attaching: bool = False) -> None:
        (_optimizer_state.state_on_attach if attaching else _optimizer_state.state_to_device)(
            optimizer, self._device_optimizer, self._named_device_parameters)

    def _debugGetPopartIR(self) -> str:
        self._require_compiled()
        return _optimizer_state.popart_ir_json(self._device_optimizer,
                                               self._named_device_parameters())

    # ------------------------------------------------------------------ compiling
    def _micro_batches(self) -> int:
        opts = self._options
        groups = opts.replication_factor // opts.input_group_size
        return opts.device_iterations * groups * opts.Training.gradient_accumulation

    def _narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._micro_batches()
        rows = tensor.shape[0] if tensor.dim() else 1
        opts = self._options
        assert rows % parts == 0, (
            f"Invalid batch dimension: In the input {tensor.shape}, the batch dimension "
            f"({rows}) must be a multiple of Options.deviceIterations("
            f"{opts.device_iterations}) * (Options.replicationFactor("
            f"{opts.replication_factor}) / Options.inputReplicaGrouping.input_group_size("
            f"{opts.input_group_size})) * Options.Training.gradientAccumulation("
            f"{opts.Training.gradient_accumulation}) = {parts} because it is used to calculate "
            "the batch size which will be executed on the device in any given iteration. For "
            "a full explanation see the batching semantics page of the documentation.")
        return tensor if tensor.dim() == 0 else tensor.narrow(0, 0, rows // parts)

    def _compile(self, inputs: Args) -> None:
        for tensor in inputs.tensors():
            if tensor.numel() == 0:
                raise _impl.createPoptorchError(
                    "Zero-sized tensors are unsupported (Got shape "
                    f"[{', '.join(str(d) for d in tensor.shape)}])")
        _validateOptions(self._options.toDict())
        names = self._options._Popart.options.get("updatableNamedBuffers") or []
        known = dict(self._model.named_buffers())
        for name in names:
            if name not in known:
                raise _impl.createPoptorchError(
                    f"updatableNamedBuffers: the model has no buffer {name}")
        if self._training:
            self._wrap()
        started = time.time()
        self._executable_inputs = inputs
        template = inputs.map(lambda t: t)
        example = [self._narrow(t).detach() for t in inputs.tensors()]
        self._graph = compile_graph(self._model, template, example, self._options,
                                    self._training)
        self._device_parameters = [
            p.detach().clone().requires_grad_(p.requires_grad) for p in self._graph.parameters]
        self._device_buffers = [b.detach().clone() for b in self._graph.buffers]
        self._compilation_time = datetime.timedelta(seconds=time.time() - started)
        if self._training and self._optimizer is not None:
            self._device_optimizer = self._map_optimizer(self._optimizer)
            if self._options.connection_type != enums.ConnectionType.Never:
                self._write_optimizer_state(self._optimizer, attaching=True)
        self._is_attached = True

    def compile(self, *args: Any, **kwargs: Any) -> None:
        inputs = self._args_parser(args, kwargs)
        if not self.isCompiled():
            self._compile(inputs)

    # ------------------------------------------------------------------ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        assert self._options.connection_type != enums.ConnectionType.Never, (
            "Trying to run a model on an offline device (ConnectionType.Never): use "
            "model.compile(inputs) instead of model(inputs)")
        inputs = self._args_parser(args, kwargs)
        if not self.isCompiled():
            self._compile(inputs)
        if self._options._Popart.options.get("instrumentWithHardwareCycleCounter"):
            raise _impl.createPoptorchError(
                "Cycle count logging is only supported on actual IPU hardware.")
        if not self._is_attached:
            self.attachToDevice()
        if not self._training:
            sync = getattr(self._user_model, "copyWeightsToHostIfNeeded", None)
            if callable(sync):
                sync()
                version: Any = self._user_model._host_weights_version
                if version != self._host_weights_version:
                    self.copyWeightsToDevice()
                    self._host_weights_version = version
        assert self._executable_inputs is not None
        self._executable_inputs.validate(inputs)
        tensors = [t.detach() for t in inputs.tensors_like(self._executable_inputs)]
        parts = self._micro_batches()
        chunks = [list(t.chunk(parts)) if t.dim() else [t] * parts for t in tensors]
        micro = [[c[i] for c in chunks] for i in range(parts)]
        outputs = self._train(micro) if self._training else self._infer(micro)
        if self._training:
            self._dirty_host_weights = True
        return self._select(outputs)

    def _half_kernels(self, micro: List[List[torch.Tensor]]) -> Any:
        tensors = [*self._device_parameters, *(t for batch in micro for t in batch)]
        return HalfKernels() if HalfKernels.needed(tensors) else contextlib.nullcontext()

    def _infer(self, micro: List[List[torch.Tensor]]) -> List[Any]:
        assert self._graph is not None
        with torch.no_grad(), self._half_kernels(micro):
            return [self._graph(self._device_parameters, self._device_buffers, *batch)
                    for batch in micro]

    def _train(self, micro: List[List[torch.Tensor]]) -> List[Any]:
        assert self._graph is not None
        opts = self._options
        per_step = len(micro) // opts.device_iterations
        scale = 1.0  # times each step's loss scale
        if opts.Training.meanAccumulationAndReplicationReductionStrategy == (
                enums.MeanReductionStrategy.Running):
            pass  # the same mean, accumulated as a running mean on the IPU
        if opts.Training.accumulation_and_replication_reduction_type == enums.ReductionType.Mean:
            scale /= per_step
        self._write_optimizer_state(self._optimizer)
        with self._half_kernels(micro):
            outputs = self._train_steps(micro, per_step, scale)
        _optimizer_state.state_after_run(self._optimizer)
        return outputs

    def _train_steps(self, micro: List[List[torch.Tensor]], per_step: int,
                     scale: float) -> List[Any]:
        assert self._graph is not None
        optimizer: Any = self._device_optimizer
        parameters = [p for p in self._device_parameters if p.requires_grad]
        als = optimizer.auto_loss_scale() if optimizer is not None else None
        outputs, loss_scales = [], []
        for step in range(self._options.device_iterations):
            for parameter in parameters:
                parameter.grad = None
            loss_scale = optimizer.final_loss_scale() if optimizer is not None else 1.0
            loss_scales.append(loss_scale)
            for batch in micro[step * per_step:(step + 1) * per_step]:
                out, loss = self._graph(self._device_parameters, self._device_buffers, *batch)
                if loss.requires_grad:
                    total = loss if loss.dim() == 0 else loss.sum()
                    backward = (total.float() * (scale * loss_scale)).backward
                    if als is not None:
                        als.backward(parameters, backward)
                    else:
                        backward()
                outputs.append(out)
            if optimizer is not None:
                type(optimizer).step(optimizer)
            if als is not None:
                als.update()
        if als is not None:
            self._anchor_memory.update(
                _optimizer_state.loss_scale_anchors(self._options, loss_scales))
        return [[t.detach() for t in out] for out in outputs]

    def _select(self, outputs: List[Any]) -> Any:
        assert self._graph is not None
        chosen = self._choose(outputs)
        if chosen is None:
            return None
        chosen = [_ipu_dtype(t) for t in chosen]
        for tensor in chosen:
            if isinstance(tensor, torch.Tensor):
                tensor.backward = _no_backward  # type: ignore[method-assign]
        return self._graph.rebuild(chosen)

    def _choose(self, outputs: List[Any]) -> Any:
        opts = self._options
        mode = enums.OutputMode(opts.output_mode)
        replicas = opts.replication_factor // opts.input_group_size
        per_iteration = len(outputs) // opts.device_iterations
        if mode == enums.OutputMode.All:
            return _combine(outputs, _join)
        if mode == enums.OutputMode.Final:
            last = outputs[-replicas:]
            return last[0] if replicas == 1 else _combine(last, _join)
        if mode == enums.OutputMode.Sum:
            by_replica = [_combine(outputs[r::replicas], _sum) for r in range(replicas)]
            return by_replica[0] if replicas == 1 else _combine(by_replica, _join)
        period = opts.output_return_period
        chosen = [o for i in range(period - 1, opts.device_iterations, period)
                  for o in outputs[i * per_iteration:(i + 1) * per_iteration]]
        return _combine(chosen, _join) if chosen else None

    # ------------------------------------------------------------------ device
    def detachFromDevice(self) -> None:
        self._require_compiled()
        if not self._is_attached:
            raise _impl.createPoptorchError("Device is not attached")
        if self._training:
            self.copyWeightsToHostIfNeeded()
            if getattr(self._optimizer, "host_state_is_dirty", False):
                self._read_optimizer_state(self._optimizer)
        self._is_attached = False

    def attachToDevice(self) -> None:
        self._require_compiled()
        assert self._options.connection_type != enums.ConnectionType.Never, (
            "Trying to attach to an offline device (ConnectionType.Never)")
        if self._is_attached:
            raise _impl.createPoptorchError("Device is already attached")
        self._is_attached = True
        self.copyWeightsToDevice()
        if self._training:
            self._write_optimizer_state(self._optimizer, attaching=True)

    def destroy(self) -> None:
        """Release the executable: the next call compiles again; a trained model's weights
        are copied back first."""
        if not self.isCompiled():
            return
        if self._training:
            self.copyWeightsToHostIfNeeded()
        self._graph = None
        self._device_parameters, self._device_buffers = [], []
        self._device_optimizer = None
        if self._training:
            _impl.unwrap_model(self._user_model)
        self._executable_inputs = None
        self._is_attached = False

    def save(self, filename: str, export_model: bool = True, save_rng_state: bool = True
             ) -> None:
        from ._saving import save_executor

        save_executor(self, filename, export_model)

    def compileAndExport(self, filename: str, *args: Any, export_model: bool = True,
                         **kwargs: Any) -> None:
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def loadExecutable(self, filename: str) -> None:
        from ._saving import read

        inputs = read(filename)["inputs"]
        if inputs is not None and not self.isCompiled():
            self._compile(inputs)

    def compilationTime(self) -> datetime.timedelta:
        """How long the last compilation took (the stand-in's trace: no Poplar compile)."""
        if not self.isCompiled():
            raise _impl.createPoptorchError(
                "Please compile the model before obtaining compilation time.")
        if not self._options._show_compilation_progress_bar:
            raise _impl.createPoptorchError(
                "Please set showCompilationProgressBar option to obtain compilation time.")
        return self._compilation_time

    def cycleCount(self) -> int:
        raise _impl.createPoptorchError(
            "Cycle count logging is disabled. Please set option logCycleCount to True to "
            "enable.") if not self._options._Popart.options.get(
                "instrumentWithHardwareCycleCounter") else _impl.createPoptorchError(
                    "Cycle counts are only available on IPU hardware")

    def getPerfCounters(self) -> Dict[str, Any]:
        return {"input": [], "input_complete": [], "output": [], "output_complete": []}


def _no_backward(*args: Any, **kwargs: Any) -> None:
    raise _impl.createPoptorchError(
        "backward() cannot be called explicitly on outputs of a PopTorch model. If you're "
        "using a trainingModel, the backwards pass is performed automatically when invoking "
        "the model. If you're using an inferenceModel, you should use a trainingModel "
        "instead.")


def _ipu_dtype(value: Any) -> Any:
    """An output as the IPU returns it: no 64-bit types (int64 as int32, float64 as float32)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.int64:
            return value.to(torch.int32)
        if value.dtype == torch.float64:
            return value.to(torch.float32)
    return value
