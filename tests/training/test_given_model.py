"""A model of your own (``model.factory``): the library-style decoder of
``examples/library_decoder.py`` trains on the emulator with the gradients eager PyTorch gives,
and ``ipu-unit-scaling train`` trains, resumes, evaluates and samples it; bad factories are
refused in one line before anything is written."""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
from helpers import ROOT
from torch import nn

from ipu_unit_scaling.backends import build_training_model, capabilities, make_optimizer
from ipu_unit_scaling.backends.cpu import TrainingModule
from ipu_unit_scaling.backends.poptorch.poptorch_training import IPUTrainingModel
from ipu_unit_scaling.backends.poptorch_backend import poptorch_module
from ipu_unit_scaling.ipu import trace_like_poptorch
from ipu_unit_scaling.loop.run_opening import load_run_config
from ipu_unit_scaling.loop.tasks import MaskedLM
from ipu_unit_scaling.ops.ipu_lowering import torch_numerics
from ipu_unit_scaling.optim import LR_SCALE
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.given_model import GivenLanguageModel, check_given_model
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = pytest.mark.usefixtures("from_the_repository_root")
FACTORY = "examples.library_decoder:build"
ONE_STAGE = ["ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[-1]"]
VOCAB, SEQ = 24, 16


def _config(*overrides: str) -> Config:
    return load_config("tiny", ONE_STAGE + [
        f"model.factory={FACTORY}", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
        "model.parametrization=u-mup", "precision.dtype=fp32", *overrides])


def _sequences(generator: torch.Generator, rows: int) -> torch.Tensor:
    """start, start + step, ... (mod VOCAB), one more than SEQ: the next token is predictable."""
    start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    step = torch.randint(1, 4, (rows, 1), generator=generator)
    return (start + step * torch.arange(SEQ + 1)) % VOCAB


def test_factory_builds_the_library_decoder_with_its_u_mup_rates():
    torch.manual_seed(0)
    model = build_model(_config())
    assert isinstance(model, GivenLanguageModel)
    assert type(model.model).__name__ == "LibraryDecoder"
    assert model.model.projection.weight.shape == (VOCAB, 32)  # tiny's hidden size
    ids = torch.randint(0, VOCAB, (3, SEQ))
    assert model(ids).shape == (3, SEQ, VOCAB)
    optimizer = make_optimizer(model, _config(), "emulator")
    scale = {id(p): group[LR_SCALE] for group in optimizer.param_groups for p in group["params"]}
    inner = model.model
    depth = len(inner.layers)
    # unit_scaling's Adam rules: a weight fan_in**-0.5, the readout 1, inside the residual
    # stack times depth**-0.5.
    assert scale[id(inner.embedding.weight)] == pytest.approx(32**-0.5)
    assert scale[id(inner.projection.weight)] == pytest.approx(1.0)
    first_linear = next(m for m in inner.layers[0].modules() if isinstance(m, nn.Linear))
    assert scale[id(first_linear.weight)] == pytest.approx(
        first_linear.in_features**-0.5 * depth**-0.5)


def test_library_decoder_trains_on_the_emulator_with_eager_gradients():
    config = _config("backend=emulator", "ipu.gradient_accumulation=2",
                     "training.learning_rate=1.0")
    torch.manual_seed(0)
    model = build_model(config)
    generator = torch.Generator().manual_seed(1)

    # One traced step's gradients against eager PyTorch's, torch's op definitions in both.
    sequences = _sequences(generator, 4)
    inputs, labels = sequences[:, :-1], sequences[:, 1:]
    parameters = list(model.parameters())
    with torch_numerics():
        trace = trace_like_poptorch(TrainingModule(model), inputs, labels)
        traced_logits, traced_loss = trace(inputs, labels)
        traced = torch.autograd.grad(traced_loss, parameters)
    eager_logits, eager_loss = TrainingModule(model)(inputs, labels)
    eager = torch.autograd.grad(eager_loss, parameters)
    torch.testing.assert_close(traced_loss, eager_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(traced_logits, eager_logits, rtol=1e-4, atol=1e-5)
    for got, want in zip(traced, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())

    wrapper = build_training_model(model, make_optimizer(model, config, "emulator"), config,
                                   "emulator")
    # The IPU backend's training model, on the PopTorch stand-in.
    assert isinstance(wrapper, IPUTrainingModel)
    assert isinstance(wrapper.executor, poptorch_module("emulator").PoplarExecutor)
    losses: List[float] = []
    for _ in range(20):
        sequences = _sequences(generator, config.samples_per_call)
        _, loss = wrapper(sequences[:, :-1], sequences[:, 1:])
        losses.append(float(loss.mean()))
    assert wrapper.executor.isCompiled()  # each step ran the compiled trace
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)  # unit logits: near chance
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses


