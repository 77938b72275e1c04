"""PopTorch's compile-time checks, applied on the host to training and inference models.

The rules follow graphcore/poptorch at commit c2a8b17762f1: ``popart_compiler/source/
Compiler.cpp`` and ``CompilerImpl.cpp`` (pipeline stages, IPU count) and
``python/_poplar_executor.py`` (inference without accumulation, rows per call).
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, List, Tuple

import pytest
import torch

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.apps.pretrained import evaluate_run, open_run, sample_run
from ipu_unit_scaling.backends import build_inference_model, build_training_model
from ipu_unit_scaling.backends.poptorch.compile_checks import (
    CompileOptions,
    PopTorchError,
    check_compile,
    forward_stages,
)
from ipu_unit_scaling.backends.poptorch.poptorch_options import New, option_calls
from ipu_unit_scaling.backends.poptorch_backend import poptorch_module
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.ops.ipu_lowering import torch_numerics
from ipu_unit_scaling.training.precision import build_model, regime_config
from ipu_unit_scaling.training.run_config import Config, load_config


def refusal(options: CompileOptions, *, training: bool, stages: int, ipus: int) -> str:
    with pytest.raises(PopTorchError) as caught:
        check_compile(options, training=training, stages=stages, ipus=ipus)
    message = str(caught.value)
    assert "\n" not in message and "PopTorch refuses it" in message
    return message


def inference_options(config: Config) -> CompileOptions:
    """The options the IPU backend compiles an inference model of ``config`` with, one batch
    per call as evaluation and sampling run it."""
    config = replace(config, ipu=replace(config.ipu, device_iterations=1))
    return CompileOptions.from_calls(option_calls(config.ipu, inference=True))


# ------------------------------------------------------------------------ the checks


@pytest.mark.parametrize("name", ["tiny", "ipu-2", "ipu-4"])
def test_pipelined_configs_evaluate_in_a_layout_poptorch_compiles(name):
    config = load_config(name)
    ipus = config.ipu.ipus_per_replica
    options = inference_options(config)
    assert options.strategy == "ShardedExecution" and options.gradient_accumulation == 1
    check_compile(options, training=False, stages=ipus, ipus=ipus)
    # PipelinedExecution with one device iteration is what PopTorch refuses.
    pipelined = dataclasses.replace(options, strategy="PipelinedExecution")
    message = refusal(pipelined, training=False, stages=ipus, ipus=ipus)
    assert "deviceIterations" in message and f"{ipus} pipeline stages" in message
    # Training keeps the pipeline, and its accumulation fills 2 x stages - 1.
    training = CompileOptions.from_calls(option_calls(config.ipu))
    assert training.strategy == "PipelinedExecution"
    check_compile(training, training=True, stages=ipus, ipus=ipus)


def test_option_calls_for_inference_set_no_training_options():
    calls = option_calls(load_config("ipu-4").ipu, inference=True)
    assert not [c for c in calls if c.method.startswith("Training.")]
    (strategy,) = [c.args[0] for c in calls if c.method == "setExecutionStrategy"]
    assert isinstance(strategy, New) and strategy.path == "ShardedExecution"


@pytest.mark.parametrize("options, training, stages, ipus, words", [
    (CompileOptions(gradient_accumulation=4), True, 3, 3,
     ["gradientAccumulation", "2 x 3 - 1 = 5 pipeline stages"]),
    (CompileOptions(gradient_accumulation=2), False, 1, 1, ["inferenceModel"]),
    (CompileOptions(device_iterations=3), False, 4, 4, ["deviceIterations", "4 pipeline stages"]),
    (CompileOptions(replication_factor=64, gradient_accumulation=3), True, 2, 2,
     ["128 IPUs", "at most 64"]),
    (CompileOptions(replication_factor=3), True, 1, 1, ["3 IPUs", "powers of two"]),
], ids=["accumulation", "inference-accumulation", "device-iterations", "too-many-ipus",
        "not-a-power-of-two"])
def test_compile_checks_refuse_what_poptorch_refuses(options, training, stages, ipus, words):
    message = refusal(options, training=training, stages=stages, ipus=ipus)
    assert all(word in message for word in words), message


def test_compile_checks_accept_what_poptorch_accepts():
    # 3 stages on 4 IPUs: one IPU holds no module
    check_compile(CompileOptions(gradient_accumulation=5), training=True, stages=3, ipus=4)
    check_compile(CompileOptions(device_iterations=4), training=False, stages=4, ipus=4)
    sharded = CompileOptions(strategy="ShardedExecution")
    check_compile(sharded, training=False, stages=4, ipus=4)
    check_compile(sharded, training=True, stages=4, ipus=4)
    # Power-of-two reservation is for hardware: the IPU Model, or autoRoundNumIPUs, accept 3.
    check_compile(CompileOptions(replication_factor=3, ipu_model=True), training=True,
                  stages=1, ipus=1)
    check_compile(CompileOptions(replication_factor=3, auto_round_num_ipus=True),
                  training=True, stages=1, ipus=1)


def test_a_stage_without_modules_is_not_a_pipeline_stage():
    assert forward_stages([("embedding", "layers.0"), (), ("layers.1", "head")]) == 2
    assert forward_stages([]) == 1


# ------------------------------------------------------------------------ on the emulator


def tiny_model(config: Config) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(config)


def test_emulator_refuses_a_config_poptorch_refuses_before_training():
    config = load_config("tiny")
    # past the config's own check: a 2-stage pipeline
    config = replace(config, ipu=replace(config.ipu, gradient_accumulation=2))
    model = tiny_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PopTorchError, match=r"gradient_accumulation = 2 .*2 x 2 - 1 = 3"):
        build_training_model(model, optimizer, config, backend="emulator")
    config = load_config("tiny", ["ipu.replication_factor=64", "training.batch_size=256"])
    with pytest.raises(PopTorchError, match="128 IPUs"):
        build_training_model(model, optimizer, config, backend="emulator")
    with pytest.raises(PopTorchError, match="128 IPUs"):
        build_inference_model(model, config, backend="emulator")


def test_the_command_line_says_why_in_one_line(tmp_path, capsys):
    status = main(["train", "--config", "tiny", "--quiet", "--run-dir", str(tmp_path / "run"),
                   "--set", "backend=emulator", "ipu.replication_factor=64",
                   "training.batch_size=256"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "128 IPUs" in err and "at most 64" in err


def test_emulated_inference_takes_poptorch_rows_and_returns_every_micro_batch():
    config = load_config("tiny", ["ipu.replication_factor=2"])  # 4 IPUs
    model = tiny_model(config).eval()
    runner = build_inference_model(model, config, backend="emulator")
    assert runner.rows_per_call == 2
    ids = torch.randint(0, config.model.vocab_size, (4, config.model.seq_len))
    with pytest.raises(PopTorchError, match=r"3 rows, not a multiple of .* = 2"):
        runner(ids[:3])
    with torch.no_grad():
        expected_logits = model(ids)
        expected_losses = torch.stack([model(ids[:2], ids[:2]), model(ids[2:], ids[2:])])
    # The batching is under test, not the lowering: the trace computes torch's GELU here.
    with torch_numerics():
        logits, losses = runner(ids), runner(ids, ids)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
    # A scalar per micro-batch, stacked: one loss per replica, as OutputMode.All returns.
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [[], ["ipu.replication_factor=2"]],
                         ids=["2-stage", "2-stage-2-replicas"])
def test_a_pipelined_run_trains_evaluates_and_samples_on_the_emulator(tmp_path, overrides):
    """A 2-IPU pipeline trained on the emulator, then evaluated and sampled there, every
    model compiled under PopTorch's checks; the numbers are the host's."""
    config = regime_config(load_config("tiny", [
        "backend=emulator", "training.steps=4", "training.eval_interval=4",
        "training.eval_batches=1", *overrides]), "fp32")
    run_dir = tmp_path / "run"
    train(config, run_dir, quiet=True)
    run = open_run(run_dir)
    assert run.config.ipu.ipus_per_replica == 2 and run.config.backend == "emulator"
    runner = build_inference_model(run.model("fp32"), run.config, backend="emulator")
    assert runner.compile_options.strategy == "ShardedExecution"  # type: ignore[attr-defined]
    assert runner.rows_per_call == run.config.ipu.replication_factor
    emulated = evaluate_run(run, ["fp32"], backend="emulator")
    on_host = evaluate_run(run, ["fp32"], backend="cpu")
    assert emulated.rows[0].loss == pytest.approx(on_host.rows[0].loss, rel=1e-5)
    text = sample_run(run, "def ", 12, seed=0, backend="emulator")
    assert len(text) == 12 and text == sample_run(run, "def ", 12, seed=0, backend="cpu")


# ------------------------------------------------------------------------ the IPU backend


def _blocks(model: torch.nn.Module) -> List[Tuple[str, str]]:
    """The PopTorch blocks the model's modules begin, as ``poptorch.module_repr`` shows them."""
    return [(name, repr(hook)) for name, module in model.named_modules()
            for hook in module._forward_pre_hooks.values()
            if repr(hook).startswith("BeginBlock(")]


