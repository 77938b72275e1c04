"""Shared fixtures."""
from __future__ import annotations

from typing import Callable

import pytest
import torch


def _step_losses(config, backend: str, calls: int) -> torch.Tensor:
    """Per-step losses of ``calls`` training-model calls of the config's GPT on ``backend``,
    from the same seed and the same random token batches whatever the backend."""
    from ipu_unit_scaling.backends import build_training_model, make_optimizer
    from ipu_unit_scaling.loop.training_loop import build_model

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
