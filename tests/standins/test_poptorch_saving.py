"""``PoplarExecutor.save``/``compileAndExport``, ``loadExecutable`` and ``poptorch.load`` of the
PopTorch stand-in, against PopTorch's (python/_poplar_executor.py, python/__init__.py): a saved
executable restores the model, its options and its mode; one saved without the model needs
the model re-created and ``loadExecutable``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ipu_standins.poptorch as poptorch


class _WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, target=None):
        out = self.fc(x)
        if self.training:
            return out, F.cross_entropy(out, target)
        return out


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, generator=generator), torch.tensor([0, 2])


def test_an_exported_inference_model_loads_compiled_with_its_weights_and_options(tmp_path):
    torch.manual_seed(0)
    model = _WithLoss().eval()
    x, _ = _inputs()
    ipu = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    ipu.compileAndExport(str(tmp_path / "m.poptorch"), x)
    model.fc.weight.data.zero_()  # the file holds a copy, not the live model

    loaded = poptorch.load(str(tmp_path / "m.poptorch"))
    assert loaded.isCompiled() and not loaded.training
    assert loaded.options.device_iterations == 2
    assert not torch.equal(loaded.model.fc.weight, model.fc.weight)
    expected = F.linear(x, loaded.model.fc.weight, loaded.model.fc.bias)
    torch.testing.assert_close(loaded(x), expected.detach())


def test_an_exported_training_model_loads_as_a_training_model_that_trains(tmp_path):
    torch.manual_seed(0)
    x, target = _inputs()
    model = _WithLoss()
    ipu = poptorch.trainingModel(model, poptorch.Options(),
                                 torch.optim.SGD(model.parameters(), lr=0.5))
    ipu.compileAndExport(str(tmp_path / "t.poptorch"), x, target)

    loaded = poptorch.load(str(tmp_path / "t.poptorch"))
    assert loaded.training and loaded.isCompiled()
    losses = [float(loaded(x, target)[1]) for _ in range(20)]
    assert losses[-1] < losses[0]


def test_load_hands_the_options_to_edit_opts_fn_before_the_model_is_made(tmp_path):
    model = _WithLoss().eval()
    x, _ = _inputs()
    poptorch.inferenceModel(model).compileAndExport(str(tmp_path / "m.poptorch"), x)
    seen = []

    def edit(opts):
        seen.append(opts)
        opts.randomSeed(7)

    loaded = poptorch.load(str(tmp_path / "m.poptorch"), edit_opts_fn=edit)
    assert len(seen) == 1 and seen[0].random_seed == 7
    assert loaded.options.random_seed == 7


def test_without_the_model_load_refuses_and_load_executable_compiles(tmp_path):
    x, target = _inputs()
    path = str(tmp_path / "exe.poptorch")
    poptorch.trainingModel(_WithLoss()).compileAndExport(path, x, target, export_model=False)
    with pytest.raises(AssertionError, match="export_model=False"):
        poptorch.load(path)
    fresh = poptorch.trainingModel(_WithLoss())
    assert not fresh.isCompiled()
    fresh.loadExecutable(path)
    assert fresh.isCompiled()
    assert fresh(x, target)[1].shape == ()


def test_save_into_a_directory_writes_model_poptorch_and_makes_missing_folders(tmp_path):
    model = _WithLoss().eval()
    x, _ = _inputs()
    ipu = poptorch.inferenceModel(model)
    ipu(x)
    ipu.save(str(tmp_path))
    assert (tmp_path / "model.poptorch").is_file()
    ipu.save(str(tmp_path / "new" / "sub" / "m.poptorch"))
    assert (tmp_path / "new" / "sub" / "m.poptorch").is_file()


def test_save_before_compiling_is_refused(tmp_path):
    ipu = poptorch.inferenceModel(_WithLoss().eval())
    with pytest.raises(poptorch.Error, match="not been compiled"):
        ipu.save(str(tmp_path / "m.poptorch"))


def test_a_file_that_is_no_executable_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, str(path))
    with pytest.raises(AssertionError, match="Invalid file"):
        poptorch.load(str(path))
