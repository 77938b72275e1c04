"""A model split over two IPUs with ``poptorch.Block``, trained as a pipeline, in the style
of Graphcore's pipelining tutorial (synthetic regression data).

    ipu-unit-scaling emulate examples/poptorch/pipelining.py [--gradient-accumulation N]

Two forward stages make 2 x 2 - 1 = 3 training stages, so PopTorch needs a gradient
accumulation of at least 3; with less, the model is refused when it compiles.
"""
import argparse

import poptorch
import torch


class TwoStages(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh())
        self.second = torch.nn.Linear(width, 1)

    def forward(self, x, target):
        with poptorch.Block("first", ipu_id=0):
            hidden = self.first(x)
        with poptorch.Block("second", ipu_id=1):
            out = self.second(hidden)
            loss = torch.nn.functional.mse_loss(out, target)
        return out, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gradient-accumulation", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    target = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        poptorch.Stage("first").ipu(0), poptorch.Stage("second").ipu(1)))
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.outputMode(poptorch.OutputMode.All)
    model = TwoStages()
    training = poptorch.trainingModel(
        model, opts, poptorch.optim.Adam(model.parameters(), lr=0.01))
    rows = 8 * args.gradient_accumulation
    for epoch in range(4):
        losses = []
        for start in range(0, x.shape[0] - rows + 1, rows):
            out, loss = training(x[start:start + rows], target[start:start + rows])
            losses.append(float(loss.mean()))
        print(f"epoch {epoch} loss: {sum(losses) / len(losses):.5f}")
    print(f"output shape: {tuple(out.shape)}")
    print(f"loss shape: {tuple(loss.shape)}")


if __name__ == "__main__":
    main()
