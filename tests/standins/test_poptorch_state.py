"""What the PopTorch stand-in's executor shares with the ops while it traces a model
(``poptorch._state``), seen as PopTorch programs see it: ``isRunningOnIpu()`` inside the model
only, the training-only refusals of ``for_loop``, the stage manager and blocks of one trace,
and all of it reset after a trace, even a failed one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch import _state


def _snapshot():
    return {"on_ipu": poptorch.isRunningOnIpu(), "training": _state.TRAINING,
            "manager": _state.STAGE_MANAGER is not None, "blocks": list(_state.BLOCKS)}


class _Probe(torch.nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.fail = fail
        self.seen = []

    def forward(self, x, target=None):
        with poptorch.Block("only", ipu_id=0):  # after a block, every op must be in one
            out = self.lin(x)
            self.seen.append(_snapshot())
            if self.fail:
                raise ValueError("the model failed")
            return out if target is None else (out, F.mse_loss(out, target))


def _idle():
    return {"on_ipu": False, "training": False, "manager": False, "blocks": []}


def test_outside_a_model_nothing_runs_on_the_ipu():
    probe = _Probe()
    probe(torch.ones(1, 2))
    assert probe.seen == [_idle()] and _snapshot() == _idle()


@pytest.mark.parametrize("training", [False, True])
def test_a_trace_sees_the_ipu_its_mode_and_its_blocks(training):
    probe = _Probe()
    x = torch.ones(1, 2)
    if training:
        poptorch.trainingModel(probe)(x, torch.zeros(1, 2))
    else:
        poptorch.inferenceModel(probe)(x)
    traced = probe.seen[0]
    assert traced["on_ipu"] and traced["manager"] and traced["training"] == training
    assert [b[0] for b in traced["blocks"]] == ["only"]
    assert _snapshot() == _idle()


def test_a_failed_trace_leaves_the_state_idle():
    probe = _Probe(fail=True)
    with pytest.raises(ValueError, match="the model failed"):
        poptorch.trainingModel(probe)(torch.ones(1, 2), torch.zeros(1, 2))
    assert probe.seen and probe.seen[0]["training"]
    after = _snapshot()
    del after["blocks"]  # the blocks of a failed trace are dropped when the next one starts
    assert after == {k: v for k, v in _idle().items() if k != "blocks"}


class _Loop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))  # for the training model's optimizer

    def forward(self, x, target=None):
        (y,) = poptorch.for_loop(3, lambda t: t * 2, [x * self.scale])
        return y if target is None else (y, F.mse_loss(y, target))


def test_for_loop_is_refused_only_while_a_training_model_is_traced():
    x = torch.ones(1, 2)
    assert torch.equal(_Loop()(x).detach(), x * 8)  # on the host
    assert torch.equal(poptorch.inferenceModel(_Loop())(x), x * 8)
    with pytest.raises(poptorch.Error, match="only supported in inference"):
        poptorch.trainingModel(_Loop())(x, torch.zeros(1, 2))
    assert _snapshot() == _idle()
