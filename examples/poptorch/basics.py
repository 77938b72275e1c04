"""A small classifier trained with PopTorch, in the style of Graphcore's basics tutorial
(synthetic data: two Gaussian blobs per class, no download).

Runs on an IPU with the Poplar SDK, or on a CPU with the package's PopTorch stand-in:

    ipu-unit-scaling emulate examples/poptorch/basics.py

Prints one line per epoch (mean loss) and the shapes the model returned, as
``key: value`` lines.
"""
import poptorch
import torch


class Classifier(torch.nn.Module):
    def __init__(self, features=8, classes=4):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return logits
        return logits, self.loss(logits, labels)


def synthetic(samples=512, features=8, classes=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    centres = torch.randn(classes, features, generator=generator) * 3
    x = centres[labels] + torch.randn(samples, features, generator=generator)
    return torch.utils.data.TensorDataset(x, labels)


def main():
    torch.manual_seed(0)
    model = Classifier()
    opts = poptorch.Options().deviceIterations(4)
    loader = poptorch.DataLoader(opts, synthetic(), batch_size=16, shuffle=True)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05)
    training = poptorch.trainingModel(model, options=opts, optimizer=optimizer)
    for epoch in range(3):
        losses = []
        for x, labels in loader:
            logits, loss = training(x, labels)
            losses.append(float(loss))
        print(f"epoch {epoch} loss: {sum(losses) / len(losses):.4f}")
    print(f"combined batch: {loader.combinedBatchSize}")
    print(f"training logits shape: {tuple(logits.shape)}")
    print(f"training loss shape: {tuple(loss.shape)}")
    training.detachFromDevice()

    model.eval()
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(4))
    x, labels = next(iter(loader))
    predictions = inference(x).argmax(dim=1)
    print(f"inference logits shape: {tuple(inference(x).shape)}")
    print(f"accuracy: {float((predictions == labels).float().mean()):.3f}")


if __name__ == "__main__":
    main()
