"""``groupNormStridedChannelGrouping``: channel ``c`` in group ``c % groups``, as PopART's own
reference for the option reorders them (``tests/integration/operators_test/groupnorm_test.py``),
with the affine weight and bias per channel; without the option, torch's contiguous groups."""
from __future__ import annotations

import torch

import ipu_standins.poptorch as poptorch


def _strided_reference(x: torch.Tensor, norm: torch.nn.GroupNorm) -> torch.Tensor:
    """Each strided group normalised on its own, written independently of the stand-in."""
    out = torch.empty_like(x)
    groups, channels = norm.num_groups, norm.num_channels
    for g in range(groups):
        members = list(range(g, channels, groups))
        part = x[:, members]
        dims = tuple(range(1, part.dim()))
        mean = part.mean(dim=dims, keepdim=True)
        var = part.var(dim=dims, unbiased=False, keepdim=True)
        out[:, members] = (part - mean) / torch.sqrt(var + norm.eps)
    shape = (1, channels) + (1,) * (x.dim() - 2)
    return out * norm.weight.reshape(shape) + norm.bias.reshape(shape)


def _norm() -> torch.nn.GroupNorm:
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(2, 6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm


def test_strided_channel_grouping_normalises_channels_c_mod_groups_together():
    norm = _norm()
    x = torch.randn(3, 6, 4) * torch.arange(1.0, 7.0).reshape(1, 6, 1)
    options = poptorch.Options()
    options._Popart.set("groupNormStridedChannelGrouping", True)
    out = poptorch.inferenceModel(norm, options)(x)
    torch.testing.assert_close(out, _strided_reference(x.detach(), norm).detach())
    assert not torch.allclose(out, norm(x), atol=1e-2)


def test_without_the_option_the_groups_are_contiguous_as_in_torch():
    norm = _norm()
    x = torch.randn(3, 6, 4)
    torch.testing.assert_close(poptorch.inferenceModel(norm)(x), norm(x).detach())


def test_strided_grouping_trains():
    norm = _norm()
    options = poptorch.Options()
    options._Popart.set("groupNormStridedChannelGrouping", True)

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = norm

        def forward(self, x: torch.Tensor):
            out = self.norm(x)
            return out, poptorch.identity_loss((out * torch.arange(6.0).reshape(1, 6, 1)).sum(),
                                               reduction="none")

    before = norm.weight.detach().clone()
    model = poptorch.trainingModel(Loss(), options,
                                   optimizer=torch.optim.SGD(norm.parameters(), lr=0.1))
    model(torch.randn(3, 6, 4))
    assert not torch.equal(norm.weight.detach(), before)
