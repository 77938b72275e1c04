"""The benchmarked GPT, built three ways: plain torch, our `U`, the published `unit_scaling`.

All three are the same `GPT` class with the same shape; only its `Ops` table
differs, so any difference in cost comes from the ops themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from ipu_unit_scaling import GPT, TORCH_OPS, UNIT_OPS, Ops

from .measure import INSTANCES, Step, instances

TORCH = "torch"
OURS = "ours"
PUBLISHED = "unit_scaling"


@dataclass(frozen=True)
class Shape:
    """The benchmarked model and batch."""

    vocab_size: int = 256
    seq_len: int = 64
    depth: int = 4
    hidden_size: int = 128
    heads: int = 4
    batch_size: int = 8

    def describe(self) -> str:
        return (
            f"GPT depth={self.depth} hidden={self.hidden_size} heads={self.heads} "
            f"seq={self.seq_len} vocab={self.vocab_size}, batch={self.batch_size}"
        )


FULL_SHAPE = Shape()
QUICK_SHAPE = Shape(vocab_size=64, seq_len=32, depth=2, hidden_size=64, heads=2, batch_size=4)
# The second shape the targets are checked on, and the width sweep's other sizes.
SECOND_SHAPE = Shape(depth=3, hidden_size=192, seq_len=128)
SWEEP_SHAPE = Shape(depth=2)
SWEEP_WIDTHS = (128, 256, 512)


def published_version() -> Optional[str]:
    """The installed `unit-scaling` version, or None when it is not installed."""
    try:
        import unit_scaling
    except ImportError:
        return None
    return str(getattr(unit_scaling, "__version__", "unknown"))


def published_ops() -> Ops:
    """An `Ops` table from the published library (raises ImportError without it).

    Its LayerNorm has no affine parameters by default; asking for them keeps the parameter
    set identical to the other two builds. Everything else is used at its defaults.
    """
    import unit_scaling as pub
    import unit_scaling.functional as pub_f

    def layer_norm(hidden_size: int) -> nn.Module:
        return pub.LayerNorm(hidden_size, elementwise_affine=True)

    return Ops(
        Linear=pub.Linear,
        LayerNorm=layer_norm,
        Embedding=pub.Embedding,
        gelu=pub_f.gelu,
        dropout=pub_f.dropout,
        add=pub_f.add,
        residual_split=pub_f.residual_split,
        residual_add=pub_f.residual_add,
        scaled_dot_product_attention=pub_f.scaled_dot_product_attention,
        cross_entropy=pub_f.cross_entropy,
    )


def ops_for(name: str) -> Ops:
    if name == TORCH:
        return TORCH_OPS
    if name == OURS:
        return UNIT_OPS
    if name == PUBLISHED:
        return published_ops()
    raise ValueError(f"unknown variant {name!r}")


def build_model(name: str, shape: Shape, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        depth=shape.depth,
        heads=shape.heads,
        seq_len=shape.seq_len,
        ops=ops_for(name),
    )


def make_batch(shape: Shape, seed: int = 0) -> Dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        shape.vocab_size, (shape.batch_size, shape.seq_len + 1), generator=generator
    )
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def make_train_step(
    model: nn.Module, batch: Dict[str, Tensor], lr: float = 1e-3
) -> Callable[[], Tensor]:
    """One full training step: forward with loss, backward, AdamW update, zero grads.

    The optimizer is the same plain `torch.optim.AdamW` for every variant so that only the
    model's ops differ.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    input_ids, labels = batch["input_ids"], batch["labels"]

    def step() -> Tensor:
        loss = model(input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _same(x: Step) -> Step:
    return x


def train_steps(
    name: str, shape: Shape, batch: Dict[str, Tensor], recipe: Optional[str] = None,
    form: Callable[[Step], Step] = _same,
    wrap: Callable[[nn.Module], nn.Module] = lambda model: model, count: int = INSTANCES,
) -> List[Step]:
    """``count`` training steps of variant ``name``, each of a model of its own: under the FP8
    recipe ``recipe`` where one is named (``simulate_fp8``), the model passed through ``wrap``
    (e.g. ``torch.compile``) and the step through ``form``."""

    def make() -> Step:
        model = build_model(name, shape)
        if recipe is not None:
            from ipu_unit_scaling.fp8 import FP8Config
            from ipu_unit_scaling.transforms import simulate_fp8

            model = simulate_fp8(model, FP8Config().with_recipe(recipe))
        return form(make_train_step(wrap(model), batch))

    return instances(make, count)
