"""Fixtures shared by several test files; plain helper functions and constants are in
``helpers.py``."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from helpers import ROOT, TEXT, built_native_layers, require_host_library, run, train_args


def _step_losses(config, backend: str, calls: int) -> torch.Tensor:
    """Per-step losses of ``calls`` training-model calls of the config's GPT on ``backend``,
    from the same seed and the same random token batches whatever the backend."""
    from ipu_unit_scaling.backends import build_training_model, make_optimizer
    from ipu_unit_scaling.training.precision import build_model

    torch.manual_seed(0)
    model = build_model(config)
    optimizer = make_optimizer(model, config, backend=backend)
    wrapper = build_training_model(model, optimizer, config, backend=backend)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(calls):
        ids = torch.randint(0, config.model.vocab_size, (config.samples_per_call, 9),
                            generator=generator)
        _, loss = wrapper(ids[:, :-1], ids[:, 1:])
        losses.append(loss.view(config.ipu.device_iterations, -1).mean(1))
    wrapper.destroy()
    return torch.cat(losses)


@pytest.fixture
def step_losses() -> Callable[..., torch.Tensor]:
    """``step_losses(config, backend, calls)``: see :func:`_step_losses`."""
    return _step_losses


# Fixtures shared by several test files (plain helper functions are in helpers.py). A test
# file that wants one for all of its tests names it in ``pytestmark``:
# ``pytestmark = pytest.mark.usefixtures("one_thread")``.


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for the module, then as before. The tests' ops are small and the
    machine's cores shared: extra threads only contend (one test ran 5x slower), and one
    thread keeps each kernel's summation order the same from call to call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test from the repository root (paths such as ``configs/`` relative to it)."""
    monkeypatch.chdir(ROOT)


@pytest.fixture
def ops_as_torch_defines_them() -> Iterator[None]:
    """Traces compute every op as torch defines it. What an IPU computes differently (GELU,
    stochastic rounding) is emulated by default and tested by the tests of ops/ipu_lowering.py."""
    from ipu_unit_scaling.ops.ipu_lowering import torch_numerics

    with torch_numerics():
        yield


@pytest.fixture
def host_library() -> None:
    """The FP8 host library is built: see :func:`helpers.require_host_library`."""
    require_host_library()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A text file of :data:`helpers.TEXT` for a training run."""
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def finished(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> Path:
    """A finished 4-step ``tiny`` run from the CLI, checkpoints at steps 2 and 4."""
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=4",
                                   "training.checkpoint_interval=2"))[0] == 0
    return run_dir


@pytest.fixture(scope="module")
def word_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text of 3000 words drawn from 14, made once per module: the torchrun tests' data."""
    words = "the quick brown fox jumps over the lazy dog and runs far from home".split()
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(words), (3000,), generator=generator).tolist()
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(words[i] for i in picks))
    return path


@pytest.fixture
def standin_calls(monkeypatch):
    """The PopTorch stand-in's ``custom_op`` calls, recorded on their way to it (the stand-in
    computes them: the package's ``torch.library`` ops)."""
    from ipu_unit_scaling.backends.poptorch_backend import poptorch_module

    standin = poptorch_module("emulator")
    calls: list = []
    run = standin.custom_op

    def recorded(inputs, name, domain, domain_version, example_outputs, attributes):
        calls.append((name, domain, domain_version, attributes))
        return run(inputs, name, domain, domain_version, example_outputs=example_outputs,
                   attributes=attributes)

    monkeypatch.setattr(standin, "custom_op", recorded)
    return calls


@pytest.fixture(scope="session", autouse=True)
def native_layers_built() -> None:
    """The C++ layer nodes built (or found wanting) before any test runs, so that no test,
    nor a command line a test starts, meets the one-off build and its line on stderr."""
    from ipu_unit_scaling.ops import native_layers

    native_layers.module()


@pytest.fixture(params=["python", "native"])
def layer_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each float transformer layer as two Python autograd Functions, or as their C++ nodes
    (`ops.native_layers`). The C++ form is skipped only where it cannot be built for want of
    a compiler or ninja, or is switched off; a failed build is a failure."""
    from ipu_unit_scaling.ops import native_layers

    if request.param == "python":
        monkeypatch.setattr(native_layers, "module", lambda: None)
    else:
        built_native_layers()
    return str(request.param)
