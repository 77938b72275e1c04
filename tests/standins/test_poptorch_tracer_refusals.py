"""What PopTorch refuses while tracing, the emulator refuses too, naming the op and the module.

Each refusal follows a check in graphcore/poptorch (commit c2a8b17762f1): the dispatcher's
``RegisterAtenOverloads.cpp`` and the handlers in ``popart_canonicalization/``. Ops on
compile-time constants are evaluated on the host before any handler runs
(``EvaluateConstexprs.cpp``), so the same op is accepted there.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_unit_scaling.ipu import PopTorchError, check_poptorch, trace_like_poptorch


class Block(nn.Module):
    """Runs ``fn(block, x)``; has a weight and a buffer to compute from."""

    def __init__(self, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("mask", torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


class Model(nn.Module):
    """The block sits at ``encoder.block``, the module path a refusal must name."""

    def __init__(self, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.block = Block(fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder.block(x)


def refused(fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], op: Union[str, Tuple[str, ...]],
            x: Optional[torch.Tensor] = None) -> str:
    """The one-line message with which tracing ``fn`` is refused; it names ``op`` (or one of
    several names) and the module ``encoder.block``."""
    x = torch.randn(4, 4) if x is None else x
    with pytest.raises(PopTorchError) as caught:
        trace_like_poptorch(Model(fn), x)
    message = str(caught.value)
    names = (op,) if isinstance(op, str) else op
    assert any(message.startswith(f"{name} in encoder.block: ") for name in names), message
    assert "\n" not in message
    return message


def accepted(fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
             x: Optional[torch.Tensor] = None) -> None:
    """``fn`` traces with supported ops only, and the traced graph computes eager's values."""
    x = torch.randn(4, 4) if x is None else x
    model = Model(fn)
    assert check_poptorch(model, x).ok
    torch.testing.assert_close(trace_like_poptorch(model, x)(x), model(x))


# ------------------------------------------------------------------ moves and host reads


@pytest.mark.parametrize("move, op", [
    (lambda t: t.cpu(), "Tensor.cpu"),
    (lambda t: t.to("cpu"), "Tensor.to"),
    (lambda t: t.to(torch.device("cpu")), "Tensor.to"),
    (lambda t: t.to(device="cpu", dtype=torch.float16), "Tensor.to"),
], ids=["cpu()", "to('cpu')", "to(device)", "to(device=, dtype=)"])
def test_a_move_to_the_cpu_inside_forward_is_refused(move, op):
    message = refused(lambda m, x: move(x @ m.weight) + 1, op)
    assert "move to the CPU" in message


def test_moves_that_stay_on_the_device_are_accepted():
    # On the IPU, x.device is the IPU: these stay there. Dtype casts are fine too.
    accepted(lambda m, x: (x @ m.weight).to(x.device) + x.to(x) + x.to(torch.float16).float())


@pytest.mark.parametrize("read", ["numpy", "tolist"])
def test_reading_a_tensor_on_the_host_is_refused(read):
    # Newer torch's fake tensors implement tolist() with item(): then the read is named there.
    names = (f"Tensor.{read}", "aten::_local_scalar_dense")
    message = refused(lambda m, x: torch.tensor(getattr(x @ m.weight, read)()), names)
    assert "read on the host" in message


# ------------------------------------------------------------------ triu and tril


@pytest.mark.parametrize("op", ["triu", "tril"])
@pytest.mark.parametrize("source", [
    lambda m, x: x,
    lambda m, x: m.weight,
    lambda m, x: m.mask,  # buffers are graph inputs too, not constants
    lambda m, x: torch.ones(4, 4) + torch.rand(4, 4),  # random values are not constants
], ids=["input", "parameter", "buffer", "random"])
def test_triu_and_tril_of_a_tensor_that_is_not_constant_are_refused(op, source):
    message = refused(lambda m, x: getattr(source(m, x), op)(1) * x, f"aten::{op}")
    assert "constant" in message


@pytest.mark.parametrize("op", ["triu", "tril", "triu_"])
def test_triu_and_tril_of_a_constant_are_folded_and_accepted(op):
    # The causal mask of an attention: built from Python values inside forward.
    def masked(m, x):
        mask = getattr(torch.ones(4, 4, dtype=torch.bool), op)(1)
        return (x @ m.weight).masked_fill(mask, 0.0)

    accepted(masked)


