"""The executor's compile hooks, its inputs as the graph takes them (float64 as float32) and
the error for an attribute neither it nor the user's model has."""
from __future__ import annotations

from typing import List

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_hooks_run_in_order_around_each_compilation_and_their_handles_remove_them():
    calls: List[str] = []
    handles = [poptorch.registerPreCompileHook(lambda: calls.append("pre1")),
               poptorch.registerPreCompileHook(lambda: calls.append("pre2")),
               poptorch.registerPostCompileHook(lambda: calls.append("post"))]
    try:
        model = poptorch.inferenceModel(_Identity())
        model(torch.ones(2))
        assert calls == ["pre1", "pre2", "post"]
        model(torch.ones(2))  # already compiled: no hook
        assert calls == ["pre1", "pre2", "post"]
        handles[1].remove()
        poptorch.inferenceModel(_Identity()).compile(torch.ones(2))
        assert calls == ["pre1", "pre2", "post", "pre1", "post"]
    finally:
        for handle in handles:
            handle.remove()


def test_the_post_compile_hook_runs_after_a_failed_compilation_too():
    class Reads(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.sum())

    calls: List[str] = []
    handle = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        with pytest.raises(poptorch.Error):
            poptorch.inferenceModel(Reads())(torch.ones(2))
        assert calls == ["post"]
    finally:
        handle.remove()


@pytest.mark.parametrize("register", [poptorch.registerPreCompileHook,
                                      poptorch.registerPostCompileHook])
def test_a_hook_that_is_not_callable_is_refused(register):
    with pytest.raises(RuntimeError, match="must be callable"):
        register(3)


def test_float64_inputs_are_cast_to_float32_as_the_graph_takes_them():
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, dtype=torch.float64)
    out = poptorch.inferenceModel(linear)(x)
    assert out.dtype == torch.float32
    # The same float32 op on the cast input: only the kernel's rounding may differ
    # (3 products and 3 sums per element, float32 unit roundoff).
    expected = linear(x.float())
    tolerance = 6 * 2.0 ** -24 * (x.float().abs() @ linear.weight.abs().T + linear.bias.abs())
    assert torch.all((out - expected).abs() <= tolerance.detach())


def test_a_missing_attribute_names_the_executor_and_the_model():
    model = poptorch.inferenceModel(_Identity())
    with pytest.raises(AttributeError, match="'PoplarExecutor' object has no attribute "
                       "'no_such_thing'.*'_Identity'"):
        model.no_such_thing  # noqa: B018
