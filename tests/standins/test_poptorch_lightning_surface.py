"""The parts of a ``PoplarExecutor`` that Lightning's IPU strategies read (lightning-graphcore's
``IPUStrategy`` and Lightning 2.0's own): ``_executable``, None until the model compiles and
after ``destroy``, as in PopTorch's python/_poplar_executor.py; the options it reads back; and
the detach and attach between a fit's training and validation models."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ipu_standins.poptorch as poptorch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, target=None):
        out = self.fc(x)
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


def _batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=generator), torch.arange(8) % 3


def test_executable_is_none_until_compiled_and_after_destroy():
    net = _Net()
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert training._executable is None
    x, y = _batch()
    training(x, y)
    assert training._executable is not None and training.isCompiled()
    training.destroy()
    assert training._executable is None and not training.isCompiled()


def test_the_options_lightning_reads_back():
    options = poptorch.Options().deviceIterations(2).replicationFactor(2)
    options.Training.gradientAccumulation(3)
    net = _Net()
    training = poptorch.trainingModel(net, options, torch.optim.SGD(net.parameters(), lr=0.1))
    assert training._options.toDict()["replication_factor"] == 2
    assert (options.device_iterations, options.replication_factor,
            options.Training.gradient_accumulation) == (2, 2, 3)


def test_a_fit_detaches_the_training_model_to_validate_and_attaches_it_again():
    net = _Net()
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
    validation = poptorch.inferenceModel(net)
    x, y = _batch()
    training(x, y)
    assert training.isAttachedToDevice()
    training.detachFromDevice()  # the strategy's _load_model before validation
    trained, bias = net.fc.weight.detach().clone(), net.fc.bias.detach()
    # Four products and a bias summed in float32: each output within 5 roundings of its terms.
    bound = 5 * 2.0**-24 * (x.abs() @ trained.abs().T + bias.abs())
    assert ((validation(x) - F.linear(x, trained, bias)).abs() <= bound).all()
    validation.detachFromDevice()
    training.attachToDevice()
    training(x, y)
    training.detachFromDevice()
    assert not torch.equal(net.fc.weight.detach(), trained)


def test_an_eval_batch_norm_runs_under_inference_mode_as_lightning_validates():
    # Lightning validates and tests inside torch.inference_mode, where torch >= 2.1 hands the
    # dispatcher an eval batch norm under a name that torch 2.0.1 (PopTorch's) did not use.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    x, _ = _batch()
    with torch.inference_mode():
        out = poptorch.inferenceModel(model)(x)
    expected = model(x)
    # Each output: a 4-term dot product and bias, then a shift and a scale by a stored
    # statistic, in float32: within 10 roundings of the magnitudes involved.
    norm = model[1]
    scale = (norm.weight / (norm.running_var + norm.eps).sqrt()).abs().detach()
    pre = x.abs() @ model[0].weight.abs().T + model[0].bias.abs() + norm.running_mean.abs()
    bound = 10 * 2.0**-24 * (pre * scale + norm.bias.abs()).detach()
    assert ((out - expected).abs() <= bound).all()
