"""Stages, phases and the execution strategies of ``poptorch.Options.setExecutionStrategy``.

While the executor traces a model, every block that begins (``poptorch.Block``,
``BeginBlock``, ``BlockFunction``) asks the strategy's stage manager for its stage; the
manager records ``(block id, stage, phase, ipu)`` in :data:`_state.BLOCKS`, from which the
executor counts pipeline stages as PopTorch does: one more at every change of IPU.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from . import _state, enums

__all__ = ["Stage", "Phase", "PipelinedExecution", "ShardedExecution",
           "ParallelPhasedExecution", "SerialPhasedExecution"]


class Stage:
    """Blocks that run together: ``poptorch.Stage("b1", "b2").ipu(1)``."""

    def __init__(self, *block_ids: str) -> None:
        assert all(isinstance(b, str) for b in block_ids), (
            f"Block IDs are supposed to be strings but got {block_ids}")
        self._blocks = block_ids
        self._stage_id = -1
        self._phase_id = -1
        self._ipu: Optional[int] = None

    @property
    def blocks(self) -> Any:
        return self._blocks

    def ipu(self, ipu: int) -> Stage:
        assert isinstance(ipu, int)
        self._ipu = ipu
        return self

    def _setStage(self, stage: Optional[int]) -> Stage:
        if stage is not None:
            self._stage_id = stage
        return self


class _StageManager:
    """Gives each block its stage; ``block_map`` (explicit stages) or automatic ids."""

    def __init__(self, block_map: Optional[Dict[str, Stage]] = None,
                 auto_stage: enums.AutoStage = enums.AutoStage.SameAsIpu) -> None:
        self._explicit = bool(block_map)
        self._block_map: Dict[str, Stage] = dict(block_map or {})
        self._auto_stage = auto_stage
        self._next_auto_id = 0
        self._next_stage = 1
        self._current_ipu: Optional[int] = None

    def nextAutoId(self) -> str:
        value = self._next_auto_id
        self._next_auto_id += 1
        return str(value)

    def resetAutoId(self) -> None:
        self._next_auto_id = 0

    def getStage(self, block_id: str) -> Stage:
        if self._explicit:
            assert block_id in self._block_map, (
                f"Unknown Block '{block_id}' list of expected Blocks: "
                f"{list(self._block_map.keys())}")
            return self._block_map[block_id]
        if block_id not in self._block_map:
            stage = Stage(block_id)
            if self._auto_stage == enums.AutoStage.SameAsIpu:
                assert self._current_ipu is not None, (
                    "poptorch.AutoStage.SameAsIpu was selected but no IPU was specified for "
                    f"block {block_id}")
                stage._setStage(self._current_ipu)
            else:
                stage._setStage(self._next_stage)
                self._next_stage += 1
            self._block_map[block_id] = stage
        return self._block_map[block_id]

    def beginStage(self, user_id: Optional[str], ipu_id: Optional[int]) -> None:
        user_id = user_id or self.nextAutoId()
        self._current_ipu = ipu_id
        stage = self.getStage(user_id)
        ipu = stage._ipu if stage._ipu is not None else ipu_id
        if ipu is None:
            ipu = stage._stage_id
        _state.BLOCKS.append((user_id, stage._stage_id, stage._phase_id, ipu))


class _IExecutionStrategy:
    def __init__(self, stages_manager: _StageManager, block_map: Dict[str, Stage]) -> None:
        self._block_map = block_map
        self._stages_manager = stages_manager

    def stage(self, block_id: str) -> Stage:
        assert block_id in self._block_map, f"Unknown block {block_id}"
        return self._block_map[block_id]

    def onStartTracing(self) -> None:
        self._stages_manager.resetAutoId()
        _state.STAGE_MANAGER = self._stages_manager

    def onEndTracing(self) -> None:
        _state.STAGE_MANAGER = None

    def backendOptions(self) -> Dict[str, Any]:
        return {}


def _stage_of(arg: Any) -> Stage:
    if isinstance(arg, Stage):
        return arg
    if isinstance(arg, str):
        return Stage(arg)
    assert all(isinstance(e, str) for e in arg)
    return Stage(*arg)


class PipelinedExecution(_IExecutionStrategy):
    """Blocks on different IPUs run as a pipeline: one stage per change of IPU."""

    def __init__(self, *args: Any) -> None:
        block_map: Dict[str, Stage] = {}
        auto_stage = enums.AutoStage.SameAsIpu
        if len(args) == 1 and isinstance(args[0], enums.AutoStage):
            auto_stage = args[0]
        else:
            for stage_id, arg in enumerate(args):
                stage = _stage_of(arg)._setStage(stage_id)
                for block in stage.blocks:
                    assert block not in block_map, (
                        f"{block} associated with more than one stage")
                    block_map[block] = stage
        super().__init__(_StageManager(block_map, auto_stage), block_map)

    def backendOptions(self) -> Dict[str, Any]:
        return {"execution_mode": 0}


class ShardedExecution(PipelinedExecution):
    """Blocks on different IPUs run one after the other (no pipeline rules)."""

    def backendOptions(self) -> Dict[str, Any]:
        return {"execution_mode": 1}


class Phase:
    """Stages that run in parallel within one execution phase."""

    def __init__(self, *arg: Union[str, Stage]) -> None:
        if all(isinstance(e, Stage) for e in arg):
            self.stages: Any = arg
        else:
            assert all(isinstance(e, str) for e in arg), (
                "All arguments must either be block IDs (strings) or Stages: "
                + str([type(e) for e in arg]))
            self.stages = [Stage(*arg)]  # type: ignore[arg-type]

    def stage(self, idx: int) -> Stage:
        return self.stages[idx]

    def ipus(self, *ipus: int) -> None:
        assert len(ipus) == len(self.stages), (
            f"Phase contains {len(self.stages)} stages but you provided {len(ipus)} ipus")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)


class _IPhasedExecution(_IExecutionStrategy):
    def __init__(self, *phases: Any) -> None:
        self._tensors_liveness = enums.Liveness.AlwaysLive
        self._separate_backward_phase = False
        self._phases: List[Phase] = []
        assert phases, ("There is currently no AutoStage for PhasedExecution, please "
                        "explicitly specify the phases")
        block_map: Dict[str, Stage] = {}
        for phase_id, args in enumerate(phases):
            phase = args if isinstance(args, Phase) else Phase(
                *(args if isinstance(args, list) else [args]))
            self._phases.append(phase)
            for stage in phase.stages:
                stage._phase_id = phase_id
                for block in stage.blocks:
                    assert block not in block_map, (
                        f"{block} associated with more than one stage")
                    block_map[block] = stage
        super().__init__(_StageManager(block_map), block_map)

    def phase(self, phase: int) -> Phase:
        assert isinstance(phase, int) and phase >= 0, (
            "Phases are identified by positive integers")
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use: bool = True) -> Any:
        assert isinstance(use, bool)
        self._separate_backward_phase = use
        return self

    def backendOptions(self) -> Dict[str, Any]:
        return {"execution_mode": 2, "separate_backward_phase": self._separate_backward_phase,
                "tensors_liveness": self._tensors_liveness.value}


class ParallelPhasedExecution(_IPhasedExecution):
    def backendOptions(self) -> Dict[str, Any]:
        return {**super().backendOptions(), "serial_phases_execution": False}

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> ParallelPhasedExecution:
        assert isinstance(off_chip, bool)
        self._tensors_liveness = (enums.Liveness.OffChipAfterFwd if off_chip
                                  else enums.Liveness.AlwaysLive)
        return self


class SerialPhasedExecution(_IPhasedExecution):
    def setTensorsLiveness(self, liveness: enums.Liveness) -> SerialPhasedExecution:
        assert isinstance(liveness, enums.Liveness)
        self._tensors_liveness = liveness
        return self

    def backendOptions(self) -> Dict[str, Any]:
        return {**super().backendOptions(), "serial_phases_execution": True}
