"""Evaluation and sampling: the pieces shared by training, ``evaluate`` and ``sample``.

Everything here takes a *runner*, a callable that runs the model forward: the eager model on
the CPU, or what :func:`ipu_unit_scaling.backends.build_inference_model` returns (a
``poptorch.inferenceModel`` on IPUs, the traced graph on the emulator). Nothing here reads a
tensor on the host inside the forward pass: losses and logits are read after it returns, so
the same code runs under PopTorch's tracing rules.

- :func:`mean_loss` is the training loop's validation rule, used as is by ``evaluate``;
- :func:`validation_batches` draws the windows the training loop validates on;
- :func:`generate` samples text with a window of ``seq_len`` tokens that slides along;
- :data:`PRECISIONS` and :func:`precision_config` name the post-training precisions.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..fp8 import NonFiniteAmaxError
from ..fp8.stats import CastRecord
from .config_names import PRECISION_NAMES
from .data import CharTokenizer, DataError, get_batch
from .run_config import Config

__all__ = [
    "PRECISIONS", "SamplingError", "precision_of", "precision_config", "validation_batches",
    "text_batches", "TextBatches", "mean_loss", "LanguageModelLoss", "encode_known", "generate",
    "next_token", "RoleScaleStats", "scale_stats_by_role",
]

Batch = Tuple[Tensor, Tensor]
Runner = Callable[..., Any]

# Post-training precisions: (dtype, FP8 scaling). The model is the run's; only its casts change.
PRECISIONS: Dict[str, Tuple[str, str]] = {
    "fp32": ("fp32", "amax"),
    "fp16": ("fp16", "amax"),
    "fp8-static": ("fp8", "static"),
    "fp8-amax": ("fp8", "amax"),
}
assert tuple(PRECISIONS) == PRECISION_NAMES  # the names the command line offers


class SamplingError(ValueError):
    """Sampling cannot go on (the model's logits became non-finite)."""


def precision_of(config: Config) -> str:
    """The name of the precision ``config`` trains in: one of :data:`PRECISIONS`, or
    ``fp8-<scaling>`` for the other FP8 recipes (delayed, rowwise, block, mx, nvfp4)."""
    dtype = config.precision.dtype
    return f"fp8-{config.precision.fp8.scaling}" if dtype == "fp8" else dtype


def precision_config(config: Config, precision: str) -> Config:
    """``config`` with its precision set to ``precision`` (other FP8 settings kept where the
    new scaling takes them; an FP4 run's formats go back to the defaults). The precision the
    run trained in gives ``config`` itself, whatever its recipe."""
    if precision == precision_of(config):
        return config
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    dtype, scaling = PRECISIONS[precision]
    fp8 = config.precision.fp8
    try:
        fp8 = dataclasses.replace(fp8.with_recipe(scaling), activation_format=fp8.activation_format,
                                  weight_format=fp8.weight_format,
                                  gradient_format=fp8.gradient_format)
    except ValueError:  # formats the per-tensor casts cannot take (E2M1, ...)
        fp8 = fp8.with_recipe(scaling)
    return dataclasses.replace(config, precision=dataclasses.replace(
        config.precision, dtype=dtype, fp8=fp8))


# ---------------------------------------------------------------------------------- batches


def validation_batches(val: Tensor, config: Config) -> List[Batch]:
    """The windows of ``val`` the training loop validates on: ``training.eval_batches`` random
    batches from a generator seeded with ``training.seed + 1``, the same at every evaluation."""
    training = config.training
    generator = torch.Generator().manual_seed(training.seed + 1)
    return [get_batch(val, training.batch_size, config.model.seq_len, generator)
            for _ in range(training.eval_batches)]


def text_batches(ids: Tensor, seq_len: int, batch_size: int) -> TextBatches:
    """Every character of ``ids`` after the first predicted once: consecutive windows of
    ``seq_len`` inputs (the last may be shorter), ``batch_size`` windows to a batch."""
    return TextBatches(ids, seq_len, batch_size)


class TextBatches(Sequence[Batch]):
    """The batches of :func:`text_batches`, each built when it is read: a long text is held
    once, as its ids (of any integer dtype; batches are int64), never as a copy in windows."""

    def __init__(self, ids: Tensor, seq_len: int, batch_size: int) -> None:
        if len(ids) < 2:
            raise DataError("the text needs at least two characters to predict one")
        self.ids, self.seq_len, self.batch_size = ids, seq_len, batch_size
        self.windows = (len(ids) - 1) // seq_len  # full windows: seq_len inputs + 1 label
        self.full_batches = -(-self.windows // batch_size)
        self.has_tail = (len(ids) - 1) % seq_len != 0  # a shorter last window, alone

    @property
    def tokens(self) -> int:
        """Characters predicted: all but the first."""
        return len(self.ids) - 1

    def __len__(self) -> int:
        return self.full_batches + int(self.has_tail)

    @overload
    def __getitem__(self, index: int) -> Batch: ...

    @overload
    def __getitem__(self, index: slice) -> List[Batch]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of {len(self)}")
        step = self.seq_len
        if index < self.full_batches:
            first = index * self.batch_size
            last = min(first + self.batch_size, self.windows)
            span = self.ids[first * step:last * step + 1]
            windows = span.unfold(0, step + 1, step).to(torch.long, copy=True)
        else:
            windows = self.ids[self.windows * step:][None].to(torch.long, copy=True)
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[Batch]:
        return (self[i] for i in range(len(self)))


# ------------------------------------------------------------------------------ evaluation


def mean_loss(run: Runner, batches: Sequence[Batch],
              on_batch: Optional[Callable[[], None]] = None) -> float:
    """Mean cross-entropy (nats per token) of ``run(inputs, labels)`` over ``batches``.

    This is the training loop's validation rule: the mean of the batch losses (weighted by
    tokens only when batches differ in size), and NaN when an FP8 cast meets a non-finite
    value, as the loss would then be. ``run`` may return one loss per device iteration (an
    IPU inference model): their mean is the batch's loss. No autograd graph is built: a
    validation pass holds one batch's activations at a time, not every batch's.
    """
    losses: List[float] = []
    tokens: List[int] = []
    try:
        with torch.no_grad():
            for inputs, labels in batches:
                loss = run(inputs, labels)
                losses.append(float(loss if loss.numel() == 1 else loss.float().mean()))
                tokens.append(labels.numel())
                if on_batch is not None:
                    on_batch()
    except NonFiniteAmaxError:  # FP8 casts refuse non-finite tensors: the loss is lost too
        return math.nan
    if len(set(tokens)) <= 1:  # the plain mean, bit for bit what training has always logged
        return sum(losses) / len(losses)
    return sum(loss * count for loss, count in zip(losses, tokens)) / sum(tokens)


class LanguageModelLoss(nn.Module):
    """``model(input_ids)`` (logits, or an output with ``.logits`` as Hugging Face causal LMs
    return) as ``forward(inputs, labels) -> mean cross-entropy``: what :func:`mean_loss` runs.

    Labels are the next tokens already (no shift inside), as :func:`validation_batches` gives.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        output = self.model(inputs)
        logits = getattr(output, "logits", output)
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


# ---------------------------------------------------------------------------------- text in


# Characters encoded at a time by encode_known: bounds its temporaries (about 20 bytes each).
ENCODE_CHUNK = 1 << 20


def encode_known(tokenizer: CharTokenizer, text: str, what: str,
                 dtype: torch.dtype = torch.long) -> Tensor:
    """``text`` as ids of ``dtype``, or one DataError naming every character the tokenizer
    lacks. Vectorised, a chunk at a time: a long text costs its ids and little more."""
    table = torch.full((sys.maxunicode + 1,), -1, dtype=torch.int32)
    table[torch.tensor([ord(c) for c in tokenizer.chars], dtype=torch.long)] = torch.arange(
        tokenizer.vocab_size, dtype=torch.int32)
    ids = torch.empty(len(text), dtype=dtype)
    unknown: Counter = Counter()
    for start in range(0, len(text), ENCODE_CHUNK):
        piece = text[start:start + ENCODE_CHUNK]
        # "surrogatepass": a prompt from the command line may hold escaped undecodable bytes.
        codes = torch.frombuffer(bytearray(piece.encode("utf-32-le", "surrogatepass")),
                                 dtype=torch.int32)
        piece_ids = table[codes.long()]
        missing = piece_ids < 0
        if bool(missing.any()):
            values, counts = torch.unique(codes[missing], return_counts=True)
            unknown.update(dict(zip(map(chr, values.tolist()), counts.tolist())))
        elif not unknown:
            ids[start:start + len(piece)] = piece_ids
    if unknown:
        listed = ", ".join(f"{c!r} ({n}x)" for c, n in unknown.most_common(8))
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise DataError(
            f"{what} has {len(unknown)} character(s) the run's tokenizer does not know: "
            f"{listed}{more}; it knows the {tokenizer.vocab_size} characters of its training text"
        )
    return ids


# ---------------------------------------------------------------------------------- sampling


def next_token(logits: Tensor, temperature: float, top_k: Optional[int],
               generator: torch.Generator) -> int:
    """One token id drawn from ``logits`` (one position's, on the host).

    ``temperature`` 0 takes the most likely token; ``top_k`` keeps the k most likely.
    """
    logits = logits.detach().float()
    if not bool(torch.isfinite(logits).all()):
        raise SamplingError("the model's logits became non-finite")
    if temperature == 0:
        return int(logits.argmax())
    # In float64 (a temperature such as 1e-300 is 0 in float32) and with the most likely token
    # at 0: a tiny temperature then sends the others to -inf, not every logit to +-inf (which
    # softmax would turn into nan).
    logits = (logits.double() - logits.max()) / temperature
    if top_k is not None and top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, -math.inf)
    probabilities = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


def generate(
    run: Runner,
    prompt: Sequence[int],
    tokens: int,
    seq_len: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    seed: int = 0,
    rows: int = 1,
    on_token: Optional[Callable[[int], None]] = None,
) -> List[int]:
    """``tokens`` new token ids after ``prompt``, drawn one at a time.

    The model always sees one window of ``seq_len`` tokens, shape ``(rows, seq_len)``: the
    last ``seq_len`` tokens of the text so far, left-aligned, the rest padding that the causal
    mask hides from the position being predicted. So memory stays one window however long the
    text grows, and an IPU compiles one graph. ``rows`` repeats the window where a device needs
    several rows per call (replicas); row 0 is read. The draw is on the host with a generator
    seeded by ``seed``: the same seed gives the same text.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    generator = torch.Generator().manual_seed(seed)
    context = list(prompt)[-seq_len:]
    window = torch.zeros(rows, seq_len, dtype=torch.long)
    drawn: List[int] = []
    for _ in range(tokens):
        length = len(context)
        window.zero_()
        window[:, :length] = torch.tensor(context, dtype=torch.long)
        logits = run(window)
        token = next_token(logits[0, length - 1], temperature, top_k, generator)
        drawn.append(token)
        if on_token is not None:
            on_token(token)
        context = (context + [token])[-seq_len:]
    return drawn


# ------------------------------------------------------------------------------ FP8 ranges

# Suffix of a cast's site name (see fp8.linear) -> the role it plays.
_ROLE_OF_SUFFIX = {"input": "activation", "weight": "weight", "left": "attention",
                   "right": "attention", "grad_output": "gradient"}


@dataclass
class RoleScaleStats:
    """What the FP8 casts of one role did: underflow is the fraction of nonzero values
    flushed to zero, overflow the fraction of all values beyond the format's max."""

    role: str
    casts: int
    values: int
    underflow: float
    overflow: float


def scale_stats_by_role(records: Sequence[CastRecord]) -> List[RoleScaleStats]:
    """Cast records pooled by role (activation, weight, attention, gradient)."""
    pooled: Dict[str, List[CastRecord]] = {}
    for record in records:
        role = _ROLE_OF_SUFFIX.get(record.site.rsplit(".", 1)[-1], "other")
        pooled.setdefault(role, []).append(record)
    result = []
    for role in ("activation", "weight", "attention", "gradient", "other"):
        group = pooled.get(role)
        if not group:
            continue
        nonzero = sum(r.nonzero for r in group)
        values = sum(r.numel for r in group)
        result.append(RoleScaleStats(
            role=role, casts=len(group), values=values,
            underflow=sum(r.flushed for r in group) / nonzero if nonzero else 0.0,
            overflow=sum(r.saturated for r in group) / values if values else 0.0,
        ))
    return result
