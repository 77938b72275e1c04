"""Losses PopTorch's dispatcher takes whole (``RegisterOptionalAtenOps.cpp.inc``) that torch
cannot trace as it computes them.

``F.ctc_loss``: PopTorch lowers it to PopART's CTC loss. Torch's kernel has an output whose
shape depends on the target lengths' values, so a trace cannot record it; :func:`ctc_loss`
computes the same loss with ops of fixed shapes (the forward recursion of Graves et al. 2006
over the blank-extended targets, in log space, unrolled over time), so that autograd of the
trace gives its gradient, as PopART's CTC grad op does.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Union

import torch

from ._impl import createPoptorchError

__all__ = ["ctc_loss"]

# Stands for log(0): finite, so that the gradient of a logsumexp over impossible paths is 0,
# not NaN; any path through it scores below _IMPOSSIBLE.
_LOG_ZERO = -1.0e30
_IMPOSSIBLE = -1.0e29

Lengths = Union[torch.Tensor, Sequence[int]]


def _as_tensor(lengths: Lengths, like: torch.Tensor) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        return lengths.to(device=like.device, dtype=torch.long)
    return torch.tensor(list(lengths), dtype=torch.long, device=like.device)


def _padded_targets(targets: torch.Tensor, target_lengths: Lengths) -> torch.Tensor:
    """Targets as (N, S): 1-D concatenated targets are split by their lengths, which must then
    be known at compile time (a list of ints)."""
    if targets.dim() == 2:
        return targets
    if isinstance(target_lengths, torch.Tensor):
        raise createPoptorchError(
            "ctc_loss: concatenated (1-D) targets need target_lengths as a list of ints, or "
            "give the targets padded, shaped (batch, max target length)")
    lengths: List[int] = [int(n) for n in target_lengths]
    rows = torch.split(targets, lengths)
    width = max(lengths) if lengths else 0
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Lengths,
             target_lengths: Lengths, blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False) -> torch.Tensor:
    """``F.ctc_loss`` with ops of fixed shapes (module doc); the same arguments."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        targets = targets.unsqueeze(0) if targets.dim() == 1 and isinstance(
            target_lengths, torch.Tensor) and target_lengths.dim() == 0 else targets
    dtype = log_probs.dtype
    probs = log_probs.to(torch.promote_types(dtype, torch.float32))
    steps, batch, _ = probs.shape
    targets = _padded_targets(targets, target_lengths).reshape(batch, -1).long()
    input_len = _as_tensor(input_lengths, probs).reshape(batch)
    target_len = _as_tensor(target_lengths, probs).reshape(batch)
    width = 2 * targets.shape[1] + 1
    # The extended targets: blank, l1, blank, l2, ..., blank.
    blanks = torch.full_like(targets, blank)
    extended = torch.cat([torch.stack([blanks, targets], dim=2).reshape(batch, -1),
                          blanks.new_full((batch, 1), blank)], dim=1)
    # A path may skip from s - 2 onto a symbol that differs from the one two back (torch
    # compares the symbols only: a label equal to the blank is compared like any other).
    previous = torch.cat([extended.new_full((batch, 2), blank), extended[:, :-2]], dim=1)
    skip = extended != previous
    floor = probs.new_full((batch, 1), _LOG_ZERO)
    positions = torch.arange(width, device=probs.device).unsqueeze(0)
    alpha = torch.where(positions < 2, probs[0].gather(1, extended),
                        probs.new_full((batch, width), _LOG_ZERO))
    for t in range(1, steps):
        one_back = torch.cat([floor, alpha[:, :-1]], dim=1)
        two_back = torch.where(skip, torch.cat([floor, floor, alpha[:, :-2]], dim=1),
                               probs.new_full((batch, width), _LOG_ZERO))
        stepped = torch.logsumexp(torch.stack([alpha, one_back, two_back]), dim=0) + (
            probs[t].gather(1, extended))
        alpha = torch.where((t < input_len).unsqueeze(1), stepped, alpha)
    last = (2 * target_len).unsqueeze(1)
    ends = torch.cat([alpha.gather(1, last),
                      torch.where(last > 0, alpha.gather(1, (last - 1).clamp(min=0)),
                                  floor)], dim=1)
    log_likelihood = torch.logsumexp(ends, dim=1)
    impossible = log_likelihood < _IMPOSSIBLE
    zero = torch.zeros_like(log_likelihood)
    loss = torch.where(impossible, zero if zero_infinity else torch.full_like(zero, float("inf")),
                       -log_likelihood)
    if reduction == "none":
        out: Any = loss.squeeze(0) if unbatched else loss
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = (loss / target_len.clamp(min=1).to(loss.dtype)).mean()
    return out.to(dtype)
