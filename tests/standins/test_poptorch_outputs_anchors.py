"""Anchored tensors: ``getTensorNames`` lists the compiled graph's tensors with PopART's names,
``getAnchoredTensor`` returns an anchored one's value from the last call, by output mode."""
from __future__ import annotations

from typing import List

import pytest
import torch

import ipu_standins.poptorch as poptorch

_U = 2.0 ** -24  # float32 unit roundoff


def _gamma(n: int) -> float:
    return n * _U / (1 - n * _U)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 10)
        self.relu = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(10, 10)
        self.loss = torch.nn.MSELoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor = None):
        out = self.fc2(self.relu(self.fc1(x)))
        if self.training:
            return self.loss(out, labels)
        return out


def _anchored(*anchors) -> poptorch.Options:
    options = poptorch.Options()
    for anchor in anchors:
        options.anchorTensor(*anchor)
    return options


def test_tensor_names_need_a_compiled_model_and_follow_poptorchs_names():
    model = poptorch.trainingModel(_Model())
    with pytest.raises(AssertionError, match="must be compiled"):
        model.getTensorNames()
    model.compile(torch.rand(10, 10), torch.rand(10, 10))
    names = model.getTensorNames()
    for name in ("input", "input/1", "fc1.weight", "fc1/addmm:0", "fc2/addmm:0",
                 "Gradient___fc2.bias", "UpdatedVar___fc1.weight",
                 "scaledLearningRate0___default___FLOAT",
                 "weightDecayScaleFactor0___default___FLOAT"):
        assert name in names
    assert any(n.startswith("loss/") for n in names)
    assert len(set(names)) == len(names)


def test_an_inference_model_has_no_gradients_and_anchors_an_activation():
    torch.manual_seed(0)
    net = _Model().eval()
    model = poptorch.inferenceModel(net, _anchored(("hidden", "fc1/addmm:0")))
    x = torch.rand(4, 10)
    model(x)
    assert not any(n.startswith("Gradient___") for n in model.getTensorNames())
    hidden = model.getAnchoredTensor("hidden")
    expected = net.fc1(x).detach()
    # 10 products and 11 sums per element.
    bound = _gamma(11) * (x.abs() @ net.fc1.weight.abs().T + net.fc1.bias.abs()).detach()
    assert torch.all((hidden - expected).abs() <= bound)


def test_a_gradient_and_the_updated_weight_match_the_loss_and_sgd():
    torch.manual_seed(0)
    net = _Model()
    before = net.fc2.bias.detach().clone()
    # The weights the call computes with (reading them afterwards gives the trained ones).
    w1, b1 = net.fc1.weight.detach().double(), net.fc1.bias.detach().double()
    w2 = net.fc2.weight.detach().double()
    options = _anchored(("g", "Gradient___fc2.bias"), ("w", "UpdatedVar___fc2.bias"),
                        ("lr", "scaledLearningRate0___default___FLOAT"))
    model = poptorch.trainingModel(net, options,
                                   poptorch.optim.SGD(net.parameters(), lr=0.1))
    x, labels = torch.rand(10, 10), torch.rand(10, 10)
    model(x, labels)
    gradient = model.getAnchoredTensor("g")
    # MSE's gradient for the output bias: 2 / 100 * the column sums of (out - labels),
    # computed here in float64 from the same weights.
    hidden = torch.relu(x.double() @ w1.T + b1)
    out = hidden @ w2.T + before.double()
    expected = 2.0 / 100 * (out - labels.double()).sum(0)
    magnitude = (x.double().abs() @ w1.abs().T + b1.abs()) @ w2.abs().T + before.abs().double()
    # The float32 forward: two 11-term dot products; then the subtraction, 10-term sum, scale.
    bound = 2.0 / 100 * (_gamma(24) * magnitude + _gamma(13) * (
        magnitude + labels.double().abs())).sum(0)
    assert torch.all((gradient.double() - expected).abs() <= bound)
    # SGD without momentum: w - lr * g, one product and one difference, rounded.
    updated = model.getAnchoredTensor("w")
    assert torch.all((updated - (before - 0.1 * gradient)).abs()
                     <= 2 * _U * (before.abs() + 0.1 * gradient.abs()))
    assert model.getAnchoredTensor("lr").item() == pytest.approx(0.1, rel=_U)


def _iterations(mode: poptorch.OutputMode, period: int = 1) -> List[torch.Tensor]:
    """The anchored input over a call of 4 device iterations (one row each), by mode."""
    options = poptorch.Options().deviceIterations(4)
    options.anchorTensor("x", "input", mode, period)
    model = poptorch.inferenceModel(_Model().eval(), options)
    x = torch.arange(40.0).reshape(4, 10)
    model(x)
    return model.getAnchoredTensor("x")