@pytest.fixture
def standin_models(monkeypatch):
    """The PopTorch stand-in, with the executors its ``trainingModel``/``inferenceModel``
    return recorded on their way out."""
    standin = poptorch_module("emulator")
    made: List[Any] = []
    for name in ("trainingModel", "inferenceModel"):
        build = getattr(standin, name)

        def recorded(*args: Any, build: Any = build, **kwargs: Any) -> Any:
            made.append(build(*args, **kwargs))
            return made[-1]

        monkeypatch.setattr(standin, name, recorded)
    return standin, made


def test_ipu_inference_model_compiles_sharded_and_again_for_new_shapes(standin_models):
    from ipu_unit_scaling.backends.poptorch.poptorch_training import IPUInferenceModel

    standin, executors = standin_models
    config = load_config("tiny", ["precision.dtype=fp32"])  # no custom op library to load
    model = tiny_model(config)
    runner = IPUInferenceModel(model, config.ipu, fp8=False, use_ipu_model=True, poptorch=standin,
                               needs_library=False)
    options = runner.options
    strategy = options._execution_strategy
    assert type(strategy) is standin.ShardedExecution
    assert strategy._stages_manager._auto_stage == standin.AutoStage.AutoIncrement
    assert options.device_iterations == 1 and options.Training.gradient_accumulation == 1
    assert options.use_model is True
    # One block per IPU of the split, on every module the split places there.
    assert sorted(_blocks(model)) == sorted(
        (name, f"BeginBlock(user_id=ipu{stage.index}, ipu_id={stage.index})")
        for stage in runner.stages for name in stage.modules)
    assert {stage.index for stage in runner.stages} == {0, 1}
    ids = torch.randint(0, config.model.vocab_size, (2, config.model.seq_len))
    with torch_numerics():
        first = runner(ids)
        runner(ids)
        assert len(executors) == 1 and isinstance(executors[0], standin.PoplarExecutor)
        assert executors[0].isCompiled()
        runner(ids[:1])  # PopTorch refuses new shapes on a compiled model: compile again
    assert len(executors) == 2 and not executors[0].isCompiled() and executors[1].isCompiled()
    with torch.no_grad():
        torch.testing.assert_close(first, model(ids), rtol=1e-5, atol=1e-6)
    runner.destroy()
    assert not _blocks(model)  # destroy takes the blocks off


def test_ipu_backend_refuses_before_asking_poptorch_for_a_model(standin_models):
    from ipu_unit_scaling.backends.poptorch.poptorch_training import (
        IPUInferenceModel,
        IPUTrainingModel,
    )

    standin, executors = standin_models
    config = load_config("tiny", ["ipu.replication_factor=64", "training.batch_size=256",
                                  "precision.dtype=fp32"])
    model = tiny_model(config)
    with pytest.raises(PopTorchError, match="128 IPUs"):
        IPUInferenceModel(model, config.ipu, fp8=False, use_ipu_model=False, poptorch=standin,
                          needs_library=False)
    with pytest.raises(PopTorchError, match="128 IPUs"):
        IPUTrainingModel(model, torch.optim.SGD(model.parameters(), lr=0.1), config.ipu, fp8=False,
                         use_ipu_model=False, poptorch=standin, needs_library=False)
    assert not executors and not _blocks(model)  # no block, no model
