"""Stages, phases and execution strategies of the PopTorch stand-in against PopTorch's
(python/options.py, python/_options_impl.py): how blocks map to stages, the automatic stage
ids (``AutoStage``), the refusals, and the backend options each strategy hands on."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch import _state
from ipu_standins.poptorch._strategies import _StageManager


@pytest.fixture
def blocks(monkeypatch):
    """What the stage managers record, one (block id, stage, phase, ipu) per block begun."""
    recorded = []
    monkeypatch.setattr(_state, "BLOCKS", recorded)
    return recorded


def test_a_stage_holds_block_ids_and_an_ipu():
    stage = poptorch.Stage("a", "b")
    assert stage.blocks == ("a", "b") and stage.ipu(2) is stage and stage._ipu == 2
    with pytest.raises(AssertionError, match="Block IDs are supposed to be strings"):
        poptorch.Stage("a", 1)
    with pytest.raises(AssertionError):
        stage.ipu("1")


def test_pipelined_stages_are_numbered_in_argument_order():
    strategy = poptorch.PipelinedExecution("A", ["B", "C"], poptorch.Stage("D").ipu(3))
    assert [strategy.stage(b)._stage_id for b in "ABCD"] == [0, 1, 1, 2]
    assert strategy.stage("B") is strategy.stage("C")
    with pytest.raises(AssertionError, match="Unknown block E"):
        strategy.stage("E")
    with pytest.raises(AssertionError, match="A associated with more than one stage"):
        poptorch.PipelinedExecution("A", poptorch.Stage("B", "A"))


def test_explicit_stages_record_the_stage_s_ipu_over_the_block_s(blocks):
    manager = poptorch.PipelinedExecution("A", poptorch.Stage("B").ipu(3))._stages_manager
    manager.beginStage("A", 0)
    manager.beginStage("B", 1)
    assert blocks == [("A", 0, -1, 0), ("B", 1, -1, 3)]
    with pytest.raises(AssertionError, match=r"^Unknown Block 'C' list of expected Blocks: "
                                             r"\['A', 'B'\]$"):
        manager.beginStage("C", 0)


def test_same_as_ipu_gives_each_block_its_ipu_as_stage(blocks):
    manager = poptorch.PipelinedExecution()._stages_manager  # AutoStage.SameAsIpu
    for ipu in (0, 1, 0):
        manager.beginStage(None, ipu)
    assert blocks == [("0", 0, -1, 0), ("1", 1, -1, 1), ("2", 0, -1, 0)]
    with pytest.raises(AssertionError, match="no IPU was specified for block 3"):
        manager.beginStage(None, None)


def test_auto_increment_gives_each_new_block_the_next_stage(blocks):
    manager = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)._stages_manager
    for ipu in (0, 1, 0):
        manager.beginStage(None, ipu)
    manager.beginStage("1", 1)  # a block seen before keeps its stage
    # PopTorch's _DefaultStageManager counts from 1 (its docstring's example from 0): the
    # stages differ and increase either way.
    assert blocks == [("0", 1, -1, 0), ("1", 2, -1, 1), ("2", 3, -1, 0), ("1", 2, -1, 1)]


def test_a_block_without_an_ipu_runs_on_its_stage_id(blocks):
    manager = _StageManager(auto_stage=poptorch.AutoStage.AutoIncrement)
    manager.beginStage("x", None)
    assert blocks == [("x", 1, -1, 1)]


def test_auto_ids_restart_at_each_trace():
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    manager = strategy._stages_manager
    assert [manager.nextAutoId() for _ in range(2)] == ["0", "1"]
    strategy.onStartTracing()
    try:
        assert _state.STAGE_MANAGER is manager and manager.nextAutoId() == "0"
    finally:
        strategy.onEndTracing()
    assert _state.STAGE_MANAGER is None


def test_phases_of_blocks_or_of_stages():
    one = poptorch.Phase("A", "B")
    assert len(one.stages) == 1 and one.stage(0).blocks == ("A", "B")
    two = poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B"))
    two.ipus(0, 2)
    assert [s._ipu for s in two.stages] == [0, 2]
    with pytest.raises(AssertionError, match="Phase contains 2 stages but you provided 1 ipus"):
        two.ipus(1)
    with pytest.raises(AssertionError, match="must either be block IDs"):
        poptorch.Phase("A", poptorch.Stage("B"))


def test_phased_execution_numbers_the_phases():
    strategy = poptorch.SerialPhasedExecution(
        poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("A2")), ["B"], "C")
    assert [strategy.stage(b)._phase_id for b in ("A", "A2", "B", "C")] == [0, 0, 1, 2]
    assert strategy.phase(1).stage(0).blocks == ("B",)
    with pytest.raises(AssertionError, match="positive integers"):
        strategy.phase(-1)
    with pytest.raises(AssertionError, match="no AutoStage for PhasedExecution"):
        poptorch.ParallelPhasedExecution()
    with pytest.raises(AssertionError, match="more than one stage"):
        poptorch.ParallelPhasedExecution(["A"], ["A"])


def test_the_backend_options_of_each_strategy():
    assert poptorch.PipelinedExecution().backendOptions() == {"execution_mode": 0}
    assert poptorch.ShardedExecution().backendOptions() == {"execution_mode": 1}
    parallel = poptorch.ParallelPhasedExecution(["A"], ["B"])
    assert parallel.backendOptions() == {
        "execution_mode": 2, "separate_backward_phase": False,
        "tensors_liveness": poptorch.Liveness.AlwaysLive.value,
        "serial_phases_execution": False}
    parallel.sendTensorsOffChipAfterFwd().useSeparateBackwardPhase()
    assert parallel.backendOptions()["tensors_liveness"] == poptorch.Liveness.OffChipAfterFwd
    assert parallel.backendOptions()["separate_backward_phase"] is True
    assert parallel.sendTensorsOffChipAfterFwd(False).backendOptions()[
        "tensors_liveness"] == poptorch.Liveness.AlwaysLive
    serial = poptorch.SerialPhasedExecution(["A"]).setTensorsLiveness(
        poptorch.Liveness.OffChipAfterEachPhase)
    assert serial.backendOptions() == {
        "execution_mode": 2, "separate_backward_phase": False, "tensors_liveness": 3,
        "serial_phases_execution": True}
    with pytest.raises(AssertionError):
        serial.setTensorsLiveness(3)


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            x = self.a(x)
        with poptorch.Block("B", ipu_id=1):
            return self.b(x)


def test_a_model_s_blocks_must_be_the_strategy_s():
    # Two pipeline stages need at least two device iterations (PopTorch's rule).
    known = poptorch.Options().deviceIterations(2).setExecutionStrategy(
        poptorch.PipelinedExecution("A", "B"))
    model, x = _TwoBlocks(), torch.randn(2, 2)
    torch.testing.assert_close(poptorch.inferenceModel(model, known)(x), model(x).detach())
    unknown = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution("A", "C"))
    with pytest.raises(AssertionError, match="Unknown Block 'B'"):
        poptorch.inferenceModel(_TwoBlocks(), unknown)(torch.ones(1, 2))
    assert _state.STAGE_MANAGER is None  # a failed trace leaves no stage manager behind
