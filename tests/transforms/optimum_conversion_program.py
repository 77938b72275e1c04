"""FP8 and unit scaling through Optimum Graphcore's ``IPUTrainer``, as the guide's recipe
does it: the model is made pipelined first (``to_pipelined``), converted, then given to the
trainer, which keeps the converted pipelined model (a deep copy) and parallelises it.

    ipu-unit-scaling emulate tests/transforms/optimum_conversion_program.py \
        --conversion fp8|unit_scale [--fp16] [--steps N]
    ipu-unit-scaling emulate tests/transforms/optimum_conversion_program.py --refused fp8

Prints ``loss`` lines, ``converted N`` (the trained model's converted layers), ``changed N``
(those whose weights training changed), ``pipelined True`` when every encoder layer carries
PopTorch's block, ``reloaded_equal True`` when ``save_model``'s files load into a plain
transformers model with the trained weights; with ``--refused``, the one line ``IPUTrainer``
refuses a model converted before ``to_pipelined`` with.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List

import numpy as np
import torch
from datasets import Dataset
from optimum.graphcore import IPUConfig, IPUTrainer, IPUTrainingArguments
from optimum.graphcore.modeling_utils import to_pipelined
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from ipu_unit_scaling.fp8 import FP8Config
from ipu_unit_scaling.transforms import simulate_fp8, unit_scale

VOCAB, SEQUENCE, SAMPLES = 64, 16, 256


def data() -> Dataset:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=SAMPLES)
    half = VOCAB // 2
    ids = rng.integers(2, half, size=(SAMPLES, SEQUENCE)) + half * labels[:, None]
    return Dataset.from_dict({
        "input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(),
        "token_type_ids": np.zeros_like(ids).tolist(), "labels": labels.tolist()})


def counting_data() -> Dataset:
    starts = np.random.default_rng(0).integers(1, VOCAB, size=SAMPLES)
    ids = [[1 + (int(s) + k) % (VOCAB - 1) for k in range(SEQUENCE)] for s in starts]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQUENCE] * SAMPLES,
                              "labels": ids})


def convert(model: Any, conversion: str) -> Any:
    if conversion == "fp8":
        return simulate_fp8(model, FP8Config())
    # Example inputs passed as the trainer passes its batches: every column, by keyword.
    ids = torch.randint(2, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "token_type_ids": torch.zeros_like(ids), "labels": torch.tensor([0, 1])}
    return unit_scale(model, (), batch, keep_structure=True)


def converted_layers(model: Any) -> Dict[str, Any]:
    kinds = ("FP8", "ipu_unit_scaling.")
    return {name: module for name, module in model.named_modules()
            if name and type(module).__name__.startswith(kinds[0])
            or type(module).__module__.startswith(kinds[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversion", choices=("fp8", "unit_scale"))
    parser.add_argument("--refused", choices=("fp8", "unit_scale"))
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", choices=("bert", "gpt2"), default="bert")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=SEQUENCE, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    # GPT-2's head, tied to the embedding, goes back to IPU 0: 5 stages when training.
    ipu_config = IPUConfig(layers_per_ipu=[1, 1], ipus_per_replica=2,
                           gradient_accumulation_steps=4 if args.model == "bert" else 8,
                           device_iterations=1, executable_cache_dir="disabled")
    training_args = IPUTrainingArguments(
        output_dir="out", per_device_train_batch_size=2, max_steps=args.steps,
        learning_rate=1e-2, warmup_steps=0, logging_steps=1, fp32=not args.fp16,
        report_to="none", dataloader_drop_last=True, save_strategy="no", seed=0)
    model: Any = BertForSequenceClassification(config)
    train_dataset = data()
    if args.model == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        train_dataset = counting_data()
    if args.refused:
        try:
            IPUTrainer(model=convert(model, args.refused), ipu_config=ipu_config,
                       args=training_args, train_dataset=train_dataset)
        except Exception as error:  # the trainer's to_pipelined
            print("refused", type(error).__name__, str(error).splitlines()[0])
            return
        print("accepted")
        return
    pipelined = convert(to_pipelined(model, ipu_config), args.conversion)
    before = {name: layer.weight.detach().clone()
              for name, layer in converted_layers(pipelined).items()
              if isinstance(getattr(layer, "weight", None), torch.Tensor)}
    trainer = IPUTrainer(model=pipelined, ipu_config=ipu_config, args=training_args,
                         train_dataset=train_dataset)
    trainer.train()
    losses: List[float] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    for loss in losses:
        print("loss", loss)
    trained = converted_layers(trainer.model)
    print("converted", len(trained))
    changed = [name for name, weight in before.items()
               if name in trained and not torch.equal(
                   trained[name].weight.detach().float(), weight.float())]
    print("changed", len(changed), "of", len(before))
    layers = trainer.model.bert.encoder.layer if args.model == "bert" \
        else trainer.model.transformer.h
    print("pipelined", all(layer._forward_pre_hooks for layer in layers))
    print("model_class", type(trainer.model).__name__)
    # save_model deparallelises the model (walking its layers back), saves, parallelises again.
    trainer.save_model("saved")
    saved = {k: v.float() for k, v in trainer.model.state_dict().items()}
    state = type(model).from_pretrained("saved").state_dict()
    print("reloaded_equal", state.keys() == saved.keys()
          and all(torch.equal(state[k].float(), v) for k, v in saved.items()))


if __name__ == "__main__":
    main()
