"""A small Optimum Graphcore program, in the style of its ``run_glue.py`` and ``run_clm.py``
examples: a tiny BERT sequence classifier or a tiny GPT-2 causal LM, configured locally (no
Hub), trained with ``IPUTrainer`` pipelined over two IPUs, evaluated, saved with
``save_model`` and reloaded with ``from_pretrained``; for the causal LM, the reloaded model then
runs Optimum's text-generation pipeline. Run unchanged through ``ipu-unit-scaling emulate``;
prints ``loss`` lines (one per step), ``eval_<name> value`` lines, ``reloaded_equal True`` when
the reloaded weights are those saved, and ``generated <text>``.

    ipu-unit-scaling emulate tests/integrations/optimum_program.py --task classification
        [--steps N] [--fp16] [--replicas R] [--out DIRECTORY]
    ipu-unit-scaling emulate tests/integrations/optimum_program.py --task causal-lm ...

The data is synthetic: for classification, sequences whose tokens all come from one half of
the vocabulary, the label saying which half, and a first token of its own for each class
(learnt in a few steps); for the causal LM, counting sequences
(``w5 w6 w7 ...``), each token the one after the last.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Any, Dict, List

import numpy as np
import torch
from datasets import Dataset
from optimum.graphcore import IPUConfig, IPUTrainer, IPUTrainingArguments, pipeline
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

VOCAB, SEQUENCE, SAMPLES = 64, 16, 512


def classification_data() -> Dataset:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=SAMPLES)
    half = VOCAB // 2
    ids = rng.integers(3, half, size=(SAMPLES, SEQUENCE)) + half * labels[:, None]
    ids[:, 0] = 1 + labels  # the [CLS] position: a token of its own for each class
    return Dataset.from_dict({
        "input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(),
        "token_type_ids": np.zeros_like(ids).tolist(), "labels": labels.tolist()})


def counting_data() -> Dataset:
    starts = np.random.default_rng(0).integers(1, VOCAB, size=SAMPLES)
    ids = [[1 + (int(s) + k) % (VOCAB - 1) for k in range(SEQUENCE)] for s in starts]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQUENCE] * SAMPLES,
                              "labels": ids})


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer of the words ``<eos> w1 ... w63``, built here (no Hub)."""
    words = ["<eos>"] + [f"w{i}" for i in range(1, VOCAB)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>",
                                   pad_token="<eos>")


def accuracy(prediction: Any) -> Dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, -1)
                               == prediction.label_ids).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("classification", "causal-lm"), required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fp16", action="store_true", help="train in float16")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--out", default=None, help="where save_model writes (a temporary "
                        "directory by default)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="optimum-program-")
    torch.manual_seed(0)
    if args.task == "classification":
        data = classification_data()
        config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=128,
                            max_position_embeddings=SEQUENCE, num_labels=2)
        model: Any = BertForSequenceClassification(config)
        # 2 IPUs: embeddings and layer 0, then layer 1 and the classifier: 2 stages, 3 when
        # training; 4 micro-batches accumulated, 2 device iterations.
        accumulation, iterations, metrics = 4, 2, accuracy
    else:
        data = counting_data()
        config = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQUENCE, n_embd=64, n_layer=2,
                            n_head=2, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
        # The LM head, tied to the embedding, goes back to IPU 0: 3 stages, 5 when training,
        # so PopTorch needs at least 5 micro-batches accumulated.
        accumulation, iterations, metrics = 8, 1, None
    ipu_config = IPUConfig(layers_per_ipu=[1, 1], ipus_per_replica=2,
                           gradient_accumulation_steps=accumulation,
                           device_iterations=iterations, replication_factor=args.replicas,
                           inference_device_iterations=iterations,
                           executable_cache_dir="disabled")
    training_args = IPUTrainingArguments(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=args.steps, learning_rate=2e-3, warmup_steps=0, logging_steps=1,
        fp32=not args.fp16, report_to="none", dataloader_drop_last=True, save_strategy="no",
        seed=0)
    trainer = IPUTrainer(model=model, ipu_config=ipu_config, args=training_args,
                         train_dataset=data, eval_dataset=data.select(range(64)),
                         compute_metrics=metrics)
    trainer.train()
    losses: List[float] = [entry["loss"] for entry in trainer.state.log_history
                           if "loss" in entry]
    for loss in losses:
        print("loss", loss)
    for name, value in trainer.evaluate().items():
        if isinstance(value, float) and math.isfinite(value):
            print(name, value)
    trainer.save_model(out)
    saved = {k: v.float() for k, v in trainer.model.state_dict().items()}
    reloaded = type(model).from_pretrained(out)
    state = reloaded.state_dict()
    print("reloaded_equal", all(torch.equal(state[k].float(), v) for k, v in saved.items()
                                if k in state))
    print("saved_files", " ".join(sorted(os.listdir(out))))
    if args.task == "causal-lm":
        print("generated", generate(reloaded, args.fp16))
        # The same with Optimum's own switch that runs its decoder as a plain module on the
        # host instead of through poptorch.inferenceModel.
        os.environ["DEBUG_RUN_DECODER_ON_CPU"] = "1"
        print("generated_without_poptorch", generate(type(model).from_pretrained(out),
                                                     args.fp16))


def generate(model: Any, fp16: bool) -> List[int]:
    """Greedy decoding of three tokens after ``w3 w4 w5`` by Optimum's text-generation
    pipeline, on one IPU."""
    generator = pipeline("text-generation", model=model, tokenizer=word_tokenizer(),
                         ipu_config=IPUConfig(layers_per_ipu=[2], ipus_per_replica=1),
                         fp16=fp16, max_length=SEQUENCE)
    return list(generator("w3 w4 w5", max_new_tokens=3, do_sample=False,
                          return_tensors=True)[0]["generated_token_ids"])


if __name__ == "__main__":
    main()
