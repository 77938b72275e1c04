"""Run telemetry: what the FP8 casts, the parameters and attention did, at sampled steps.

At every ``interval``-th step (:class:`~ipu_unit_scaling.training.run_health.TelemetryConfig`),
a :class:`TelemetryRecorder` records, for the training call that makes that step:

- every FP8 cast site: role, format, scaling bias, amax, RMS, flushed and saturated fractions
  and SQNR, from the casts themselves (:func:`ipu_unit_scaling.fp8.fp8_stats`). A model without
  FP8 casts gets the same rows for each linear layer's input, weight and output gradient, from
  a static cast (scale ``2**0``) to the run's FP8 formats made beside the layer: what FP8 would
  do to that run, without changing it;
- every parameter: weight, gradient and update RMS and the update/weight ratio, from the
  optimizer's own step (its step hooks), and the learning rate its group applied;
- every attention layer of the package's blocks: its largest attention logit.

Between sampled steps nothing is hooked and nothing is computed. On a sampled step the
transformer blocks take their unfused form (hooks see each layer), whose values equal the
fused form's to float32 rounding.

:class:`Telemetry` is the same recorder for a user's own training loop; it writes the same
file (:mod:`ipu_unit_scaling.training.telemetry_log`).
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..fp8 import FP8Config, fp8_stats
from ..fp8.linear import FP8Linear
from ..fp8.scaling import cast_to_fp8
from ..fp8.stats import CastRecord, Fp8Stats, recorded_only_by
from ..modules.gpt_blocks import SelfAttention
from ..parametrization.inspector import parameter_roles
from .run_health import AS_IF_CAST, HealthMonitor, TelemetryConfig, telemetry_problems
from .telemetry_log import TelemetryLog

__all__ = ["TelemetryRecorder", "Telemetry", "cast_role", "sampled", "pooled_casts"]


def sampled(interval: int, before: int, after: int) -> bool:
    """Whether a call taking the run from step ``before`` to ``after`` makes a sampled step:
    a multiple of ``interval``, or a power of two below it (training goes wrong early more
    often than late, and these few samples see it)."""
    if interval <= 0:
        return False
    if after // interval > before // interval:
        return True
    return before < interval and (after.bit_length() > before.bit_length())


def cast_role(site: str) -> str:
    """activation, weight or gradient, from a cast site's name."""
    last = site.rsplit(".", 1)[-1]
    if last.startswith("grad"):
        return "gradient"
    if last == "weight":
        return "weight"
    return "activation"


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().double().square().mean().sqrt()) if t.numel() else math.nan