def test_output_modes_apply_to_anchors_as_to_outputs():
    x = torch.arange(40.0).reshape(4, 10)
    assert torch.equal(_iterations(poptorch.OutputMode.All), x.reshape(4, 1, 10))
    assert torch.equal(_iterations(poptorch.OutputMode.Final), x[3:])
    assert torch.equal(_iterations(poptorch.OutputMode.Sum), x.sum(0, keepdim=True))
    assert torch.equal(_iterations(poptorch.OutputMode.EveryN, 2), x[[1, 3]].reshape(2, 1, 10))


def test_an_anchor_without_a_mode_takes_the_models_output_mode():
    options = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    options.anchorTensor("x", "input")
    model = poptorch.inferenceModel(_Model().eval(), options)
    x = torch.rand(4, 10)
    model(x)
    assert torch.equal(model.getAnchoredTensor("x"), x.reshape(2, 2, 10))


def test_an_anchor_naming_no_tensor_is_refused_and_an_unknown_short_name_asserts():
    model = poptorch.inferenceModel(_Model().eval(), _anchored(("g", "Gradient___fc1.weight")))
    with pytest.raises(poptorch.Error, match="'Gradient___fc1.weight'.*not a tensor of the "
                       "graph"):
        model(torch.rand(2, 10))
    model = poptorch.inferenceModel(_Model().eval())
    model(torch.rand(2, 10))
    with pytest.raises(AssertionError, match="No tensor with name grad_w found"):
        model.getAnchoredTensor("grad_w")


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 32)
        self.fc2 = torch.nn.Linear(32, 10)
        self.log_softmax = torch.nn.LogSoftmax(dim=0)
        self.loss = torch.nn.NLLLoss()
        self.relu = torch.nn.ReLU()

    def forward(self, x, labels=None):
        x = self.log_softmax(self.fc2(self.relu(self.fc1(torch.flatten(x, start_dim=1)))))
        if self.training:
            return x, self.loss(x, labels)
        return x


def test_gradients_of_an_mnist_style_classifier_over_a_dataloader():
    """Graphcore's "observing tensors" tutorial, on synthetic images: every gradient
    anchored, the model compiled and its names listed, trained over a DataLoader, and the
    anchored gradients gathered for a histogram."""
    torch.manual_seed(0)
    gradients = [f"Gradient___{layer}.{kind}" for layer in ("fc1", "fc2")
                 for kind in ("weight", "bias")]
    options = poptorch.Options()
    for name in gradients:
        options.anchorTensor(name, name)
    images = torch.rand(64, 1, 28, 28)
    labels = torch.randint(0, 10, (64,))
    loader = poptorch.DataLoader(options, torch.utils.data.TensorDataset(images, labels),
                                 batch_size=16, shuffle=True)
    net = _Classifier()
    model = poptorch.trainingModel(net, options, poptorch.optim.SGD(net.parameters(), lr=0.01))
    model.compile(torch.zeros(16, 1, 28, 28), torch.zeros(16).long())
    assert set(gradients) <= set(model.getTensorNames())
    losses = []
    for data, target in loader:
        output, loss = model(data, target)
        assert output.shape == (16, 10)
        losses.append(loss)
    assert len(losses) == 4 and all(torch.isfinite(torch.stack(losses)))
    values = torch.cat([model.getAnchoredTensor(n).flatten() for n in gradients])
    assert values.shape == (784 * 32 + 32 + 32 * 10 + 10,)
    assert torch.all(torch.isfinite(values)) and bool((values != 0).any())


def test_with_automatic_loss_scaling_the_final_loss_scale_is_a_tensor():
    net = _Model().half()  # (automatic loss scaling tracks float16 gradients)
    options = poptorch.Options()
    options.Training.setAutomaticLossScaling(True)
    options.anchorTensor("scale", "finalLossScale")
    optimizer = poptorch.optim.SGD(net.parameters(), lr=0.0, loss_scaling=2.0)
    model = poptorch.trainingModel(net, options, optimizer)
    model(torch.rand(10, 10).half(), torch.rand(10, 10).half())
    assert "finalLossScale" in model.getTensorNames()
    # The scale the step started from: the loss scaling, times a factor that starts at 1.
    assert float(model.getAnchoredTensor("scale")) == 2.0
    plain = poptorch.trainingModel(_Model())
    plain.compile(torch.rand(10, 10), torch.rand(10, 10))
    assert "finalLossScale" not in plain.getTensorNames()
