"""The losses PopTorch's dispatcher takes whole: the traceable CTC loss against torch's, and
both CTC and hinge embedding losses compiled and trained by the stand-in."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._losses import ctc_loss


def _gamma(n: int, unit: float) -> float:
    return n * unit / (1 - n * unit)


def _case(blank: int, seed: int = 0, steps: int = 10, batch: int = 4, classes: int = 5,
          width: int = 6):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(steps, batch, classes, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, classes - 1, (batch, width), generator=generator)
    targets[targets >= blank] += 1  # labels other than the blank
    target_lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    input_lengths = torch.randint(steps - 3, steps + 1, (batch,), generator=generator)
    return logits.requires_grad_(), targets, input_lengths, target_lengths


def _bound(log_probs: torch.Tensor, reduction: str) -> torch.Tensor:
    """Rounding of the float64 forward recursion: each of the T steps adds a logsumexp of
    three terms and a sum, a few unit roundoffs of the path score, which is at most the sum
    over time of the largest |log-probability|."""
    per_sequence = _gamma(8 * log_probs.shape[0], 2.0 ** -53) * (
        log_probs.detach().abs().amax(-1).sum(0))
    return per_sequence if reduction == "none" else per_sequence.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("blank", [0, 3])
@pytest.mark.parametrize("as_lists", [False, True])
def test_ctc_loss_and_its_gradient_through_log_softmax_match_torch(reduction, blank, as_lists):
    logits, targets, input_lengths, target_lengths = _case(blank)
    lengths = (input_lengths.tolist(), target_lengths.tolist()) if as_lists else (
        input_lengths, target_lengths)
    log_probs = logits.log_softmax(-1)
    expected = F.ctc_loss(log_probs, targets, *lengths, blank=blank, reduction=reduction)
    ours = ctc_loss(log_probs, targets, *lengths, blank=blank, reduction=reduction)
    assert torch.all((ours - expected).abs() <= _bound(log_probs, reduction))
    # Torch's kernel returns a gradient that is right only after log_softmax's backward;
    # compare there.
    (grad_expected,) = torch.autograd.grad(expected.sum(), logits, retain_graph=True)
    (grad_ours,) = torch.autograd.grad(ours.sum(), logits)
    scale = float(_bound(log_probs, "sum")) * logits.shape[0]
    assert torch.all((grad_ours - grad_expected).abs() <= scale)


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_an_impossible_alignment_is_infinite_or_zero_with_zero_gradient(zero_infinity):
    logits = torch.randn(3, 1, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1, 1, 2, 2]])  # repeats need 6 steps, there are 3
    log_probs = logits.log_softmax(-1)
    loss = ctc_loss(log_probs, targets, [3], [4], zero_infinity=zero_infinity,
                    reduction="sum")
    expected = F.ctc_loss(log_probs, targets, [3], [4], zero_infinity=zero_infinity,
                          reduction="sum")
    assert torch.equal(loss, expected)
    if zero_infinity:
        (gradient,) = torch.autograd.grad(loss, logits)
        assert torch.equal(gradient, torch.zeros_like(gradient))


def test_concatenated_targets_with_list_lengths():
    logits, targets, input_lengths, target_lengths = _case(blank=0, seed=1)
    lengths = target_lengths.tolist()
    flat = torch.cat([row[:n] for row, n in zip(targets, lengths)])
    log_probs = logits.log_softmax(-1)
    steps = input_lengths.tolist()
    expected = F.ctc_loss(log_probs, flat, steps, lengths, reduction="none")
    ours = ctc_loss(log_probs, flat, steps, lengths, reduction="none")
    assert torch.all((ours - expected).abs() <= _bound(log_probs, "none"))
    with pytest.raises(poptorch.Error, match="concatenated"):
        ctc_loss(log_probs, flat, input_lengths, target_lengths)


class _Trained(torch.nn.Module):
    def __init__(self, loss) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)
        self.loss = loss

    def forward(self, x, *rest):
        out = self.lin(x)
        return out, self.loss(out, *rest)


def _first_call_loss(loss, x, *rest):
    """The stand-in's loss on the first call, the host's, and the host's outputs."""
    torch.manual_seed(0)
    net = _Trained(loss)
    with torch.no_grad():
        out, expected = net(x, *rest)
        magnitude = x.abs() @ net.lin.weight.abs().T + net.lin.bias.abs()
    _, got = poptorch.trainingModel(net)(x, *rest)
    return got, expected, out, magnitude


def test_ctc_loss_compiles_and_trains_in_a_training_model():
    _, targets, input_lengths, target_lengths = _case(blank=0)
    x = torch.randn(10, 4, 5)

    def loss(out, targets, input_lengths, target_lengths):
        return F.ctc_loss(out.log_softmax(-1), targets, input_lengths, target_lengths)

    got, expected, out, magnitude = _first_call_loss(loss, x, targets, input_lengths,
                                                     target_lengths)
    # float32: the recursion's bound (see _bound) with float32's unit roundoff, plus the
    # linear layer's 5-term dot products and log_softmax's few ops on each log-probability.
    scores = (out.log_softmax(-1).abs() + magnitude).amax(-1).sum(0).sum()
    assert abs(float(got) - float(expected)) <= _gamma(8 * 10 + 12, 2.0 ** -24) * float(scores)


def test_hinge_embedding_loss_compiles_and_trains_in_a_training_model():
    x = torch.rand(3, 5)
    target = torch.tensor([[1, -1, 1, -1, 1]] * 3, dtype=torch.float32)
    got, expected, _, magnitude = _first_call_loss(
        lambda out, t: F.hinge_embedding_loss(out, t, margin=0.7), x, target)
    # Each of the 15 terms is an output or (0.7 - output): a 5-term dot product and one more
    # op; then a 15-term mean.
    bound = _gamma(6 + 1 + 16, 2.0 ** -24) * float((magnitude + 0.7).mean())
    assert abs(float(got) - float(expected)) <= bound
