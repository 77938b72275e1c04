"""The pipeline stage split, shared by every backend: PopTorch blocks, torch pipeline stages.

The model follows the contract of ``ipu_unit_scaling.models.gpt``: its transformer blocks are in an
``nn.ModuleList`` called ``layers``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Sequence, Tuple

from torch import nn

from ..training.run_config import resolve_layers_per_ipu

if TYPE_CHECKING:
    from ..training.run_config import IPUConfig

# Children that must sit with the first or last stage whatever their registration order.
INPUT_SIDE = ("embedding", "position_embedding")
OUTPUT_SIDE = ("final_norm", "head")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: IPU ``index`` of a replica, or one rank of a torch pipeline."""

    index: int
    modules: Tuple[str, ...]  # names of the model's submodules placed on this stage
    layers: Tuple[int, ...]  # indices into model.layers


def split_stages(model: nn.Module, layers_per_stage: Sequence[int]) -> List[Stage]:
    """Place ``model.layers`` by ``layers_per_stage`` (explicit counts, no ``-1``).

    Children registered before ``layers`` (embeddings) go on the first stage and those after
    it (final norm, head, loss) on the last, so activations flow one way through the stages.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no nn.ModuleList 'layers' to split")
    if sum(layers_per_stage) != len(layers) or any(c < 0 for c in layers_per_stage):
        raise ValueError(
            f"layers_per_stage {list(layers_per_stage)} must be counts summing to the "
            f"{len(layers)} layers of the model"
        )
    first: List[str] = []
    last: List[str] = []
    seen_layers = False
    for name, _ in model.named_children():
        if name == "layers":
            seen_layers = True
        elif name in INPUT_SIDE:
            first.append(name)
        elif name in OUTPUT_SIDE or seen_layers:
            last.append(name)
        else:
            first.append(name)
    stages: List[Stage] = []
    start = 0
    for index, count in enumerate(layers_per_stage):
        indices = tuple(range(start, start + count))
        names = [f"layers.{i}" for i in indices]
        if index == 0:
            names = first + names
        if index == len(layers_per_stage) - 1:
            names = names + last
        stages.append(Stage(index=index, modules=tuple(names), layers=indices))
        start += count
    return stages


def ipu_stages(model: nn.Module, ipu: IPUConfig) -> List[Stage]:
    """The stage split ``ipu.layers_per_ipu`` gives ``model``: the stages every backend shows,
    and those the ``distributed`` backend trains on separate processes. On one IPU a model
    without the GPT's ``layers`` list (a given model) is one stage."""
    if ipu.ipus_per_replica == 1 and not isinstance(getattr(model, "layers", None),
                                                    nn.ModuleList):
        return [Stage(index=0, modules=tuple(name for name, _ in model.named_children()),
                      layers=())]
    counts = resolve_layers_per_ipu(
        ipu.layers_per_ipu, len(getattr(model, "layers", ())), ipu.ipus_per_replica)
    return split_stages(model, counts)


def layer_bounds(split: Sequence[Stage]) -> List[Tuple[int, int]]:
    """Each stage's layers as ``(start, end)`` indices into ``model.layers`` (a stage without
    layers: ``start == end``, where the previous one ends)."""
    bounds = []
    start = 0
    for stage in split:
        bounds.append((start, start + len(stage.layers)))
        start += len(stage.layers)
    return bounds


def stage_parameters(model: nn.Module, stage: Stage) -> Iterator[nn.Parameter]:
    for name in stage.modules:
        yield from model.get_submodule(name).parameters()


def check_no_shared_parameters(model: nn.Module, split: Sequence[Stage]) -> None:
    """Tied weights cannot live on two stages at once; say which ones are."""
    owner: Dict[int, Tuple[int, str]] = {}
    for stage in split:
        for module_name in stage.modules:
            module = model.get_submodule(module_name)
            for param_name, param in module.named_parameters():
                previous = owner.setdefault(id(param), (stage.index, module_name))
                if previous[0] != stage.index:
                    raise ValueError(
                        f"parameter {module_name}.{param_name} is shared with {previous[1]} on "
                        f"stage {previous[0]}; untie it or place both on one stage"
                    )
