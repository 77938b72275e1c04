"""One IPU path: the ``emulator`` backend is the IPU backend's own code (``backends/poptorch``)
run against the PopTorch stand-in, and computes what the former emulator computed.

The former emulator traced the model like PopTorch (:func:`trace_like_poptorch`: PopART's
GELU, gradients from the traced graph) and trained that trace with the CPU backend's batching
and torch's optimizers. :class:`FormerEmulator` below is that arithmetic, kept as the
reference. Now the same trace is compiled by the stand-in's ``poptorch.trainingModel`` from
the options the config builds, and stepped by ``poptorch.optim`` in PopART's update rules.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.backends import build_training_model, make_optimizer
from ipu_unit_scaling.backends.cpu import CPUTrainingModel, TrainingModule
from ipu_unit_scaling.backends.poptorch.poptorch_training import IPUTrainingModel
from ipu_unit_scaling.backends.poptorch_backend import poptorch_module
from ipu_unit_scaling.ipu import PopTorchTrace, trace_like_poptorch
from ipu_unit_scaling.loop import run_session
from ipu_unit_scaling.ops.ipu_lowering import torch_numerics
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_records import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread", "from_the_repository_root")
FACTORY = ["ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[-1]",
           "model.factory=examples.library_decoder:build"]
U32 = 2.0**-24  # float32 unit roundoff
CALLS = 3


class FormerEmulator(nn.Module):
    """The former ``emulator`` backend's module: ``TrainingModule(model)`` run through
    :func:`trace_like_poptorch`, one trace per input signature and train/eval mode."""

    def __init__(self, model: nn.Module, stochastic_rounding: bool):
        super().__init__()
        self.module = TrainingModule(model)
        self.stochastic_rounding = stochastic_rounding
        self.traces: Dict[Tuple[Any, ...], PopTorchTrace] = {}

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Any:
        key = (tuple(inputs.shape), tuple(labels.shape), self.module.training)
        if key not in self.traces:
            trace = trace_like_poptorch(self.module, inputs, labels,
                                        stochastic_rounding=self.stochastic_rounding)
            assert trace.report.ok, str(trace.report)
            self.traces[key] = trace
        return self.traces[key](inputs, labels)


def former_wrapper(model: nn.Module, config: Config, optimizer: str) -> CPUTrainingModel:
    """The former emulator: the traced module with the CPU backend's batching, stepped by
    torch's optimizer (``optimizer="cpu"``, as it was) or by ``poptorch.optim``'s rule run on
    the host (``"emulator"``)."""
    ipu = config.ipu
    return CPUTrainingModel(
        FormerEmulator(model, ipu.stochastic_rounding), make_optimizer(model, config, optimizer),
        device_iterations=ipu.device_iterations,
        gradient_accumulation=ipu.gradient_accumulation,
        replication_factor=ipu.replication_factor, max_grad_norm=config.training.grad_clip)


def step_losses(config: Config, how: str) -> torch.Tensor:
    """Each optimizer step's loss over ``CALLS`` calls, from one seed and the same batches:
    ``how`` is a backend name, or "former" or "former-popart" (:func:`former_wrapper` with
    torch's optimizer or PopTorch's)."""
    torch.manual_seed(0)
    model = build_model(config)
    if how.startswith("former"):
        wrapper: Any = former_wrapper(model, config, "emulator" if "popart" in how else "cpu")
    else:
        wrapper = build_training_model(model, make_optimizer(model, config, how), config, how)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(CALLS):
        ids = torch.randint(0, config.model.vocab_size,
                            (config.samples_per_call, config.model.seq_len + 1),
                            generator=generator)
        _, loss = wrapper(ids[:, :-1], ids[:, 1:])
        assert loss.shape == (config.samples_per_call // config.micro_batch_size,)  # All
        losses.append(loss.view(config.ipu.device_iterations, -1).mean(1))
    if how == "emulator":
        assert isinstance(wrapper, IPUTrainingModel)
        assert isinstance(wrapper.executor, poptorch_module("emulator").PoplarExecutor)
    wrapper.destroy()
    return torch.cat(losses)


def tiny(*overrides: str) -> Config:
    """The tiny config (the default config, shortened), two device iterations a call."""
    return load_config("tiny", ["model.vocab_size=24", "ipu.device_iterations=2",
                                "training.steps=6", "ipu.executable_cache_dir=null",
                                *overrides])


# The former emulator and the stand-in run the same traced graph on the same weights, so the
# first step's loss is the same computation. Later steps follow weights updated by torch's
# Adam (before) or PopART's (now): the same rule, whose float32 evaluation order differs, so
# each update differs by a few roundings of the update; over CALLS x device_iterations = 6
# steps of a model whose loss sums at most 2**10 rounded terms per output, the losses agree
# to 2**10 unit roundoffs. That holds for FP32 models. In an FP8 model a one-rounding
# difference can move an element across an FP8 rounding boundary (one F143 step, 2**-3
# relative), so there the reference steps with poptorch.optim's rule on the host: what remains
# to differ is the batching and the device copy, which round alike.
FORMER_TOLERANCE = 2**10 * U32
FP32 = ["precision.dtype=fp32"]


@pytest.mark.parametrize("overrides, reference", [
    ([], "former-popart"),
    (FP32, "former"),
    (FACTORY + FP32, "former"),
    (FACTORY + FP32 + ["model.parametrization=u-mup"], "former"),
], ids=["default-fp8", "default-fp32", "factory-fp32", "factory-umup-fp32"])
def test_the_emulator_computes_what_the_former_emulator_computed(overrides, reference):
    config = tiny(*overrides)
    former = step_losses(copy.deepcopy(config), reference)
    now = step_losses(copy.deepcopy(config), "emulator")
    assert now.shape == (CALLS * 2,) and torch.isfinite(now).all()
    assert now[0] == former[0]  # one graph, one set of weights: the same computation
    torch.testing.assert_close(now, former, rtol=FORMER_TOLERANCE, atol=0)


def gelu_difference() -> float:
    """max |PopART's tanh-form GELU - torch's erf form| over x (float64, on a fine grid)."""
    x = torch.linspace(-10.0, 10.0, 200_001, dtype=torch.float64)
    exact = torch.nn.functional.gelu(x)
    return float((torch.nn.functional.gelu(x, approximate="tanh") - exact).abs().max())


def test_the_emulator_differs_from_the_cpu_backend_by_poparts_gelu():
    """Against eager PyTorch, the emulator differs by what PopART's GELU changes. Run with
    torch's GELU (``torch_numerics``: the same path without the lowering), it gives the CPU
    backend's losses to float32 rounding; so the CPU backend's losses are within the GELU's
    change of the loss (and that rounding) of the emulator's."""
    config = tiny(*FP32)
    cpu = step_losses(copy.deepcopy(config), "cpu")
    popart_gelu = step_losses(copy.deepcopy(config), "emulator")
    with torch_numerics():
        torch_gelu = step_losses(copy.deepcopy(config), "emulator")
    # Eager and traced forms evaluate the same ops in another order (fused kernels, the
    # scaled-identity op) and the optimizers differ as above: float32 rounding, bounded as
    # for the former emulator.
    torch.testing.assert_close(torch_gelu, cpu, rtol=FORMER_TOLERANCE, atol=0)
    gelu_effect = (popart_gelu - torch_gelu).abs()
    assert gelu_effect.max() > 0  # the model's MLPs have GELUs: PopART's form shows
    slack = FORMER_TOLERANCE * cpu.abs()
    assert ((popart_gelu - cpu).abs() <= gelu_effect + slack).all()
    # How far the GELU moves the loss: each GELU output moves by at most gelu_difference()
    # (4.7e-4 at x = 2.7) on unit-scaled activations, whose unit-scaled successors keep a
    # perturbation's relative size; so the loss moves by at most that, relatively.
    assert (gelu_effect <= gelu_difference() * cpu.abs()).all()


