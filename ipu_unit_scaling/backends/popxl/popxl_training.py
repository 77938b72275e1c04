"""The PopXL training step and the training model with ``poptorch.trainingModel``'s interface.

One ``session.run`` is one training-model call: for each of ``device_iterations`` optimizer
steps, every micro-batch is loaded from the host, run forward and backward, and its gradients
averaged into accumulators (PopTorch's ``ReductionType.Mean``); then the optimizer updates the
weights on the device. The loop is unrolled into the main graph, so ``ir.num_host_transfers``
is ``device_iterations x micro-batches``; the graphs of the model are shared by every call.
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ...fp8.fp8_config import FP8Config
from ...fp8.scaling import NonFiniteAmaxError
from ...models.gpt import GPTConfig
from ...training.config_files import ConfigError
from ...training.run_config import Config, IPUConfig, PrecisionConfig, TrainingConfig
from .fp8_ops import AMAX_SOURCES, CastSite
from .popxl_model import DecoderSpec, PopXLDecoder, Tape

__all__ = ["popxl_available", "import_popxl", "OptimizerSpec", "StepResult",
           "loss_and_gradients", "TrainingProgram", "PopXLTrainingModel", "check_config",
           "check_sections"]

Tensor = Any


def import_popxl() -> Any:
    """The ``popxl`` module of the Poplar SDK; ImportError saying so where it is missing."""
    try:
        return importlib.import_module("popxl")
    except Exception as error:  # an SDK that is present but broken counts as absent
        raise ImportError(f"PopXL (the Poplar SDK's popxl) does not import here: {error}"
                          ) from error


def popxl_available() -> bool:
    try:
        import_popxl()
    except ImportError:
        return False
    return True


def default_device() -> str:
    """``"ipu_hw"`` where PopART sees IPUs, else the IPU Model."""
    try:
        popart = importlib.import_module("popart")
        if popart.DeviceManager().enumerateDevices():
            return "ipu_hw"
    except Exception:
        pass
    return "ipu_model"


def check_config(config: Config) -> None:
    """ConfigError listing what the popxl backend does not build."""
    errors = _model_errors(config.model) + _section_errors(config.precision, config.ipu)
    if errors:
        raise ConfigError(errors)


def check_sections(precision: PrecisionConfig, ipu: IPUConfig) -> None:
    """ConfigError listing what the popxl backend does not build of the ``precision`` and
    ``ipu`` sections (a model it does not build, :meth:`DecoderSpec.from_module` refuses)."""
    errors = _section_errors(precision, ipu)
    if errors:
        raise ConfigError(errors)


def _model_errors(model: GPTConfig) -> List[Tuple[str, str]]:
    errors: List[Tuple[str, str]] = []
    if not model.unit_scaled:
        errors.append(("model.unit_scaled", "the popxl backend builds the unit-scaled decoder "
                                            "only; set it to true"))
    if model.dropout:
        errors.append(("model.dropout", "the popxl backend has no dropout; use 0"))
    return errors


def _section_errors(precision: PrecisionConfig, ipu: IPUConfig) -> List[Tuple[str, str]]:
    errors: List[Tuple[str, str]] = []
    dtype = precision.dtype
    if dtype not in ("fp32", "fp8"):
        errors.append(("precision.dtype", f"got {dtype!r}; the popxl backend runs fp32 or fp8"))
    fp8 = precision.fp8
    if dtype == "fp8":
        for role in ("activation", "weight", "gradient"):
            name = getattr(fp8, f"{role}_format")
            if name not in ("F143", "F152"):
                errors.append((f"precision.fp8.{role}_format",
                               f"got {name!r}; PopXL's FP8 types are F143 and F152"))
        if fp8.rounding != "nearest":
            errors.append(("precision.fp8.rounding", "the popxl backend rounds to nearest"))
        if fp8.scaling not in ("static", "amax"):
            errors.append(("precision.fp8.scaling", f"got {fp8.scaling!r}; the popxl backend "
                                                    "casts per tensor: static or amax"))
        if fp8.attention:
            errors.append(("precision.fp8.attention", "the popxl backend keeps attention in "
                                                      "fp32; set it to false"))
    if ipu.ipus_per_replica != 1:
        errors.append(("ipu.ipus_per_replica", "the popxl backend runs on one IPU (no "
                                               "pipelining); set it to 1"))
    return errors


# ----------------------------------------------------------------------------- the optimizer


@dataclass(frozen=True)
class OptimizerSpec:
    """SGD (no momentum), Adam (L2 weight decay) or AdamW, with torch's update rules."""

    kind: str
    learning_rate: float
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def from_training(cls, training: TrainingConfig) -> OptimizerSpec:
        return cls(training.optimizer, training.learning_rate, training.weight_decay)

    @classmethod
    def from_torch(cls, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
        """The hyperparameters of a torch SGD, Adam or AdamW (the same for every group)."""
        kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
        kind = kinds.get(type(optimizer))
        if kind is None:
            raise ValueError(f"the popxl backend runs SGD, Adam and AdamW, not "
                             f"{type(optimizer).__name__}")
        group = optimizer.param_groups[0]
        keys = ("lr", "weight_decay", "betas", "eps", "momentum", "amsgrad", "maximize",
                "nesterov")
        for other in optimizer.param_groups[1:]:
            if any(other.get(k) != group.get(k) for k in keys):
                raise ValueError("the popxl backend needs one set of hyperparameters for all "
                                 "parameter groups")
        for flag in ("amsgrad", "maximize", "nesterov"):
            if group.get(flag):
                raise ValueError(f"the popxl backend does not implement {flag}")
        if group.get("momentum", 0.0):
            raise ValueError("the popxl backend implements SGD without momentum")
        if kind == "sgd":
            return cls(kind, float(group["lr"]), float(group["weight_decay"]))
        betas = tuple(float(b) for b in group["betas"])
        return cls(kind, float(group["lr"]), float(group["weight_decay"]),
                   (betas[0], betas[1]), float(group["eps"]))


# ---------------------------------------------------------------------------- building blocks


def _forward_backward(xl: Any, decoder: PopXLDecoder, ids: Tensor, labels: Tensor,
                      params: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Dict[str, Tensor],
                                                          Tensor, Tape]:
    """One micro-batch: ``(logits, loss, gradients by name, non-finite count, tape)``."""
    tape = Tape()
    logits, loss = decoder.forward(tape, ids, labels, params)
    grads = tape.backward({loss: xl.constant(1.0, xl.float32)})
    flags = xl.constant(0, xl.int32)
    for flag in tape.flags:
        flags = flags + flag
    return logits, loss, {name: grads[p] for name, p in params.items()}, flags, tape


def _weights(model: nn.Module, names: List[str]) -> Dict[str, np.ndarray]:
    state = model.state_dict()
    return {name: state[name].detach().to(torch.float32).cpu().numpy().copy()
            for name in names}


@dataclass
class StepResult:
    """One forward and backward pass, nothing updated. ``casts`` name the FP8 casts' tensors
    (readable through ``session.values`` on the stand-in only)."""

    loss: float
    logits: torch.Tensor
    gradients: Dict[str, torch.Tensor]
    non_finite: int
    casts: List[CastSite]
    session: Any


def loss_and_gradients(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                       fp8: Optional[FP8Config] = None, xl: Any = None,
                       device: Optional[str] = None, keep_values: bool = False,
                       amax: str = "ops") -> StepResult:
    """The loss, logits and every parameter gradient of ``model`` (a ``uu.GPT``)
    on one batch, computed by the PopXL decoder: on ``xl`` (default: the real ``popxl``).
    ``amax``: "ops" or "codelets" (see :class:`~.popxl_model.PopXLDecoder`)."""
    xl = xl if xl is not None else import_popxl()
    spec = DecoderSpec.from_module(model)
    names = spec.parameter_names()
    weights = _weights(model, names)
    ir = xl.Ir()
    batch, seq = input_ids.shape
    with ir.main_graph, xl.in_sequence(True):
        params = {name: xl.variable(weights[name], xl.float32, name) for name in names}
        ids_stream = xl.h2d_stream((batch, seq), xl.int32, "input_ids")
        labels_stream = xl.h2d_stream((batch, seq), xl.int32, "labels")
        decoder = PopXLDecoder(xl, ir, spec, fp8, amax)
        logits, loss, grads, flags, tape = _forward_backward(
            xl, decoder, xl.ops.host_load(ids_stream), xl.ops.host_load(labels_stream), params)
        outputs = {"loss": loss, "logits": logits, "non_finite": flags}
        outputs.update({f"grad_{name}": grads[name] for name in names})
        streams = {}
        for key, tensor in outputs.items():
            streams[key] = xl.d2h_stream(tensor.shape, tensor.dtype, key)
            xl.ops.host_store(streams[key], tensor)
    session = xl.Session(ir, device or default_device())
    if keep_values:
        session.keep_values = True
    with session:
        results = session.run({ids_stream: input_ids.numpy().astype(np.int32),
                               labels_stream: labels.numpy().astype(np.int32)})
    return StepResult(
        loss=float(results[streams["loss"]]),
        logits=torch.from_numpy(np.array(results[streams["logits"]])),
        gradients={name: torch.from_numpy(np.array(results[streams[f"grad_{name}"]]))
                   for name in names},
        non_finite=int(results[streams["non_finite"]]),
        casts=tape.casts,
        session=session,
    )


# ------------------------------------------------------------------------------ the program


class TrainingProgram:
    """The IR and session of one training-model call shape (see the module docstring)."""

    def __init__(self, xl: Any, model: nn.Module, fp8: Optional[FP8Config],
                 optimizer: OptimizerSpec, micro_batch: int, seq: int, micro_batches: int,
                 device_iterations: int, max_grad_norm: Optional[float], device: str,
                 optimizer_state: Optional[torch.optim.Optimizer] = None, amax: str = "ops"):
        self.xl = xl
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.spec = DecoderSpec.from_module(model)
        self.names = self.spec.parameter_names()
        self.shape = (micro_batch, seq)
        self.transfers = micro_batches * device_iterations
        self._streams: Dict[str, Any] = {}
        weights = _weights(model, self.names)
        moments = _adam_state(model, self.names, optimizer_state)
        ir = self.ir = xl.Ir()
        ir.num_host_transfers = self.transfers
        with ir.main_graph, xl.in_sequence(True):
            self.params = {n: xl.variable(weights[n], xl.float32, n) for n in self.names}
            self.learning_rate = xl.variable(np.array(optimizer.learning_rate, np.float32),
                                             xl.float32, "learning_rate")
            self.moments: Dict[str, Tuple[Tensor, Tensor]] = {}
            self.step = None
            if optimizer.kind != "sgd":
                self.step = xl.variable(np.array(moments[2], np.float32), xl.float32, "step")
                self.moments = {n: (xl.variable(moments[0][n], xl.float32, n + ".exp_avg"),
                                    xl.variable(moments[1][n], xl.float32, n + ".exp_avg_sq"))
                                for n in self.names}
            accumulators = {}
            if micro_batches > 1:
                accumulators = {n: xl.variable(np.zeros_like(weights[n]), xl.float32,
                                               n + ".grad") for n in self.names}
            self.ids = xl.h2d_stream(self.shape, xl.int32, "input_ids")
            self.labels = xl.h2d_stream(self.shape, xl.int32, "labels")
            decoder = PopXLDecoder(xl, ir, self.spec, fp8, amax)
            for _ in range(device_iterations):
                grads: Dict[str, Tensor] = {}
                for micro in range(micro_batches):
                    logits, loss, micro_grads, flags, _ = _forward_backward(
                        xl, decoder, xl.ops.host_load(self.ids),
                        xl.ops.host_load(self.labels), self.params)
                    self._store("loss", loss)
                    self._store("logits", logits)
                    self._store("non_finite", flags)
                    if micro_batches == 1:
                        grads = micro_grads
                        continue
                    for n, g in micro_grads.items():  # the mean over micro-batches
                        if micro == 0:
                            xl.ops.var_updates.copy_var_update_(accumulators[n],
                                                                g * (1.0 / micro_batches))
                        else:
                            xl.ops.var_updates.accumulate_(accumulators[n], g,
                                                           1.0 / micro_batches)
                        grads[n] = accumulators[n]
                self._update(grads)
        self.session = xl.Session(ir, device)
        self.session.__enter__()

    def _store(self, key: str, tensor: Tensor) -> None:
        if key not in self._streams:
            self._streams[key] = self.xl.d2h_stream(tensor.shape, tensor.dtype, key)
        self.xl.ops.host_store(self._streams[key], tensor)

    def _update(self, grads: Dict[str, Tensor]) -> None:
        """One optimizer step on the device, with torch's update rules."""
        xl, opt = self.xl, self.optimizer
        ops = xl.ops
        if self.max_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_
            total = None
            for g in grads.values():
                square = ops.sum(g * g)
                total = square if total is None else total + square
            coef = ops.clip(self.max_grad_norm / (ops.sqrt(total) + 1e-6), max=1.0)
            grads = {n: g * coef for n, g in grads.items()}
        lr = self.learning_rate
        corrections = None
        if self.step is not None:
            step = ops.var_updates.copy_var_update_(self.step, self.step + 1.0)
            beta1, beta2 = opt.betas
            corrections = (1.0 - ops.pow(xl.constant(beta1, xl.float32), step),
                           ops.sqrt(1.0 - ops.pow(xl.constant(beta2, xl.float32), step)))
        for name, param in self.params.items():
            g = grads[name]
            value = param
            if opt.weight_decay and opt.kind in ("sgd", "adam"):
                g = g + param * opt.weight_decay
            elif opt.weight_decay:  # AdamW decays the weight itself
                value = param * (1.0 - lr * opt.weight_decay)
            if corrections is None:
                new = value - lr * g
            else:
                beta1, beta2 = opt.betas
                exp_avg, exp_avg_sq = self.moments[name]
                new_avg = exp_avg + (g - exp_avg) * (1.0 - beta1)
                new_avg_sq = exp_avg_sq * beta2 + (g * g) * (1.0 - beta2)
                denom = ops.sqrt(new_avg_sq) / corrections[1] + opt.eps
                new = value - (lr / corrections[0]) * (new_avg / denom)
                ops.var_updates.copy_var_update_(exp_avg, new_avg)
                ops.var_updates.copy_var_update_(exp_avg_sq, new_avg_sq)
            ops.var_updates.copy_var_update_(param, new)

    def run(self, ids: np.ndarray, labels: np.ndarray) -> Tuple[np.ndarray, np.ndarray, int]:
        """``ids``, ``labels``: ``[transfers, micro_batch, seq]``. Returns per-micro-batch
        logits and losses and the number of non-finite amaxes met."""
        if self.transfers == 1:
            ids, labels = ids[0], labels[0]
        out = self.session.run({self.ids: ids.astype(np.int32),
                                self.labels: labels.astype(np.int32)})
        logits, losses, flags = (out[self._streams[k]] for k in ("logits", "loss", "non_finite"))
        shape = (self.transfers,)
        return (np.reshape(logits, shape + tuple(np.shape(logits))[-3:]),
                np.reshape(losses, shape), int(np.sum(flags)))

    def set_learning_rate(self, learning_rate: float) -> None:
        self.session.write_variable_data(self.learning_rate,
                                          np.array(learning_rate, np.float32))

    def copy_weights_to_host(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Device weights into the torch model (and Adam's moments into ``optimizer``)."""
        tensors = list(self.params.values())
        for pair in self.moments.values():
            tensors += list(pair)
        if self.step is not None:
            tensors.append(self.step)
        data = self.session.get_tensors_data(tensors)
        state = self.model.state_dict()
        with torch.no_grad():
            for name, variable in self.params.items():
                state[name].copy_(torch.from_numpy(np.array(data[variable])))
        if optimizer is None or self.step is None:
            return
        named = dict(self.model.named_parameters())
        step = torch.tensor(float(data[self.step]))
        for name, (avg, avg_sq) in self.moments.items():
            optimizer.state[named[name]] = {
                "step": step.clone(),
                "exp_avg": torch.from_numpy(np.array(data[avg])),
                "exp_avg_sq": torch.from_numpy(np.array(data[avg_sq])),
            }

    def destroy(self) -> None:
        self.session.__exit__(None, None, None)


def _adam_state(model: nn.Module, names: List[str],
                optimizer: Optional[torch.optim.Optimizer]
                ) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray], float]:
    """Adam's moments and step from a torch optimizer that has stepped (a resumed run), else
    zeros."""
    named = dict(model.named_parameters())
    avg, avg_sq, step = {}, {}, 0.0
    for name in names:
        state = optimizer.state.get(named[name], {}) if optimizer is not None else {}
        shape = tuple(named[name].shape)
        avg[name] = _numpy(state.get("exp_avg"), shape)
        avg_sq[name] = _numpy(state.get("exp_avg_sq"), shape)
        if "step" in state:
            step = float(state["step"])
    return avg, avg_sq, step


def _numpy(value: Optional[torch.Tensor], shape: Tuple[int, ...]) -> np.ndarray:
    if value is None:
        return np.zeros(shape, np.float32)
    return value.detach().to(torch.float32).cpu().numpy().copy()


# ------------------------------------------------------------------------ the training model


class PopXLTrainingModel:
    """``poptorch.trainingModel`` semantics on PopXL: ``wrapper(inputs, labels) -> (output,
    loss)`` runs ``device_iterations`` optimizer steps, each over ``gradient_accumulation x
    replication_factor`` micro-batches averaged (replicas run in turn on one IPU), and returns
    the per-micro-batch logits (concatenated) and losses. The weights stay on the device until
    :meth:`copy_weights_to_host`. Built on the first call, when the batch shape is known.

    Built from the config's sections it reads: ``training`` (the optimizer when none is given,
    and the gradient clipping), ``precision`` (fp32 or FP8, and its casts) and ``ipu`` (device
    iterations, accumulation, replicas, the stage split), each the section's defaults when
    omitted. ``optimizer``: a torch SGD / Adam / AdamW over the model's parameters (its
    learning rate is read again by :meth:`update_optimizer`, its state filled by
    :meth:`copy_weights_to_host`), or None for the one ``training`` names. ``xl``: the
    ``popxl`` module (the default) or the stand-in :mod:`ipu_standins.popxl`. ``device``:
    "ipu_hw", "ipu_model" (default: hardware where PopART sees it) or "cpu". ``amax``: where
    FP8 AMAX casts get their scale, "ops" (PopXL ops, the default) or "codelets" (the
    package's custom op; see :mod:`.codelets`).
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 training: Optional[TrainingConfig] = None,
                 precision: Optional[PrecisionConfig] = None, ipu: Optional[IPUConfig] = None,
                 xl: Any = None, device: Optional[str] = None, amax: str = "ops"):
        from ..pipeline_stages import ipu_stages

        training = training if training is not None else TrainingConfig()
        precision = precision if precision is not None else PrecisionConfig()
        ipu = ipu if ipu is not None else IPUConfig()
        check_sections(precision, ipu)
        DecoderSpec.from_module(model)  # refuse an unsupported model now, not at the first call
        self.model = model
        self.torch_optimizer = optimizer
        self.optimizer = (OptimizerSpec.from_torch(optimizer) if optimizer is not None
                          else OptimizerSpec.from_training(training))
        self.grad_clip = training.grad_clip
        self.fp8 = FP8Config(**asdict(precision.fp8)) if precision.dtype == "fp8" else None
        self.device_iterations = ipu.device_iterations
        self.micro_batches = ipu.gradient_accumulation * ipu.replication_factor
        self.stages = ipu_stages(model, ipu)
        self.xl = xl if xl is not None else import_popxl()
        self.device = device or default_device()
        if amax not in AMAX_SOURCES:
            raise ValueError(f"amax must be one of {AMAX_SOURCES}, got {amax!r}")
        self.amax = amax
        self._program: Optional[TrainingProgram] = None

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        per_call = self.device_iterations * self.micro_batches
        if inputs.dim() != 2 or inputs.shape[0] % per_call or labels.shape != inputs.shape:
            raise ValueError(
                f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} must be equal "
                f"[samples, seq] with samples a multiple of device_iterations x "
                f"gradient_accumulation x replication_factor = {per_call}")
        shape = (inputs.shape[0] // per_call, inputs.shape[1])
        if self._program is None:
            self._program = TrainingProgram(
                self.xl, self.model, self.fp8, self.optimizer, shape[0], shape[1],
                self.micro_batches, self.device_iterations, self.grad_clip,
                self.device, self.torch_optimizer, self.amax)
            self.update_optimizer()
        elif self._program.shape != shape:
            raise ValueError(f"the model was built for micro-batches of {self._program.shape}, "
                             f"got {shape}")
        logits, losses, non_finite = self._program.run(
            inputs.reshape(per_call, *shape).numpy(), labels.reshape(per_call, *shape).numpy())
        if non_finite:
            raise NonFiniteAmaxError(f"{non_finite} FP8 casts met a non-finite amax")
        return (torch.from_numpy(logits).reshape(-1, *logits.shape[2:]),
                torch.from_numpy(losses))

    def update_optimizer(self) -> None:
        """Send the torch optimizer's current learning rate to the device."""
        if self._program is not None and self.torch_optimizer is not None:
            self._program.set_learning_rate(float(self.torch_optimizer.param_groups[0]["lr"]))

    def copy_weights_to_host(self) -> None:
        if self._program is not None:
            self._program.copy_weights_to_host(self.torch_optimizer)

    def destroy(self) -> None:
        if self._program is not None:
            self._program.destroy()
            self._program = None
