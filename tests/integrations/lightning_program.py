"""A small Lightning program for an IPU: a classifier pipelined over two IPUs with
``poptorch.BeginBlock``, trained with lightning-graphcore's ``IPUStrategy`` in "16-mixed"
precision (the model cast with ``.half()``, as lightning-graphcore's own half-precision test
does), then validated and tested. Run unchanged through ``ipu-unit-scaling emulate``; prints
one ``loss`` line per training step (the step's last micro-batch, PopTorch's output mode
Final), then the ``validate`` and ``test`` results as Lightning returns them.

    ipu-unit-scaling emulate tests/integrations/lightning_program.py [--strategy lightning]
        [--epochs N] [--save DIRECTORY]

``--strategy lightning`` uses Lightning 2.0's own ``accelerator="ipu"`` instead of
lightning-graphcore's strategy.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Dict

import lightning.pytorch as pl
import poptorch
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

FEATURES, CLASSES, SAMPLES = 16, 4, 512


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(FEATURES, 32)
        self.norm = torch.nn.BatchNorm1d(32)  # buffers too, in what a user saves after fit
        self.hidden = poptorch.BeginBlock(torch.nn.Linear(32, 32), ipu_id=1)
        self.head = torch.nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.norm(self.embed(x))))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        print(f"loss {float(loss.float().mean())}", flush=True)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x).argmax(-1) == y).float().mean()

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        # Logged on the host: the step itself runs as the IPU's compiled graph.
        self.log("val_accuracy", outputs.float().mean())

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self.log("test_loss", outputs.float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(options: poptorch.Options, micro_batch: int = 8) -> poptorch.DataLoader:
    """The program's samples, each call's micro-batches together, as PopTorch batches them."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :CLASSES] * 2).argmax(-1)  # learnable: the largest of the first four features
    return poptorch.DataLoader(options, TensorDataset(x, y), batch_size=micro_batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["graphcore", "lightning"], default="graphcore")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save", help="a directory: the trained state dict and checkpoint")
    args = parser.parse_args()
    pl.seed_everything(0)
    pipelined = poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu)
    # A pipeline of two stages: training needs at least 2 x 2 - 1 micro-batches a step,
    # inference at least two device iterations.
    training = poptorch.Options().setExecutionStrategy(pipelined)
    training.Training.gradientAccumulation(4)
    inference = poptorch.Options().deviceIterations(2).setExecutionStrategy(pipelined)
    settings: Dict[str, Any] = dict(
        devices=1, max_epochs=args.epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, num_sanity_val_steps=0)
    if args.strategy == "graphcore":
        from lightning_graphcore import IPUAccelerator, IPUPrecision, IPUStrategy

        trainer = pl.Trainer(
            accelerator=IPUAccelerator(), strategy=IPUStrategy(
                training_opts=training, inference_opts=inference,
                precision_plugin=IPUPrecision("16-mixed")), **settings)
    else:
        from lightning.pytorch.strategies import IPUStrategy as LightningIPUStrategy

        trainer = pl.Trainer(
            accelerator="ipu", precision="16-mixed", strategy=LightningIPUStrategy(
                training_opts=training, inference_opts=inference), **settings)
    model = Classifier().half()
    trainer.fit(model, data(training), data(inference))
    if args.save:
        torch.save(model.state_dict(), os.path.join(args.save, "state_dict.pt"))
        trainer.save_checkpoint(os.path.join(args.save, "trained.ckpt"))
    accuracy = trainer.validate(model, data(inference), verbose=False)
    test = trainer.test(model, data(inference), verbose=False)
    print(f"validate {accuracy}", flush=True)
    print(f"test {test}", flush=True)
    assert all(math.isfinite(v) for v in [*accuracy[0].values(), *test[0].values()])


if __name__ == "__main__":
    main()