@pytest.fixture
def built(monkeypatch: Any) -> List[Any]:
    """The training models the loop builds, recorded."""
    made: List[Any] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        made.append(build_training_model(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(run_session, "build_training_model", record)
    return made


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}.\n"
                            for i in range(120)))
    return path


@pytest.mark.parametrize("overrides", [[], FACTORY], ids=["default", "factory"])
def test_train_with_backend_emulator_runs_the_ipu_backend_on_the_standin(tmp_path, text, built,
                                                                        overrides):
    standin = poptorch_module("emulator")
    run_dir = tmp_path / "run"
    status = main(["train", "--config", "tiny", "--quiet", "--run-dir", str(run_dir), "--set",
                   f"data.path={text}", "backend=emulator", "training.steps=3",
                   "training.eval_interval=3", *overrides])
    assert status == 0
    (wrapper,) = built
    assert isinstance(wrapper, IPUTrainingModel)
    assert isinstance(wrapper.executor, standin.PoplarExecutor)
    assert isinstance(wrapper.optimizer, standin.optim.Adam)  # the config's adam, PopTorch's
    options = wrapper.executor.options  # what the stand-in validated and compiled with
    config = load_config("tiny", [*overrides])
    assert options.Training.gradient_accumulation == config.ipu.gradient_accumulation
    assert options.device_iterations == config.ipu.device_iterations
    assert standin.OutputMode(options.output_mode) == standin.OutputMode.All
    assert not options._values.get("use_model", False)  # hardware's numerics
    losses = [float(row["train_loss"]) for row in read_metrics(run_dir)]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert losses[-1] < losses[0]