class TelemetryRecorder:
    """Records a sampled training call of ``model`` trained by ``optimizer`` (see the module
    docstring). ``fp8`` gives the formats of the casts recorded beside a model without FP8
    casts (the default FP8Config's when None)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 fp8: Optional[FP8Config] = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.fp8 = fp8 or FP8Config()
        self.has_fp8_casts = any(isinstance(m, FP8Linear) for m in model.modules())
        self.roles = parameter_roles(model)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._logits: Dict[str, float] = {}
        self._before: Dict[str, torch.Tensor] = {}
        self._grad_rms: Dict[str, float] = {}
        self._rates: Dict[str, float] = {}
        self._updated: Dict[str, torch.Tensor] = {}
        self._stats = Fp8Stats()

    @contextmanager
    def recording(self) -> Iterator[List[CastRecord]]:
        """Around one training call: hooks in, casts recorded; yields the cast records (filled
        as the call runs). Parameter and attention figures wait for :meth:`rows`."""
        self._logits, self._before, self._grad_rms, self._rates = {}, {}, {}, {}
        self._updated = {}
        with ExitStack() as stack:
            stats = stack.enter_context(fp8_stats())
            self._stats = stats
            for handle in self._hooks(self.optimizer):
                stack.callback(handle.remove)
            yield stats.records

    def _hooks(self, optimizer: Optional[torch.optim.Optimizer]) -> List[Any]:
        handles: List[Any] = []
        for name, module in self.model.named_modules():
            if isinstance(module, SelfAttention):
                handles.append(module.qkv.register_forward_hook(self._logit_hook(name, module)))
            if not self.has_fp8_casts and isinstance(module, nn.Linear):
                handles.append(module.register_forward_hook(self._cast_hook(name)))
        if optimizer is not None:
            handles.append(optimizer.register_step_pre_hook(self._before_step))
            handles.append(optimizer.register_step_post_hook(self._after_step))
        return handles

    def _cast_hook(self, name: str) -> Callable[..., None]:
        fp8 = self.fp8
        prefix = f"{name}." if name else ""

        def hook(module: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
            if not inputs or not isinstance(inputs[0], torch.Tensor):
                return
            stats = self._stats
            with recorded_only_by(stats):
                cast_to_fp8(inputs[0].detach(), fp8.activation, 0, site=prefix + "input")
                weight = module.weight
                assert isinstance(weight, torch.Tensor)
                cast_to_fp8(weight.detach(), fp8.weight, 0, site=prefix + "weight")
            if isinstance(output, torch.Tensor) and output.requires_grad:
                def on_gradient(grad: torch.Tensor) -> None:
                    with recorded_only_by(stats):
                        cast_to_fp8(grad.detach(), fp8.gradient, 0, site=prefix + "grad_output")
                output.register_hook(on_gradient)

        return hook

    def _logit_hook(self, name: str, attention: SelfAttention) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Tuple[Any, ...], qkv: Any) -> None:
            if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
                return
            with torch.no_grad():
                query, key, _ = attention._heads(qkv.detach())
                scale = attention.attention_scale
                if scale is None:
                    scale = query.shape[-1] ** -0.5
                logits = (query.float() @ key.float().transpose(-2, -1)) * scale
                if attention.is_causal:
                    seq = logits.shape[-1]
                    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
                    logits = logits.masked_fill(future, -math.inf)
                largest = float(logits.max()) if logits.numel() else math.nan
            self._logits[name] = max(largest, self._logits.get(name, -math.inf))

        return hook

    def _before_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        self._before, self._grad_rms, self._rates = {}, {}, {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self._names.get(id(param))
                if name is None:
                    continue
                self._before[name] = param.detach().clone()
                self._grad_rms[name] = math.nan if param.grad is None else _rms(param.grad)
                self._rates[name] = float(group["lr"])

    def _after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        self._updated = {name: p.detach() for name, p in self.model.named_parameters()
                         if name in self._before}

    def learning_rates(self) -> Dict[str, float]:
        """Each parameter's learning rate in the optimizer's groups now, by name."""
        if self.optimizer is None:
            return {}
        return {self._names[id(p)]: float(group["lr"]) for group in self.optimizer.param_groups
                for p in group["params"] if id(p) in self._names}

    def set_step(self, before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor],
                 grad_rms: Dict[str, float], rates: Dict[str, float]) -> None:
        """The parameters' figures of a step made where the optimizer's hooks do not run."""
        self._before, self._updated = dict(before), dict(after)
        self._grad_rms, self._rates = dict(grad_rms), dict(rates)

    def rows(self, step: int, records: List[CastRecord]) -> List[Dict[str, Any]]:
        """The telemetry rows of the sampled call that ended at ``step``."""
        beside = "" if self.has_fp8_casts else AS_IF_CAST
        rows = [dict(step=step, kind="cast", site=site, role=cast_role(site), note=beside,
                     **figures) for site, figures in pooled_casts(records).items()]
        for name, before in self._before.items():
            after = self._updated.get(name)
            if after is None:
                continue
            weight_before = _rms(before)
            update = _rms(after - before)
            rows.append(dict(
                step=step, kind="param", site=name, role=self.roles.get(name, "other"),
                weight_rms=_rms(after), grad_rms=self._grad_rms.get(name), update_rms=update,
                update_ratio=update / weight_before if weight_before else math.nan,
                learning_rate=self._rates.get(name)))
        rows += [dict(step=step, kind="attention", site=name, role="logit", amax=value)
                 for name, value in self._logits.items()]
        self._before, self._updated = {}, {}
        return rows


def pooled_casts(records: List[CastRecord]) -> Dict[str, Dict[str, Any]]:
    """Per site, its casts in one call pooled (a step of several micro-batches casts each site
    once per micro-batch): counts summed, amax the largest, RMS and SQNR over every element;
    the scaling bias and format of the last cast."""
    grouped: Dict[str, List[CastRecord]] = {}
    for record in records:
        grouped.setdefault(record.site, []).append(record)
    pooled: Dict[str, Dict[str, Any]] = {}
    for site, group in grouped.items():
        numel = sum(r.numel for r in group)
        nonzero = sum(r.nonzero for r in group)
        energy = sum(r.rms ** 2 * r.numel for r in group if math.isfinite(r.rms))
        noise = sum(r.rms ** 2 * r.numel / 10 ** (r.sqnr_db / 10) for r in group
                    if math.isfinite(r.rms) and not math.isnan(r.sqnr_db))
        if any(r.sqnr_db == -math.inf for r in group):
            sqnr = -math.inf
        elif energy == 0:
            sqnr = math.nan
        else:
            sqnr = math.inf if noise == 0 else 10 * math.log10(energy / noise)
        last = group[-1]
        pooled[site] = dict(
            format=last.format, log2_scale=last.log2_scale,
            amax=max(r.amax for r in group), rms=math.sqrt(energy / numel) if numel else math.nan,
            flushed_fraction=sum(r.flushed for r in group) / nonzero if nonzero else 0.0,
            saturated_fraction=sum(r.saturated for r in group) / numel if numel else 0.0,
            sqnr_db=sqnr)
    return pooled


class Telemetry:
    """Telemetry for a user's own training loop, written to ``path`` (a ``telemetry.csv``).

    ::

        telemetry = Telemetry(model, optimizer, "run/telemetry.csv", interval=10)
        for step in range(1, steps + 1):
            with telemetry.step(step):          # records when the step is sampled
                loss = model(inputs, labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            telemetry.loss(step, loss.item())   # optional: loss rows and spike warnings

    Warnings (:class:`ipu_unit_scaling.training.run_health.HealthMonitor`) go to ``log``
    (``print`` by default; None for none). ``path`` None records and warns without a file;
    ``fresh=False`` appends to an existing file. Also works around a ``poptorch.trainingModel`` call
    on the CPU fallback and the emulator, where the casts run on the host.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 path: Union[str, Path, None], interval: int = TelemetryConfig.interval,
                 config: Optional[TelemetryConfig] = None, fp8: Optional[FP8Config] = None,
                 log: Optional[Callable[[str], None]] = print, fresh: bool = True,
                 on_rows: Optional[Callable[[List[Dict[str, Any]]], None]] = None) -> None:
        self.config = config or TelemetryConfig(interval=interval)
        problems = telemetry_problems(self.config)
        if problems:
            raise ValueError("; ".join(f"telemetry.{key}: {message}" for key, message in problems))
        self.recorder = TelemetryRecorder(model, optimizer, fp8)
        self.log = TelemetryLog(None if path is None else Path(path), fresh=fresh)
        # The recipe the model's casts use (its first FP8 layer's; else the one given).
        cast_recipe = next((m.config for m in model.modules() if isinstance(m, FP8Linear)), fp8)
        self.monitor = HealthMonitor(self.config, cast_recipe)
        self.say = log or (lambda text: None)
        # Every batch of rows written, for another sink (the run's TensorBoard scalars).
        self.on_rows = on_rows

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Records the code inside when ``step`` is sampled; does nothing otherwise."""
        with self.call(step - 1, step):
            yield

    @contextmanager
    def call(self, before: int, after: int) -> Iterator[None]:
        """Records the code inside, a call that takes training from step ``before`` to
        ``after``, when it makes a sampled step (its rows carry step ``after``)."""
        if not sampled(self.config.interval, before, after):
            yield
            return
        with self.recorder.recording() as records:
            yield
        self.write(self.recorder.rows(after, records))

    def replay(self, step: int, before: Dict[str, torch.Tensor],
               batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
               loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Records step ``step`` of a device that traced the model (PopTorch, PopXL), where no
        hook runs: its casts, gradients and attention logits from the same step replayed on the
        host, from the weights ``before`` it (by name) on its micro-``batches``; its update
        from those and the weights the model holds now, copied back from the device.
        ``loss_of(inputs, labels)`` is the model's loss. The model is left as it was."""
        recorder = self.recorder
        model = recorder.model
        parameters = dict(model.named_parameters())
        after = {name: p.detach().clone() for name, p in parameters.items()}
        held = {name: p.grad for name, p in parameters.items()}
        rates = recorder.learning_rates()
        try:
            with torch.no_grad():
                for name, p in parameters.items():
                    p.copy_(before[name])
                    p.grad = None
            with recorder.recording() as records, torch.enable_grad():
                for inputs, labels in batches:
                    (loss_of(inputs, labels) / len(batches)).backward()
            grad_rms = {name: math.nan if p.grad is None else _rms(p.grad)
                        for name, p in parameters.items()}
        finally:
            with torch.no_grad():
                for name, p in parameters.items():
                    p.copy_(after[name])
                    p.grad = held[name]
        recorder.set_step(before, after, grad_rms, rates)
        self.write(recorder.rows(step, records))

    def loss(self, step: int, loss: float) -> None:
        """A loss row for ``step``, and a warning if it spikes."""
        self.write([dict(step=step, kind="loss", site="loss", amax=float(loss))])

    def check_loss(self, step: int, loss: float) -> None:
        """A warning if the loss of ``step`` spikes (the loss itself is recorded elsewhere)."""
        self.write([], [dict(step=step, kind="loss", site="loss", amax=float(loss))])

    def write(self, rows: List[Dict[str, Any]],
              checked_only: Sequence[Dict[str, Any]] = ()) -> None:
        """Writes ``rows`` and the warnings they (and ``checked_only``) raise; says each."""
        warnings = self.monitor.check(list(rows) + list(checked_only))
        for warning in warnings:
            self.say(warning["note"])
        self.log.write(list(rows) + warnings)
        if self.on_rows is not None:
            self.on_rows(list(rows) + warnings)

    def close(self) -> None:
        self.log.sync()
        self.log.close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
