"""The optimizer state on the stand-in's device, read and written as PopTorch does: after a run
``optimizer.state_dict()`` reads the device, ``load_state_dict`` writes before the next run (or
at compiling), and a state moves from one ``trainingModel`` to a new one."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, target):
        out = self.lin(x)
        return out, poptorch.identity_loss(((out - target) ** 2).sum(), reduction="none")


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)


OPTIMIZERS = [
    lambda ps: poptorch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: poptorch.optim.Adam(ps, lr=0.01),
    lambda ps: poptorch.optim.AdamW(ps, lr=0.01),
    lambda ps: poptorch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    lambda ps: poptorch.optim.LAMB(ps, lr=0.01),
]


def _weights(model: torch.nn.Module):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_the_state_survives_a_new_training_model(make) -> None:
    """Two runs in one model, or one run, a checkpoint of model and optimizer, and a second run in
    a new model: the weights and the state agree (the same arithmetic, in the same order)."""
    x, target = _data()
    model = _Model()
    optimizer = make(model.parameters())
    training = poptorch.trainingModel(model, optimizer=optimizer)
    training(x, target)
    training(x, target)
    straight, straight_state = _weights(model), optimizer.state_dict()

    first = _Model()
    optimizer = make(first.parameters())
    training = poptorch.trainingModel(first, optimizer=optimizer)
    training(x, target)
    checkpoint = {"model": first.state_dict(), "optimizer": optimizer.state_dict()}
    assert checkpoint["optimizer"]["ipu_state"], "the state was read from the device"
    training.destroy()

    second = _Model()
    second.load_state_dict(checkpoint["model"])
    optimizer = make(second.parameters())
    optimizer.load_state_dict(checkpoint["optimizer"])
    resumed = poptorch.trainingModel(second, optimizer=optimizer)
    resumed(x, target)
    for a, b in zip(straight, _weights(second)):
        assert torch.equal(a, b)
    state = optimizer.state_dict()
    assert state["ipu_state"].keys() == straight_state["ipu_state"].keys()
    for name, value in straight_state["ipu_state"].items():
        assert torch.equal(state["ipu_state"][name], value), name


def test_state_dict_reads_the_device_after_each_run_and_a_loaded_state_waits_for_the_next() -> None:
    x, target = _data()
    model = _Model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=optimizer)
    training.compile(x, target)
    zero = optimizer.state_dict()["ipu_state"]["Accl1___lin.weight"]
    assert torch.equal(zero, torch.zeros(3, 4))
    training(x, target)
    after_one = optimizer.state_dict()["ipu_state"]["Accl1___lin.weight"]
    assert float(after_one.abs().max()) > 0.0
    # A loaded state is what state_dict() answers until a run has written and updated it.
    state = optimizer.state_dict()
    state["ipu_state"]["Accl1___lin.weight"] = torch.full((3, 4), 7.0)
    optimizer.load_state_dict(state)
    assert float(optimizer.state_dict()["ipu_state"]["Accl1___lin.weight"][0, 0]) == 7.0
    # The gradient of the second run, on the host, at the weights the first run left.
    host = _Model()
    host.load_state_dict(model.state_dict())
    ((host.lin(x) - target) ** 2).sum().backward()
    grad = host.lin.weight.grad
    assert grad is not None
    training(x, target)
    velocity = optimizer.state_dict()["ipu_state"]["Accl1___lin.weight"]
    # The separate variant: v = 0.9 v + g (no dampening, loss scaling 1), from the loaded 7, in
    # float32: a few roundings of values up to 7 + |g|, and the gradient's own sum of 2 x 3
    # products (4 inputs each); 1e-5 of the magnitude covers both with a wide margin.
    expected = 0.9 * 7.0 + grad
    tol = 1e-5 * (7.0 + float(grad.abs().max()))
    assert float((velocity - expected).abs().max()) <= tol
    # Without the loaded state, the velocity would have gone on from the first run's.
    assert float((0.9 * after_one + grad - velocity).abs().min()) > 100 * tol


def test_a_state_loaded_before_compiling_is_written_at_compiling() -> None:
    x, target = _data()
    model = _Model()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, optimizer=optimizer)
    training(x, target)
    state = optimizer.state_dict()
    state["ipu_state"]["Step___lin.bias"] = torch.tensor(41.0)
    training.destroy()

    fresh = _Model()
    optimizer = poptorch.optim.Adam(fresh.parameters(), lr=0.01)
    optimizer.load_state_dict(state)
    again = poptorch.trainingModel(fresh, optimizer=optimizer)
    again.compile(x, target)
    assert float(optimizer.state_dict()["ipu_state"]["Step___lin.bias"]) == 41.0
    again(x, target)
    assert float(optimizer.state_dict()["ipu_state"]["Step___lin.bias"]) == 42.0


def test_an_offline_model_has_no_device_state() -> None:
    x, target = _data()
    model = _Model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05)
    opts = poptorch.Options().useOfflineIpuTarget()
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    training.compile(x, target)
    state = optimizer.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None


def test_an_empty_or_host_only_state_is_refused() -> None:
    model = _Model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="empty"):
        optimizer.set_state_dict({})
    host_only = torch.optim.SGD(model.parameters(), lr=0.05).state_dict()
    with pytest.raises(RuntimeError, match="Only IPU optimizer states"):
        optimizer.load_state_dict(host_only)


def test_the_popart_ir_lists_the_optimizer_ops_of_each_weight() -> None:
    import json

    x, target = _data()
    for make, op, count in ((lambda ps: poptorch.optim.SGD(ps, lr=0.05), "SGD0VarUpdate", 2),
                            (lambda ps: torch.optim.AdamW(ps, lr=0.01), "AdamVarUpdate", 2)):
        model = _Model()
        training = poptorch.trainingModel(model, optimizer=make(model.parameters()))
        training(x, target)
        ops = json.loads(training._debugGetPopartIR())["maingraph"]
        assert sum(o["type"] == op for o in ops) == count
        assert {o["name"] for o in ops if o["type"] == op} == {f"{op}___lin.weight",
                                                                f"{op}___lin.bias"}
