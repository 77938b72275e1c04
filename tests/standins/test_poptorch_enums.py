"""``poptorch.enums`` of the PopTorch stand-in against PopTorch's (python/enums.py): every enum,
its kind (IntEnum or a string Enum), its members in order and their values, served also at
``poptorch``'s top level. A program that stores an option as ``enum.value`` (as
``Options.toDict()`` does) depends on these numbers and strings."""
from __future__ import annotations

import enum

import pytest

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch import enums

# PopTorch's members and values, in declaration order.
POPTORCH_ENUMS = {
    "MeanReductionStrategy": {"Running": 0, "Post": 1, "PostAndLoss": 2},
    "DataLoaderMode": {"Sync": 0, "Async": 1, "AsyncRebatched": 2},
    "SharingStrategy": {"SharedMemory": 0, "FileSystem": 1, "Fork": 2, "ForkServer": 3},
    "OutputMode": {"Final": 0, "EveryN": 1, "All": 2, "Sum": 3, "Default": 4},
    "ConnectionType": {"Always": 0, "OnDemand": 1, "Never": 2},
    "HalfFloatCastingBehavior": {"FloatDowncastToHalf": 0, "HalfUpcastToFloat": 1,
                                 "Default": 2},
    "ReductionType": {"Sum": 0, "Mean": 1, "NoReduction": 2},
    "SyncPattern": {"Full": 0, "SinglePipeline": 1, "ReplicaAndLadder": 2},
    "MatMulSerializationMode": {"InputChannels": "input_channels",
                                "ReducingDim": "reducing_dim",
                                "OutputChannels": "output_channels", "Disabled": "none"},
    "Liveness": {"AlwaysLive": 0, "OffChipAfterFwd": 1, "OffChipAfterFwdNoOverlap": 2,
                 "OffChipAfterEachPhase": 3},
    "OverlapMode": {"NoOverlap": "no_overlap",
                    "OverlapAccumulationLoop": "overlap_accumulation_loop",
                    "OverlapDeviceIterationLoop": "overlap_device_iteration_loop"},
    "AutoStage": {"SameAsIpu": 0, "AutoIncrement": 1},
    "MultiConvPlanType": {"Parallel": 0, "Serial": 1},
    "CommGroupType": {"All": 0, "Consecutive": 1, "Orthogonal": 2, "NoGrouping": 3},
    "VariableRetrievalMode": {"OnePerGroup": 0, "AllReplicas": 2},
}


def test_the_module_has_exactly_poptorch_s_enums():
    assert sorted(enums.__all__) == sorted(POPTORCH_ENUMS)
    defined = {name for name, value in vars(enums).items()
               if isinstance(value, type) and issubclass(value, enum.Enum)}
    assert defined == set(POPTORCH_ENUMS)


@pytest.mark.parametrize("name", sorted(POPTORCH_ENUMS))
def test_members_values_and_kind(name):
    cls = getattr(enums, name)
    expected = POPTORCH_ENUMS[name]
    assert [(m.name, m.value) for m in cls] == list(expected.items())
    numeric = all(isinstance(v, int) for v in expected.values())
    # PopTorch's numeric enums are IntEnums: they compare equal to (and index as) ints.
    assert issubclass(cls, enum.IntEnum) == numeric
    if numeric:
        first_name, first_value = next(iter(expected.items()))
        assert cls(first_value) is getattr(cls, first_name) and cls[first_name] == first_value


@pytest.mark.parametrize("name", sorted(POPTORCH_ENUMS))
def test_each_enum_is_served_at_the_top_level(name):
    assert getattr(poptorch, name) is getattr(enums, name)


def test_values_outside_the_enum_are_refused():
    with pytest.raises(ValueError):
        enums.VariableRetrievalMode(1)  # PopTorch skips 1
    with pytest.raises(ValueError):
        enums.OverlapMode("overlap")