def _command(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ipu_unit_scaling", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n"
                            for i in range(80)))
    return path


def test_train_command_trains_resumes_evaluates_and_samples_a_given_model(tmp_path, text_file):
    run_dir = tmp_path / "run"
    trained = _command("train", "--config", "examples/library_decoder.yaml", "--run-dir",
                       str(run_dir), "--quiet", "--set", f"data.path={text_file}",
                       "training.steps=6", "training.eval_interval=3", "backend=emulator")
    assert trained.returncode == 0, trained.stderr
    config = load_run_config(run_dir)
    assert config.model.factory == FACTORY  # what resume, evaluate and sample rebuild
    state = load_checkpoint(run_dir / "checkpoint.pt")["model"]
    assert "model.projection.weight" in state and "head.weight" not in state
    rows = read_metrics(run_dir)
    assert len(rows) == 6 and float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])

    resumed = _command("train", "--resume", str(run_dir), "--quiet", "--set",
                       "training.steps=9")
    assert resumed.returncode == 0, resumed.stderr
    rows = read_metrics(run_dir)
    assert [int(row["step"]) for row in rows] == list(range(1, 10))
    final_val = float(rows[-1]["val_loss"])

    evaluated = _command("evaluate", str(run_dir), "--precision", "fp8-amax")
    assert evaluated.returncode == 0, evaluated.stderr
    row = next(line for line in evaluated.stdout.splitlines() if "(trained)" in line)
    assert float(row.split("|")[2]) == pytest.approx(final_val, abs=1e-4)

    sampled = _command("sample", str(run_dir), "--tokens", "30", "--seed", "3")
    assert sampled.returncode == 0, sampled.stderr
    assert len(sampled.stdout.strip()) > 0

    changed = _command("train", "--resume", str(run_dir), "--set", "training.steps=10",
                       "model.factory=examples.other:build")
    assert changed.returncode == 2 and "model.factory" in changed.stderr


@pytest.mark.parametrize("factory, message", [
    ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
    ("copy:copy", "copy:copy returned GPTConfig, not a torch.nn.Module"),
    ("examples.library_decoder", "expected 'package.module:function'"),
])
def test_a_bad_factory_is_refused_in_one_line_before_training(tmp_path, text_file, factory,
                                                              message):
    run_dir = tmp_path / "run"
    refused = _command("train", "--config", "tiny", "--run-dir", str(run_dir), "--set",
                       f"data.path={text_file}", *ONE_STAGE, f"model.factory={factory}")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.factory" in lines[0] and message in lines[0], lines
    assert not (run_dir / "checkpoint.pt").exists() and not (run_dir / "metrics.csv").exists()


def test_a_model_without_vocabulary_logits_is_refused():
    with pytest.raises(ConfigError, match=r"maps ids \[1, 16\] to \[1, 16\]; expected logits"):
        build_model(_config("model.factory=torch.nn:Identity"))


@pytest.mark.parametrize("backend", ["popxl", "distributed"])
def test_backends_that_split_the_gpt_refuse_a_given_model(backend):
    with pytest.raises(ConfigError, match=f"not backend '{backend}'"):
        check_given_model(_config(), backend, capabilities(backend).trains_given_model)


