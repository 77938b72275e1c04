"""What float16 with half partials costs under `ipu-unit-scaling emulate`:
`python -m benchmarks.emulate_fp16`.

A float16 model trained with ``opts.Precision.setPartialsType(torch.half)`` runs on the PopTorch
stand-in's model of float16 partial sums (``ipu_standins/poptorch/_numerics.py``: blocks of 16
products summed in float32 and rounded to float16, the block sums added pairwise in float16).
This times one training step (``poptorch.trainingModel``: forward, backward and SGD update) of
a Hugging Face BERT classifier built from a config (2 layers, width 64, 4 heads, sequences of
128 tokens, batches of 8, synthetic tokens), in three forms interleaved round by round
(:func:`benchmarks.measure.time_interleaved`, the process's CPU time, one torch thread):
float32; float16 with half partials; float16 with float partials (PopTorch's default). It
prints each step's median and each float16 step's ratio to the float32 step (median and
quartiles of the per-round ratios). The target: half partials at most 2x the float32 step.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from .heap import DEFAULT, HEAPS, set_heap
from .measure import Timings, time_interleaved
from .report import cpu_model

HALF_PARTIALS_TARGET = 2.0

FLOAT32 = "float32"
HALF_PARTIALS = "float16, half partials"
FLOAT_PARTIALS = "float16, float partials"
FORMS = (FLOAT32, HALF_PARTIALS, FLOAT_PARTIALS)


@dataclass(frozen=True)
class BertShape:
    layers: int = 2
    width: int = 64
    heads: int = 4
    seq_len: int = 128
    batch: int = 8
    vocab: int = 1000


QUICK = BertShape(layers=1, width=16, heads=2, seq_len=8, batch=2, vocab=50)


def training_step(form: str, shape: BertShape) -> Callable[[], object]:
    """One ``poptorch.trainingModel`` step of the BERT of ``shape`` in ``form`` (the model and
    its batch made here, compiled on the first call)."""
    from transformers import BertConfig, BertForSequenceClassification

    import ipu_standins.poptorch as poptorch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=shape.vocab, hidden_size=shape.width,
                        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                        intermediate_size=4 * shape.width,
                        max_position_embeddings=shape.seq_len)  # (two labels by default)
    # Attention as explicit matmuls: the only form in transformers 4.29, Optimum Graphcore's pin.
    config._attn_implementation = "eager"
    bert = BertForSequenceClassification(config)
    if form != FLOAT32:
        bert = bert.half()

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> object:
            logits = self.bert(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            return logits, poptorch.identity_loss(loss, reduction="mean")

    options = poptorch.Options()
    if form == HALF_PARTIALS:
        options.Precision.setPartialsType(torch.half)
    model = poptorch.trainingModel(Classifier(), options,
                                   poptorch.optim.SGD(bert.parameters(), lr=1e-3))
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len))
    labels = torch.randint(0, 2, (shape.batch,))
    return lambda: model(ids, labels)


def emulate_fp16_timings(shape: BertShape, rounds: int, min_run_time: float,
                         clock: str = "cpu") -> Timings:
    steps: Dict[str, Callable[[], object]] = {form: training_step(form, shape) for form in FORMS}
    return time_interleaved(steps, rounds=rounds, min_run_time=min_run_time, clock=clock)


def report(timings: Timings) -> List[str]:
    lines = [f"{form}: {timings.median_ms(form):.1f} ms a step" for form in FORMS]
    for form in (HALF_PARTIALS, FLOAT_PARTIALS):
        low, high = timings.spread(form, FLOAT32)
        ratio = timings.ratio(form, FLOAT32)
        line = f"{form} / {FLOAT32}: {ratio:.2f}x (quartiles {low:.2f}-{high:.2f})"
        if form == HALF_PARTIALS:
            met = "met" if ratio <= HALF_PARTIALS_TARGET else "missed"
            line += f", target at most {HALF_PARTIALS_TARGET:.1f}x: {met}"
        lines.append(line)
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.emulate_fp16",
                                     description=__doc__)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--quick", action="store_true", help="tiny BERT: checks the harness")
    parser.add_argument("--heap", choices=HEAPS, default=DEFAULT,
                        help="default (glibc's defaults, as an `emulate` run has them) or kept")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("python -m benchmarks.emulate_fp16 needs transformers (pip install transformers)",
              file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = QUICK if args.quick else BertShape()
        rounds = 1 if args.quick else args.rounds
        print(f"CPU: {cpu_model()}, {os.cpu_count()} logical cores, 1 torch thread, "
              f"torch {torch.__version__}; heap: {set_heap(args.heap)}")
        print(f"BERT {shape.layers} layers, width {shape.width}, {shape.heads} heads, "
              f"sequences of {shape.seq_len}, batches of {shape.batch}: a poptorch.trainingModel "
              f"step (forward, backward, SGD), process CPU time, {rounds} rounds")
        timings = emulate_fp16_timings(shape, rounds=rounds,
                                       min_run_time=0.01 if args.quick else 1.0)
        for line in report(timings):
            print(line)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