def test_a_constant_written_with_a_variable_is_no_longer_constant():
    def written(m, x):
        mask = torch.zeros(4, 4)
        mask.add_(x)
        return mask.triu()

    refused(written, "aten::triu")


def test_ops_without_a_handler_are_accepted_on_constants_only():
    # erfinv has no handler: on a constant PopTorch evaluates it on the host.
    accepted(lambda m, x: x @ m.weight + torch.erfinv(torch.full((4,), 0.5)))
    report = check_poptorch(Model(lambda m, x: torch.erfinv(x @ m.weight)), torch.rand(4, 4),
                            strict=False)
    assert report.unsupported == {"aten::erfinv": ["encoder.block"]}


# ------------------------------------------------------------------ other handlers' arguments


def test_embedding_with_scale_grad_by_freq_is_refused():
    ids = torch.randint(0, 4, (2, 3))
    refused(lambda m, x: F.embedding(x, m.weight, scale_grad_by_freq=True), "aten::embedding",
            ids)
    accepted(lambda m, x: F.embedding(x, m.weight), ids)


def test_cross_entropy_with_class_weights_is_refused():
    labels = torch.tensor([0, 1, 2, 3])
    message = refused(
        lambda m, x: F.cross_entropy(x @ m.weight, x[:, 0].long(), weight=torch.ones(4)),
        "aten::nll_loss_forward", labels.float()[:, None].expand(4, 4))
    assert "LossOps.cpp" in message
    accepted(lambda m, x: F.cross_entropy(x @ m.weight, x[:, 0].long()),
             labels.float()[:, None].expand(4, 4).contiguous())


def test_layer_norm_with_weight_and_no_bias_reaches_poptorch_with_a_zero_bias():
    # PopTorch's handler takes both or neither: called directly, the op is refused...
    refused(lambda m, x: torch.native_layer_norm(x, (4,), m.weight[0], None, 1e-5)[0],
            "aten::native_layer_norm")
    # ...and F.layer_norm (nn.LayerNorm without bias) gets a constant zero bias first.
    accepted(lambda m, x: F.layer_norm(x, (4,), m.weight[0], None))
    accepted(lambda m, x: F.layer_norm(x, (4,), m.weight[0], m.weight[1]))


@pytest.mark.parametrize("op", ["bitwise_and", "bitwise_or", "bitwise_xor"])
def test_bitwise_ops_on_8_bit_integers_are_refused(op):
    codes = torch.randint(0, 255, (4, 4), dtype=torch.uint8)
    message = refused(lambda m, x: getattr(torch, op)(x, x), f"aten::{op}", codes)
    assert "8-bit" in message
    accepted(lambda m, x: getattr(torch, op)(x.int(), x.int()), codes)


def test_bincount_without_a_minimum_length_is_refused_in_poptorchs_words():
    ids = torch.randint(0, 4, (6,))
    message = refused(lambda m, x: torch.bincount(x), "aten::bincount", ids)
    assert "Bincount `minlength` must be specified and must be a constant." in message
    accepted(lambda m, x: torch.bincount(x, minlength=4), ids)


def test_one_hot_without_a_class_count_is_refused():
    ids = torch.randint(0, 4, (2, 3))
    message = refused(lambda m, x: F.one_hot(x), "aten::one_hot", ids)
    assert "OneHot num classes must be specified and must be constant." in message  # PopTorch's
    accepted(lambda m, x: F.one_hot(x, 4), ids)


def test_adaptive_pooling_to_sizes_that_do_not_divide_is_refused():
    x = torch.randn(1, 2, 6, 6)
    message = refused(lambda m, x: F.adaptive_avg_pool2d(x * m.weight[0, 0], 4),
                      "aten::adaptive_avg_pool2d", x)
    assert "(6, 6)" in message and "(4, 4)" in message
    accepted(lambda m, x: F.adaptive_avg_pool2d(x * m.weight[0, 0], 3), x)


def test_as_strided_is_refused():
    refused(lambda m, x: torch.as_strided(x @ m.weight, (2, 2), (1, 2)), "aten::as_strided")