def test_a_pipeline_or_the_masked_lm_refuses_a_given_model():
    pipelined = _config("ipu.ipus_per_replica=2", "ipu.layers_per_ipu=[1, 1]",
                        "ipu.gradient_accumulation=4")
    with pytest.raises(ConfigError, match="one IPU per replica"):
        check_given_model(pipelined, "emulator")
    with pytest.raises(ConfigError, match="model.factory"):
        MaskedLM().check(_config("model.parametrization=unit"), "cpu")


def test_a_run_saved_before_the_factory_key_still_loads(tmp_path):
    import yaml

    raw = Config().to_dict()
    del raw["model"]["factory"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    assert load_run_config(tmp_path).model.factory is None  # the GPT, as that run trained


def test_fp16_simulation_keeps_the_library_readouts_scale():
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.training.precision import simulate_fp16

    torch.manual_seed(0)
    exact = uu.LinearReadout(64, 10)
    half = simulate_fp16(nn.Sequential(copy.deepcopy(exact)))
    x = torch.randn(4, 64, requires_grad=True)
    x_half = x.detach().clone().requires_grad_()
    want, got = exact(x), half(x_half)
    # float16 keeps 11 significant bits: each rounding is within 2**-11 relative.
    torch.testing.assert_close(got, want, rtol=4e-3, atol=4e-3 * want.abs().max().item())
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(x_half.grad, x.grad, rtol=4e-3,
                               atol=4e-3 * x.grad.abs().max().item())


def test_compare_refuses_a_given_model(tmp_path, text_file):
    refused = _command("compare", "--config", "tiny", "--run-dir", str(tmp_path / "c"),
                       "--regimes", "fp32", "unit-fp32", "--set", f"data.path={text_file}",
                       *ONE_STAGE, f"model.factory={FACTORY}")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.factory: compare trains the GPT" in lines[0], lines


@pytest.mark.ipu
def test_given_model_on_the_ipu_model_matches_the_emulator(step_losses):
    pytest.importorskip("poptorch")  # only where the Poplar SDK is installed
    config = _config("ipu.device_iterations=2", "ipu.executable_cache_dir=null",
                     "training.learning_rate=1.0")
    emulated = step_losses(copy.deepcopy(config), "emulator", 3)
    on_ipu_model = step_losses(config, "ipu_model", 3)
    assert torch.isfinite(on_ipu_model).all()
    assert torch.allclose(on_ipu_model, emulated, rtol=1e-4, atol=0)


def test_sweep_of_a_given_model_refuses_plain_and_sweeps_its_two_rate_rules(tmp_path, text_file):
    """A given model is the same model in every kind: plain would train it again under a name
    that says it is not unit-scaled."""
    common = ["--config", "tiny", "--widths", "32", "--quiet", "--set", f"data.path={text_file}",
              "training.steps=2", *ONE_STAGE, f"model.factory={FACTORY}"]
    refused = _command("sweep", "--models", "plain", "unit", "--run-dir",
                       str(tmp_path / "refused"), *common)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "--models plain: model.factory" in lines[0], lines
    run_dir = tmp_path / "sweep"
    swept = _command("sweep", "--run-dir", str(run_dir), "--log2-lr", "unit=-6:-6",
                     "u-mup=-1:-1", *common)
    assert swept.returncode == 0, swept.stderr
    assert sorted(path.name for path in run_dir.iterdir() if path.is_dir()) == ["u-mup", "unit"]
    for kind, parametrization in (("unit", "unit"), ("u-mup", "u-mup")):
        (point,) = [path for path in (run_dir / kind).rglob("config.yaml")]
        saved = load_run_config(point.parent)
        assert saved.model.factory == FACTORY and saved.model.hidden_size == 32
        assert saved.model.parametrization == parametrization
