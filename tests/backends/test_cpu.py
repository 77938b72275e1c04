"""CPU fallback training model: PopTorch batching semantics, stage split, backend choice."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_unit_scaling.backends import build_training_model, make_optimizer
from ipu_unit_scaling.backends.cpu import CPUTrainingModel, TrainingModule
from ipu_unit_scaling.backends.pipeline_stages import (
    check_no_shared_parameters,
    ipu_stages,
    split_stages,
)
from ipu_unit_scaling.training.run_config import load_config

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics


class StandInBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class StandInGPT(nn.Module):
    """Shaped like ipu_unit_scaling.models.GPT (same attributes and forward)."""

    def __init__(self, vocab: int = 17, seq_len: int = 8, width: int = 16, depth: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.layers = nn.ModuleList(StandInBlock(width) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None, return_logits=False):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding(input_ids) + self.position_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.final_norm(x))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, logits) if return_logits else loss


def random_batch(samples: int, vocab: int = 17, seq_len: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, seq_len + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def make_pair(optimizer_cls=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    model = StandInGPT().double()
    reference = copy.deepcopy(model)
    return (model, optimizer_cls(model.parameters(), **kwargs),
            reference, optimizer_cls(reference.parameters(), **kwargs))


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.Adam])
def test_accumulation_of_4_micro_batches_of_2_equals_one_batch_of_8(optimizer_cls):
    model, optimizer, reference, reference_optimizer = make_pair(optimizer_cls, lr=0.1)
    inputs, labels = random_batch(8)
    before = flat_parameters(model)
    wrapper = CPUTrainingModel(TrainingModule(model), optimizer, gradient_accumulation=4)
    _, loss = wrapper(inputs, labels)

    reference_optimizer.zero_grad()
    reference_loss = reference(inputs, labels)  # mean over all 8 samples
    reference_loss.backward()
    reference_optimizer.step()

    assert loss.shape == (4,)
    torch.testing.assert_close(loss.mean(), reference_loss.detach(), rtol=0, atol=1e-12)
    after, expected = flat_parameters(model), flat_parameters(reference)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)


def test_replication_averages_like_accumulation():
    model, optimizer, reference, reference_optimizer = make_pair(lr=0.1)
    inputs, labels = random_batch(8)
    CPUTrainingModel(TrainingModule(model), optimizer, gradient_accumulation=2,
                     replication_factor=2)(inputs, labels)
    CPUTrainingModel(TrainingModule(reference), reference_optimizer,
                     gradient_accumulation=4)(inputs, labels)
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=0, atol=0)


def test_device_iterations_run_one_optimizer_step_each():
    model, optimizer, reference, reference_optimizer = make_pair(lr=0.1)
    inputs, labels = random_batch(3 * 4)
    steps = []
    original_step = optimizer.step
    optimizer.step = lambda *a, **k: (steps.append(1), original_step(*a, **k))[1]  # type: ignore
    wrapper = CPUTrainingModel(TrainingModule(model), optimizer, device_iterations=3)
    output, loss = wrapper(inputs, labels)
    assert len(steps) == 3
    assert loss.shape == (3,) and output.shape == (12, 8, 17)

    expected_losses = []
    for chunk_inputs, chunk_labels in zip(inputs.chunk(3), labels.chunk(3)):
        reference_optimizer.zero_grad()
        step_loss = reference(chunk_inputs, chunk_labels)
        step_loss.backward()
        reference_optimizer.step()
        expected_losses.append(step_loss.detach())
    torch.testing.assert_close(loss, torch.stack(expected_losses), rtol=0, atol=1e-12)
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=0, atol=0)


def test_bad_leading_dimension_names_the_rule():
    model, optimizer, *_ = make_pair(lr=0.1)
    wrapper = CPUTrainingModel(TrainingModule(model), optimizer, device_iterations=2,
                               gradient_accumulation=3)
    with pytest.raises(ValueError, match="device_iterations x gradient_accumulation"):
        wrapper(*random_batch(8))


def test_gradient_clipping_bounds_the_update():
    model, optimizer, *_ = make_pair(lr=1.0)
    before = flat_parameters(model)
    CPUTrainingModel(TrainingModule(model), optimizer, max_grad_norm=1e-3)(*random_batch(4))
    assert float((flat_parameters(model) - before).norm()) == pytest.approx(1e-3, rel=1e-4)


def test_split_puts_embeddings_first_and_head_last():
    model = StandInGPT(depth=6)
    split = split_stages(model, [1, 3, 2])
    assert split[0].modules == ("embedding", "position_embedding", "layers.0")
    assert split[1].modules == ("layers.1", "layers.2", "layers.3")
    assert split[2].modules == ("layers.4", "layers.5", "final_norm", "head")
    assert [s.layers for s in split] == [(0,), (1, 2, 3), (4, 5)]
    owned = [p for s in split for name in s.modules
             for p in model.get_submodule(name).parameters()]
    assert len(owned) == len(list(model.parameters()))  # every weight on exactly one stage
    with pytest.raises(ValueError, match="summing"):
        split_stages(model, [3, 2])


def test_tied_weights_across_stages_are_reported():
    model = StandInGPT(width=16)
    model.head.weight = model.embedding.weight
    split = split_stages(model, [2, 2])
    with pytest.raises(ValueError, match="head.weight is shared with embedding"):
        check_no_shared_parameters(model, split)
    check_no_shared_parameters(model, split_stages(model, [4]))


def test_build_training_model_on_cpu_uses_the_config():
    config = load_config("tiny", ["model.depth=4", "ipu.layers_per_ipu=[1, -1]",
                                  "ipu.device_iterations=2", "training.steps=6"])
    model = StandInGPT(depth=4)
    optimizer = make_optimizer(model.parameters(), config, backend="cpu")
    assert isinstance(optimizer, torch.optim.Adam)
    wrapper = build_training_model(model, optimizer, config, backend="cpu")
    assert isinstance(wrapper, CPUTrainingModel)
    assert [s.layers for s in wrapper.stages] == [(0,), (1, 2, 3)]
    assert wrapper.stages == ipu_stages(model, config.ipu)
    inputs, labels = random_batch(config.samples_per_call)
    output, loss = wrapper(inputs, labels)
    per_step = config.ipu.gradient_accumulation * config.ipu.replication_factor
    assert loss.shape == (config.ipu.device_iterations * per_step,)
    assert output.shape[0] == config.samples_per_call
    assert torch.isfinite(loss).all()
