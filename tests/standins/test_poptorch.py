"""The PopTorch stand-in against PopTorch's documented behaviour: output modes and batching,
options checks, the one-final-loss rule, fixed input shapes, pipeline stage counting, the
host weights, half partials and the IPU Model's GELU gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._numerics import half_partials_matmul
from ipu_unit_scaling.ops.ipu_lowering import popart_gelu_slope


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


class _WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, target):
        out = self.lin(x)
        return out, F.mse_loss(out, target)


def _inference(mode, period=None, iterations=4):
    torch.manual_seed(0)
    model = _Linear()
    opts = poptorch.Options().deviceIterations(iterations)
    if mode is not None:
        opts.outputMode(mode, period)
    return model, poptorch.inferenceModel(model, opts)


@pytest.mark.parametrize("mode", [None, poptorch.OutputMode.All])
def test_inference_all_returns_every_micro_batch(mode):
    model, ipu = _inference(mode)
    x = torch.randn(8, 3)
    out = ipu(x)
    assert out.shape == (8, 2)
    torch.testing.assert_close(out, model(x).detach())


def test_inference_final_sum_and_every_n():
    model, _ = _inference(None)
    x = torch.randn(8, 3)
    native = model(x).detach()
    _, final = _inference(poptorch.OutputMode.Final)
    final.model.load_state_dict(model.state_dict())
    assert final(x).shape == (2, 2)
    torch.testing.assert_close(final(x), native[6:])
    _, summed = _inference(poptorch.OutputMode.Sum)
    summed.model.load_state_dict(model.state_dict())
    # Four float32 sums of two rows: a few units of float32 roundoff.
    torch.testing.assert_close(summed(x), native.view(4, 2, 2).sum(0), rtol=1e-6, atol=1e-6)
    _, every = _inference(poptorch.OutputMode.EveryN, period=2)
    every.model.load_state_dict(model.state_dict())
    assert every(x).shape == (4, 2)
    torch.testing.assert_close(every(x), torch.cat([native[2:4], native[6:8]]))


def test_training_defaults_to_final_and_all_stacks_losses():
    torch.manual_seed(0)
    x, target = torch.randn(12, 3), torch.randn(12, 2)
    model = _WithLoss()
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3))
    assert ipu.options.output_mode == poptorch.OutputMode.Final
    out, loss = ipu(x, target)
    assert out.shape == (4, 2) and loss.shape == ()
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    opts.outputMode(poptorch.OutputMode.All)
    out, loss = poptorch.trainingModel(_WithLoss(), opts)(x, target)
    assert out.shape == (12, 2) and loss.shape == (6,)


def test_training_updates_host_weights_when_read():
    torch.manual_seed(0)
    model = _WithLoss()
    before = model.lin.weight.detach().clone()
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, target = torch.randn(4, 3), torch.randn(4, 2)
    losses = [float(ipu(x, target)[1]) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert not torch.equal(model.lin.weight.detach(), before)  # copied back when read


def test_options_refuse_unknown_names_and_bad_values():
    opts = poptorch.Options()
    with pytest.raises(AttributeError):
        opts.notAnOption  # noqa: B018
    with pytest.raises(AssertionError, match="Invalid option"):
        opts.set(notAnOption=1)
    with pytest.raises(AssertionError, match="EveryN"):
        opts.outputMode(poptorch.OutputMode.EveryN)
    with pytest.raises(AssertionError, match="numIOTiles"):
        opts.TensorLocations.numIOTiles(33)
    with pytest.raises(ValueError):
        opts.Training.accumulationAndReplicationReductionType(
            poptorch.ReductionType.NoReduction)
    opts._Popart.set("notAPopartOption", True)
    with pytest.raises(poptorch.Error, match="Unknown bool option notAPopartOption"):
        poptorch.inferenceModel(_Linear(), opts)(torch.randn(1, 3))


def test_options_freeze_once_used():
    opts = poptorch.Options()
    poptorch.trainingModel(_WithLoss(), opts)
    with pytest.raises(AttributeError, match="frozen"):
        opts.deviceIterations(2)


def test_inference_refuses_gradient_accumulation():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradientAccumulation to 1"):
        poptorch.inferenceModel(_Linear(), opts)


def test_batch_must_divide_into_micro_batches():
    ipu = poptorch.inferenceModel(_Linear(), poptorch.Options().deviceIterations(3))
    with pytest.raises(AssertionError, match="must be a multiple of"):
        ipu(torch.randn(4, 3))


class _NoLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) * 2


class _TwoLosses(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, target):
        out = self.lin(x)
        return out, F.mse_loss(out, target) + F.l1_loss(out, target)


class _WrappedLosses(_TwoLosses):
    def forward(self, x, target):
        out = self.lin(x)
        total = F.mse_loss(out, target) + F.l1_loss(out, target)
        return out, poptorch.identity_loss(total, reduction="sum")


def test_training_needs_exactly_one_final_loss():
    x, target = torch.randn(2, 3), torch.randn(2, 2)
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph"):
        poptorch.trainingModel(_NoLoss())(x)
    with pytest.raises(poptorch.Error, match="Multiple independent losses found"):
        poptorch.trainingModel(_TwoLosses())(x, target)
    _, loss = poptorch.trainingModel(_WrappedLosses())(x, target)
    assert loss.shape == ()


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_identity_loss_reductions(reduction):
    x = torch.tensor([1.0, 2.0, 4.0])
    expected = {"sum": x.sum(), "mean": x.mean(), "none": x}[reduction]
    torch.testing.assert_close(poptorch.identity_loss(x, reduction), expected)


def test_new_input_shapes_after_compile_are_refused():
    ipu = poptorch.inferenceModel(_Linear())
    ipu(torch.randn(2, 3))
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for x: expected torch.Size"):
        ipu(torch.randn(4, 3))
    with pytest.raises(poptorch.Error, match="Data type mismatch"):
        ipu(torch.randn(2, 3, dtype=torch.float64))
    ipu.destroy()
    assert ipu(torch.randn(4, 3)).shape == (4, 2)  # recompiled


class _Tied(torch.nn.Module):
    """BERT's layout: embedding on IPU 0, three encoder stages, the tied head back on 0."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        for ipu, layer in enumerate(self.layers, start=1):
            poptorch.BeginBlock(layer, ipu_id=ipu)

    def forward(self, ids):
        with poptorch.Block(ipu_id=0):
            h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        poptorch.Block.start(ipu_id=0)
        logits = h @ self.embed.weight.t()
        return logits, F.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("accumulation, refused", [(8, True), (9, False)])
