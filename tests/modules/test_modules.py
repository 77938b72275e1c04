"""Unit-scaled modules: unit init, unit gradients, and a transformer that stays unit end to end."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch
from torch import nn

import ipu_unit_scaling as uu
from ipu_unit_scaling.models import GPTConfig, build_gpt

VOCAB, WIDTH, DEPTH, SEQ, HEADS = 65, 128, 4, 64, 4


def decoder(unit_scaled: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=VOCAB,
        seq_len=SEQ,
        depth=DEPTH,
        hidden_size=WIDTH,
        heads=HEADS,
        unit_scaled=unit_scaled,
    )
    return build_gpt(config)


def batch(size: int = 8, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    return ids, labels


def grad_stds(model: nn.Module) -> dict:
    ids, labels = batch()
    model.zero_grad()
    model(ids, labels).backward()
    return {name: p.grad.std().item() for name, p in model.named_parameters()}


def test_leaf_modules_are_drop_ins_with_unit_init():
    linear = uu.Linear(256, 64, bias=True)
    assert isinstance(linear, nn.Linear)
    assert abs(linear.weight.std().item() - 1) < 0.05
    assert torch.count_nonzero(linear.bias) == 0
    plain = nn.Linear(256, 64)
    plain.load_state_dict(linear.state_dict())
    assert isinstance(uu.LayerNorm(8), nn.LayerNorm)
    assert isinstance(uu.Embedding(10, 8), nn.Embedding)
    assert isinstance(uu.GELU(), nn.GELU)
    assert isinstance(uu.CrossEntropyLoss(), nn.CrossEntropyLoss)


@pytest.mark.parametrize("shape", [(32, 64, 96), (2048, 96)])
def test_linear_module_grads_are_unit(shape):
    torch.manual_seed(0)
    layer = uu.Linear(96, 160, bias=True, constraint=None)
    x = torch.randn(*shape, requires_grad=True)
    out = layer(x)
    out.backward(torch.randn_like(out))
    for name, value in [
        ("output", out.std()),
        ("input grad", x.grad.std()),
        ("weight grad", layer.weight.grad.std()),
        ("bias grad", layer.bias.grad.std()),
    ]:
        assert abs(value.item() - 1) < 0.25, f"{name}: {value.item():.3f}"


def test_layer_norm_and_embedding_module_grads_are_unit():
    torch.manual_seed(0)
    norm = uu.LayerNorm(128, elementwise_affine=True)
    x = torch.randn(16, 64, 128) * 3 + 1
    out = norm(x)
    out.backward(torch.randn_like(out))
    assert abs(norm.weight.grad.std().item() - 1) < 0.25
    assert abs(norm.bias.grad.std().item() - 1) < 0.25
    emb = uu.Embedding(VOCAB, 128)
    ids, _ = batch(32)
    out = emb(ids)
    out.backward(torch.randn_like(out))
    assert abs(out.std().item() - 1) < 0.2
    assert abs(emb.weight.grad.std().item() - 1) < 0.25


def test_small_modules_keep_unit_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 64, 128, requires_grad=True)
    for module in [
        uu.GELU(constraint=None),
        uu.ReLU(constraint=None),
        uu.Softmax(-1, None),
        uu.Dropout(0.3),
    ]:
        x.grad = None
        out = module(x)
        out.backward(torch.randn_like(out))
        assert abs(out.std().item() - 1) < 0.2, module
        assert abs(x.grad.std().item() - 1) < 0.2, module


def test_mhsa_and_mlp_are_unit():
    torch.manual_seed(0)
    x = torch.randn(8, SEQ, WIDTH, requires_grad=True)
    for module in [
        uu.SelfAttention(WIDTH, HEADS, is_causal=True),
        uu.SelfAttention(WIDTH, HEADS, is_causal=False),
        uu.FeedForward(WIDTH),
    ]:
        x.grad = None
        out = module(x)
        out.backward(torch.randn_like(out))
        assert 0.6 < out.std().item() < 1.5, module
        assert 0.6 < x.grad.std().item() < 1.5, module


def test_residual_stream_stays_unit_through_every_layer():
    model = decoder(unit_scaled=True)
    ids, _ = batch()
    hidden = model.embed(ids)
    stds = [hidden.std().item()]
    for layer in model.layers:
        hidden = layer(hidden)
        stds.append(hidden.std().item())
    assert all(0.5 <= s <= 2 for s in stds), stds


def test_every_parameter_gradient_is_near_unit_and_plain_torch_is_far_below():
    unit = grad_stds(decoder(unit_scaled=True))
    plain = grad_stds(decoder(unit_scaled=False))
    assert unit.keys() == plain.keys()
    out_of_range = {k: v for k, v in unit.items() if not 0.25 <= v <= 4}
    assert not out_of_range, out_of_range
    # The same architecture from torch.nn at default init: gradients orders of magnitude smaller.
    ratio = statistics.median(unit.values()) / statistics.median(plain.values())
    assert ratio > 100, ratio
    assert max(plain.values()) < 0.05 * min(unit.values())


def test_decoder_forward_modes():
    model = decoder(unit_scaled=True)
    ids, labels = batch(2)
    logits = model(ids)
    assert logits.shape == (2, SEQ, VOCAB)
    loss, logits_too = model(ids, labels, return_logits=True)
    torch.testing.assert_close(logits_too, logits)
    torch.testing.assert_close(
        loss, nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    )
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, SEQ + 1, dtype=torch.long))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_few_training_steps_reduce_the_loss(optimizer):
    model = decoder(unit_scaled=True)
    ids, _ = batch(8)
    labels = torch.roll(ids, -1, dims=1)  # a learnable target: the next token of the same batch
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_package_import_never_imports_poptorch():
    code = (
        "import sys; sys.modules['poptorch'] = None\n"  # any import of it would now fail
        "import ipu_unit_scaling, ipu_unit_scaling.functional, ipu_unit_scaling.models\n"
        "assert sys.modules.get('poptorch') is None\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