def test_the_configs_ipu_settings_reach_the_standins_compile():
    """Replication, half partials and hardware's GELU on the emulator; the IPU Model's GELU
    gradient when the same code asks for ``useIpuModel``."""
    from ipu_standins.poptorch._lowering import popart_gelu
    from ipu_standins.poptorch._numerics import ipu_model_gelu

    standin = poptorch_module("emulator")
    config = tiny(*FP32, "ipu.replication_factor=2", "ipu.partials_type=half",
                  "training.batch_size=16")
    gelus = {}
    for ipu_model in (False, True):
        torch.manual_seed(0)
        model = build_model(config)
        optimizer = make_optimizer(model, config, "emulator")
        if ipu_model:
            wrapper: Any = IPUTrainingModel(model, optimizer, config.ipu, fp8=False,
                                            use_ipu_model=True,
                                            poptorch=standin, needs_library=False)
        else:
            wrapper = build_training_model(model, optimizer, config, "emulator")
        options = wrapper.executor.options
        assert options.replication_factor == 2 and options.device_iterations == 2
        assert options._Popart.options["partialsTypeMatMuls"] == "half"
        assert options._values.get("use_model", False) is ipu_model
        ids = torch.randint(0, config.model.vocab_size,
                            (config.samples_per_call, config.model.seq_len + 1))
        _, loss = wrapper(ids[:, :-1], ids[:, 1:])
        # One loss per micro-batch: 2 iterations x 4 accumulated x 2 replicas.
        assert loss.shape == (2 * 4 * 2,)
        graph = wrapper.executor._graph.trace.graph.graph
        gelus[ipu_model] = {n.target for n in graph.nodes
                            if n.target in (popart_gelu, ipu_model_gelu)}
        wrapper.destroy()
    assert gelus == {False: {popart_gelu}, True: {ipu_model_gelu}}


def _crossings(run: Callable[[], Any]) -> List[str]:
    """The stand-in's functions that code of the package calls while ``run()`` runs, in order:
    each a crossing from the backend into the stand-in."""
    package = os.sep + "ipu_unit_scaling" + os.sep
    standin = os.sep + "ipu_standins" + os.sep
    calls: List[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        caller = frame.f_back
        if event == "call" and caller is not None and standin in frame.f_code.co_filename \
                and package in caller.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_a_training_step_crosses_into_the_standin_as_poptorchs_api_requires():
    """After compiling, a step of the training loop is a call of the compiled model and, with
    the learning rate changed, ``setOptimizer``: PopTorch's API calls, and nothing else of the
    stand-in; the weights come back only when asked (``copyWeightsToHost``)."""
    config = tiny(*FP32)
    torch.manual_seed(0)
    model = build_model(config)
    wrapper = build_training_model(model, make_optimizer(model, config, "emulator"), config,
                                   "emulator")
    ids = torch.randint(0, config.model.vocab_size,
                        (config.samples_per_call, config.model.seq_len + 1))

    def step() -> None:
        wrapper(ids[:, :-1], ids[:, 1:])
        for group in wrapper.optimizer.param_groups:
            group["lr"] *= 0.5
        wrapper.update_optimizer()

    step()  # compiles
    assert _crossings(lambda: [step() for _ in range(3)]) == ["__call__", "setOptimizer"] * 3
    assert _crossings(wrapper.copy_weights_to_host) == ["copyWeightsToHost"]
    wrapper.destroy()