def test_tied_head_counts_five_stages(accumulation, refused):
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(accumulation)
    ids = torch.randint(0, 10, (accumulation, 3))
    ipu = poptorch.trainingModel(_Tied(), opts)
    if refused:
        with pytest.raises(poptorch.Error, match=r"pipeline stages \(9\)"):
            ipu(ids)
    else:
        assert ipu(ids)[1].shape == ()


def test_sharded_execution_has_no_pipeline_rule():
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    ipu = poptorch.trainingModel(_Tied(), opts)
    assert ipu(torch.randint(0, 10, (1, 3)))[1].shape == ()


def test_half_partials_accumulate_in_float16():
    # Sums of 4096 products in [0, 1): float partials round once, float16 partial sums (blocks
    # of 16, then a tree: tests/standins/test_poptorch_numerics_partials.py) round at every
    # level, and so differ from the float result in many elements.
    g = torch.Generator().manual_seed(0)
    a = torch.rand(4, 4096, generator=g).half()
    b = torch.rand(4096, 4, generator=g).half()

    class Dot(torch.nn.Module):
        def forward(self, x, y):
            return x @ y

    opts = poptorch.Options()
    opts.Precision.setPartialsType(torch.half)
    half = poptorch.inferenceModel(Dot(), opts)(a, b).double()
    single = poptorch.inferenceModel(Dot())(a, b).double()
    exact = a.double() @ b.double()  # products >= 0: the sum is its magnitude
    # float partials: one float16 rounding (and float32's, 4096 u32); half partials: one per
    # block and per tree level (9 levels over 256 blocks) plus 16 u32 per block.
    u16, u32 = 2.0**-11, 2.0**-24
    assert bool(((single - exact).abs() <= 1.01 * (u16 + 4096 * u32) * exact).all())
    assert bool(((half - exact).abs() <= 1.01 * (10 * u16 + 16 * u32) * exact).all())
    assert float((half != single).double().mean()) > 0.1
    assert half_partials_matmul(a, b).dtype == torch.float16


class _Gelu(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x):
        return poptorch.identity_loss(F.gelu(self.w * x), reduction="sum")


@pytest.mark.parametrize("ipu_model", [False, True])
def test_gelu_gradient_of_hardware_and_ipu_model(ipu_model):
    w = torch.linspace(-3, 3, 13)
    opts = poptorch.Options()
    if ipu_model:
        opts.useIpuModel(True)
    model = _Gelu(w)
    ipu = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1.0))
    ipu(torch.ones(1))
    if ipu_model:
        v = w.clone().requires_grad_()
        F.gelu(v, approximate="tanh").sum().backward()
        slope = v.grad
    else:
        slope = popart_gelu_slope(w)
    # One SGD step of lr 1: w - slope, in float32 (a few ulps of |w| <= 3).
    torch.testing.assert_close(model.w.detach(), w - slope, rtol=0, atol=4e-6)
    other = popart_gelu_slope(w) if ipu_model else None
    if other is not None:  # the two gradients differ, so the test tells them apart
        assert (other - slope).abs().max() > 100 * 4e-6
