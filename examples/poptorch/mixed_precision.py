"""A float16 model trained with ``poptorch.optim.AdamW(accum_type=torch.float16,
loss_scaling=1024)``, in the style of Graphcore's mixed-precision tutorial (synthetic data).

    ipu-unit-scaling emulate examples/poptorch/mixed_precision.py

PopTorch keeps Adam's first and second moments in float32 unless told otherwise, so the
second moment does not underflow in float16 and ``eps`` stays non-zero.
"""
import poptorch
import torch


class HalfNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        return logits, poptorch.identity_loss(loss, reduction="mean")


def main():
    torch.manual_seed(0)
    labels = torch.randint(0, 4, (512,))
    x = (torch.randn(4, 16)[labels] * 2 + torch.randn(512, 16)).half()
    model = HalfNet().half()
    opts = poptorch.Options().deviceIterations(2)
    opts.Precision.setPartialsType(torch.float16)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=1e-3, accum_type=torch.float16,
                                     loss_scaling=1024)
    training = poptorch.trainingModel(model, opts, optimizer)
    for epoch in range(3):
        losses = []
        for start in range(0, 512, 64):
            logits, loss = training(x[start:start + 64], labels[start:start + 64])
            losses.append(float(loss))
        print(f"epoch {epoch} loss: {sum(losses) / len(losses):.4f}")
    print(f"logits dtype: {logits.dtype}")
    print(f"logits shape: {tuple(logits.shape)}")
    print(f"finite weights: {all(bool(p.isfinite().all()) for p in model.parameters())}")


if __name__ == "__main__":
    main()
