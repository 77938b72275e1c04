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

from . import _device_optimizer, _impl, _optimizer_state, _outputs, enums
from ._args import Args, ArgsParser, down_cast
from ._compile import CompiledGraph, compile_graph
from ._numerics import HalfKernels
from .options import Options, PipelinedExecution, ShardedExecution
from .poptorch_core import _validateOptions

__all__ = ["PoplarExecutor", "NO_EXECUTABLE_ERR"]

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."


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
        self._tensor_names: Optional[_outputs.TensorNames] = None
        self._recorder: Optional[_outputs.AnchorRecorder] = None
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
        try:
            return getattr(self._user_model, name)
        except AttributeError as error:
            if f"'{name}'" not in str(error):  # raised inside one of the model's properties
                raise
            # Lookups fall through to the user's model: name the wrapper, not only the model.
            raise AttributeError(
                f"'PoplarExecutor' object has no attribute '{name}' (nor has the model it "
                f"wraps, a '{type(self._user_model).__name__}')") from None

    def __repr__(self) -> str:
        from . import module_repr

        return module_repr(self._user_model)

    def getTensorNames(self) -> List[str]:
        """The names of the compiled graph's tensors, which ``Options.anchorTensor`` takes."""
        assert self._tensor_names is not None, (
            "Model must be compiled before calling getTensorNames")
        return self._tensor_names.all()

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """An anchored tensor's value from the last call, by output mode (:mod:`._outputs`)."""
        assert short_name in self._anchor_memory, f"No tensor with name {short_name} found."
        return self._anchor_memory[short_name]

    @property
    def _executable(self) -> Optional[CompiledGraph]:
        """What PopTorch keeps of a compiled model (here the compiled graph): None until the
        model compiles and after ``destroy``; integrations (Lightning's IPU strategy) read it
        to tell a compiled model."""
        return self._graph

    def isCompiled(self) -> bool:
        return self._executable is not None

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
        example = [down_cast(self._narrow(t).detach()) for t in inputs.tensors()]
        with _impl.compile_hooks():
            self._graph = compile_graph(self._model, template, example, self._options,
                                        self._training)
        # The device's copies are plain tensors: the host's wrapped classes (see
        # `_impl.wrap_trained_model`) would make every op's output an alias of a fresh subclass
        # tensor, which autograd forbids writing in place after a custom Function.
        with torch._C.DisableTorchFunctionSubclass():
            self._device_parameters = [
                p.detach().clone().requires_grad_(p.requires_grad)
                for p in self._graph.parameters]
            self._device_buffers = [b.detach().clone() for b in self._graph.buffers]
        self._tensor_names = _outputs.tensor_names(
            self._graph, len(example), self._optimizer if self._training else None,
            self._options.anchored_tensors, bool(self._options._Popart.options.get(
                "automaticLossScalingSettings.enabled")))
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
        tensors = [down_cast(t.detach())
                   for t in inputs.tensors_like(self._executable_inputs)]
        parts = self._micro_batches()
        # Single views (not chunk's multiple ones): the graph may write into an input in
        # place, also where autograd records it, and the write reaches the caller's tensor.
        chunks = [[t.narrow(0, i * (t.shape[0] // parts), t.shape[0] // parts)
                   for i in range(parts)] if t.dim() else [t] * parts for t in tensors]
        micro = [[c[i] for c in chunks] for i in range(parts)]
        anchors = self._options.anchored_tensors
        assert self._tensor_names is not None
        self._recorder = _outputs.AnchorRecorder(self._tensor_names, anchors) if anchors else None
        outputs = self._train(micro) if self._training else self._infer(micro)
        if self._training:
            self._dirty_host_weights = True
        if self._recorder is not None:
            self._anchor_memory.update(self._recorder.results(self._options))
            self._recorder = None
        return self._select(outputs)

    def _run(self, batch: List[torch.Tensor]) -> Any:
        """The graph on one micro-batch, recording the anchored tensors."""
        assert self._graph is not None
        recorder = self._recorder
        if recorder is None:
            return self._graph(self._device_parameters, self._device_buffers, *batch)
        captured: Dict[str, torch.Tensor] = {}
        if recorder.nodes:
            out, captured = self._graph.capturing(recorder.nodes, self._device_parameters,
                                                  self._device_buffers, *batch)
        else:
            out = self._graph(self._device_parameters, self._device_buffers, *batch)
        recorder.micro_batch(batch, self._device_parameters, captured)
        return out

    def _gradients(self) -> Dict[str, torch.Tensor]:
        return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in self._named_device_parameters().items() if p.requires_grad}

    def _record_step(self) -> None:
        if self._recorder is not None:
            named = self._named_device_parameters()
            device_names = {id(p): n for n, p in named.items()}
            self._recorder.step(named, self._device_optimizer, device_names)

    def _half_kernels(self, micro: List[List[torch.Tensor]]) -> Any:
        tensors = [*self._device_parameters, *(t for batch in micro for t in batch)]
        return HalfKernels() if HalfKernels.needed(tensors) else contextlib.nullcontext()

    def _infer(self, micro: List[List[torch.Tensor]]) -> List[Any]:
        assert self._graph is not None
        with torch.no_grad(), self._half_kernels(micro):
            return [self._run(batch) for batch in micro]

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
        recorder = self._recorder
        als = optimizer.auto_loss_scale() if optimizer is not None else None
        outputs = []
        for step in range(self._options.device_iterations):
            for parameter in parameters:
                parameter.grad = None
            loss_scale = optimizer.final_loss_scale() if optimizer is not None else 1.0
            for batch in micro[step * per_step:(step + 1) * per_step]:
                before = self._gradients() if recorder and recorder.wants_gradients() else None
                # The graph runs on copies: an in-place write into an input stays out of the
                # other micro-batches' autograd, and is copied back to the caller's tensor.
                own = [t.clone() for t in batch]
                out, loss = self._run(own)
                with torch.no_grad():
                    for tensor, written in zip(batch, own):
                        tensor.copy_(written)
                if loss.requires_grad:
                    total = loss if loss.dim() == 0 else loss.sum()
                    backward = (total.float() * (scale * loss_scale)).backward
                    if als is not None:
                        als.backward(parameters, backward)
                    else:
                        backward()
                if recorder is not None and before is not None:
                    # This micro-batch's gradient, loss-scaled as PopART's gradients are.
                    recorder.gradients({n: (g - before[n]) / scale
                                        for n, g in self._gradients().items()})
                outputs.append(out)
            if optimizer is not None:
                type(optimizer).step(optimizer)
            self._record_step()  # (before the loss scale's update: the scale this step used)
            if als is not None:
                als.update()
        return [[t.detach() for t in out] for out in outputs]

    def _select(self, outputs: List[Any]) -> Any:
        assert self._graph is not None
        chosen = _outputs.choose_outputs(outputs, self._options)
        if chosen is None:
            return None
        chosen = [_outputs.ipu_dtype(t) for t in chosen]
        for tensor in chosen:
            if isinstance(tensor, torch.Tensor):
                tensor.backward = _outputs.no_backward  # type: ignore[method-assign]
        return self._graph.rebuild(chosen)

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
        self._tensor_names = None
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
