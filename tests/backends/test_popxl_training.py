"""The PopXL decoder and training model, run on the torch stand-in for PopXL
(``ipu_standins/popxl/``), against the PyTorch model and the CPU
backend.

Every test here runs on the stand-in, not on PopXL;
``tests/backends/test_popxl_training_ipu.py`` runs the same code on real PopXL where it
imports.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Tuple

import pytest
import torch
from helpers import relative

import ipu_standins.popxl as popxl_standin
import ipu_unit_scaling as uu
from ipu_standins import popxl_settings
from ipu_unit_scaling.backends import backend_named, build_training_model, make_optimizer
from ipu_unit_scaling.backends.pipeline_stages import ipu_stages
from ipu_unit_scaling.backends.popxl import (
    PopXLTrainingModel,
    check_config,
    loss_and_gradients,
    popxl_available,
)
from ipu_unit_scaling.fp8 import (
    FP8Config,
    Fp8Tensor,
    NonFiniteAmaxError,
    cast_to_fp8,
)
from ipu_unit_scaling.fp8 import linear as fp8_linear_module
from ipu_unit_scaling.fp8 import log2_scale as log2_scale_of
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import (
    Config,
    PrecisionConfig,
    load_config,
    scheduled_learning_rate,
)
from ipu_unit_scaling.transforms import simulate_fp8

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

VOCAB, SEQ = 11, 8


def tiny_decoder(bias: bool = False, seed: int = 0) -> uu.GPT:
    torch.manual_seed(seed)
    return uu.GPT(vocab_size=VOCAB, hidden_size=16, depth=2, heads=2,
                                 seq_len=SEQ, bias=bias)


def batch(seed: int = 0, rows: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=gen),
            torch.randint(0, VOCAB, (rows, SEQ), generator=gen))


def torch_step(model):
    ids, labels = batch()
    model.zero_grad()
    loss, logits = model(ids, labels, return_logits=True)
    loss.backward()
    return loss.item(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp32_loss_and_every_gradient_match_torch_on_the_standin(bias):
    model = tiny_decoder(bias)
    loss, logits, grads = torch_step(model)
    result = loss_and_gradients(model, *batch(), xl=popxl_standin)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(result.logits, logits, rtol=1e-5, atol=1e-5)
    assert set(result.gradients) == set(grads) and len(grads) == (29 if bias else 16)
    for name, grad in grads.items():
        torch.testing.assert_close(result.gradients[name], grad, rtol=1e-5, atol=1e-5,
                                   msg=name)
    assert result.non_finite == 0


def simulated_fp8(model, config):
    """simulate_fp8's loss, gradients, every cast it made and every cast's float32 input, by
    site."""
    casts, cast_inputs = {}, {}
    original = fp8_linear_module.cast_to_fp8

    def recording(x, *args, **kwargs):
        result = original(x, *args, **kwargs)
        casts[kwargs["site"]] = result
        cast_inputs[kwargs["site"]] = x.detach().clone()
        return result

    fp8_model = simulate_fp8(copy.deepcopy(model), config)
    fp8_linear_module.cast_to_fp8 = recording
    try:
        loss, _, grads = torch_step(fp8_model)
    finally:
        fp8_linear_module.cast_to_fp8 = original
    return loss, grads, casts, cast_inputs


# How far two float32 computations of the same tensor, with sums in another order or in other
# SIMD kernels, may drift apart, as a fraction of the tensor's amax: a few float32 ulps of the
# largest term, with room to spare (the gradients are compared with rtol=1e-5 too).
FLOAT32_DRIFT = 1e-5


def assert_cast_within_float32_drift(codes: torch.Tensor, log2_scale: int, x: torch.Tensor,
                                     expected: Fp8Tensor, config: FP8Config, role: str):
    """``codes`` and ``log2_scale`` are an FP8 cast, with ``config``'s rule for ``role``, of a
    tensor that differs from ``x`` by float32 rounding only (``FLOAT32_DRIFT``); ``expected``
    is ``x``'s own cast. The scale is one that such a tensor's amax gives, and each code one
    that such a value rounds to. Where ``x`` is further than the drift from an FP8 rounding
    boundary, that is exactly ``x``'s own code; near a boundary the neighbour is allowed too,
    and near zero, where E5M2's subnormals resolve the rounding noise itself, any code within
    the drift of zero is."""
    fmt = expected.fmt
    drift = FLOAT32_DRIFT * float(x.abs().max())
    if config.scaling == "amax":
        margin = {"input": config.activation_margin, "weight": config.weight_margin,
                  "grad_output": config.gradient_margin}[role]
        amax = float(x.abs().max())
        scales = {log2_scale_of(max(amax - drift, 0.0), fmt, margin),
                  log2_scale_of(amax + drift, fmt, margin)}
        assert expected.log2_scale in scales
        assert log2_scale in scales
    else:
        assert log2_scale == expected.log2_scale == 0

    def cast(values: torch.Tensor) -> torch.Tensor:
        return cast_to_fp8(values, fmt, log2_scale=log2_scale, overflow=config.overflow,
                           rounding=config.rounding).dequantise()

    value = Fp8Tensor(codes, log2_scale, fmt).dequantise()
    low, high = cast(x - drift), cast(x + drift)
    outside = (value < low) | (value > high)
    assert not outside.any(), (
        f"{int(outside.sum())} codes are not FP8 roundings of the input within float32 drift, "
        f"first at {outside.nonzero()[0].tolist()}")


@pytest.mark.parametrize("scaling", ["amax", "static"])
def test_fp8_with_unrounded_matmul_output_equals_simulate_fp8_on_the_standin(scaling):
    """With matmul_pow2scaled's sum left in float32 (a stand-in knob), the PopXL model and
    simulate_fp8 are the same computation up to float32 rounding: the weights' casts are
    identical, every other cast, forward and backward, is what simulate_fp8's input gives
    within that rounding, and the loss and gradients agree to float32 rounding. (Where a
    gradient is exactly zero in one and rounding noise in the other, as in the first causal
    query row, AMAX scaling resolves the noise into nonzero E5M2 codes: bit-equal codes there
    would test the CPU's SIMD kernels, not the model.)"""
    model, config = tiny_decoder(), FP8Config(scaling=scaling)
    loss, grads, casts, cast_inputs = simulated_fp8(model, config)
    with popxl_settings.fp8_matmul_output(torch.float32):
        result = loss_and_gradients(model, *batch(), fp8=config, xl=popxl_standin,
                                    keep_values=True)
    values = result.session.values
    assert len(result.casts) == len(casts) == 9 * 3  # 9 linear layers: input, weight, grad
    for cast in result.casts:
        name = f"{cast.site}.{cast.role}"
        codes = values[cast.codes].reshape(casts[name].codes.shape)
        if cast.role == "weight":  # the same values, so the same codes, bit for bit
            assert int(values[cast.log2_scale]) == casts[name].log2_scale, name
            assert torch.equal(codes, casts[name].codes), name
        else:
            try:
                assert_cast_within_float32_drift(codes, int(values[cast.log2_scale]),
                                                 cast_inputs[name], casts[name], config,
                                                 cast.role)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from None
    if scaling == "static":
        assert {c.log2_scale for c in casts.values()} == {0}
    assert result.loss == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(result.gradients[name], grad, rtol=1e-5, atol=1e-5,
                                   msg=name)


def test_fp8_amax_with_float16_matmul_output_is_within_fp8_rounding_on_the_standin():
    """As PopXL documents it, matmul_pow2scaled returns float16. The casts of the first layer
    still give simulate_fp8's codes; later ones see slightly different inputs, and the loss and
    gradients then differ from simulate_fp8 by less than FP8 itself moves them from FP32."""
    model, config = tiny_decoder(), FP8Config()
    loss, grads, casts, _ = simulated_fp8(model, config)
    _, _, fp32_grads = torch_step(model)
    result = loss_and_gradients(model, *batch(), fp8=config, xl=popxl_standin, keep_values=True)
    values = result.session.values
    for cast in result.casts:
        expected = casts[f"{cast.site}.{cast.role}"]
        codes = values[cast.codes].reshape(expected.codes.shape)
        if cast.role == "weight" or (cast.site, cast.role) == ("layers.0.attn.qkv", "input"):
            assert torch.equal(codes, expected.codes), (cast.site, cast.role)
        assert (codes == expected.codes).float().mean() > 0.6, (cast.site, cast.role)
    assert result.loss == pytest.approx(loss, rel=1e-2)
    to_simulated = [relative(result.gradients[n], g) for n, g in grads.items()]
    fp8_effect = [relative(fp32_grads[n], g) for n, g in grads.items()]
    assert max(to_simulated) < 0.15
    assert sum(to_simulated) < 0.8 * sum(fp8_effect)


def test_a_non_finite_amax_stops_the_step_on_the_standin():
    model = tiny_decoder()
    with torch.no_grad():
        model.layers[1].mlp.up.weight[0, 0] = float("inf")
    config = small_config("fp8", "sgd")
    wrapper = PopXLTrainingModel(model, None, **sections(config), xl=popxl_standin,
                                 device="ipu_model")
    ids, labels = batch(rows=config.samples_per_call)
    with pytest.raises(NonFiniteAmaxError):
        wrapper(ids, labels)
    result = loss_and_gradients(model, *batch(), fp8=FP8Config(), xl=popxl_standin)
    assert result.non_finite >= 1


# ---------------------------------------------------------------------------------- training


def small_config(dtype: str, optimizer: str, *extra: str):
    return load_config(None, [
        f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", "model.depth=2",
        "model.hidden_size=16", "model.heads=2", f"precision.dtype={dtype}",
        f"training.optimizer={optimizer}", "training.batch_size=4", "training.steps=30",
        "training.warmup_steps=5", "backend=cpu", *extra])


def sections(config: Config) -> Dict[str, Any]:
    """The config's sections a PopXL training model is built from."""
    return dict(training=config.training, precision=config.precision, ipu=config.ipu)


def train_both(config, steps: int):
    """The CPU backend and the PopXL training model on the stand-in, from the same weights,
    on the same batches with the same schedule; their per-micro-batch losses."""
    torch.manual_seed(0)
    cpu_model = build_model(config)
    popxl_model = copy.deepcopy(cpu_model)
    cpu_optimizer = make_optimizer(cpu_model.parameters(), config, "cpu")
    popxl_optimizer = make_optimizer(popxl_model.parameters(), config, "cpu")
    cpu = build_training_model(cpu_model, cpu_optimizer, config, "cpu")
    popxl = PopXLTrainingModel(popxl_model, popxl_optimizer, **sections(config),
                               xl=popxl_standin, device="ipu_model")
    gen = torch.Generator().manual_seed(1)
    cpu_losses, popxl_losses = [], []
    for step in range(0, steps, config.ipu.device_iterations):
        for optimizer in (cpu_optimizer, popxl_optimizer):
            for group in optimizer.param_groups:
                group["lr"] = scheduled_learning_rate(config.training, step)
        cpu.update_optimizer()
        popxl.update_optimizer()
        ids = torch.randint(0, VOCAB, (config.samples_per_call, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (config.samples_per_call, SEQ), generator=gen)
        cpu_output, cpu_loss = cpu(ids, labels)
        popxl_output, popxl_loss = popxl(ids, labels)
        assert popxl_output.shape == cpu_output.shape and popxl_loss.shape == cpu_loss.shape
        cpu_losses.append(cpu_loss)
        popxl_losses.append(popxl_loss)
    popxl.copy_weights_to_host()
    popxl.destroy()
    return (torch.cat(cpu_losses), torch.cat(popxl_losses), cpu_model, popxl_model,
            popxl_optimizer)


def test_30_fp32_adam_steps_with_accumulation_track_the_cpu_backend_on_the_standin():
    config = small_config("fp32", "adam", "ipu.gradient_accumulation=2")
    cpu, popxl, cpu_model, popxl_model, optimizer = train_both(config, 30)
    assert cpu.numel() == 60 and cpu[-10:].mean() < cpu[:10].mean()  # it learns
    torch.testing.assert_close(popxl, cpu, rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(cpu_model.named_parameters(), popxl_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=name)
    state = optimizer.state[next(popxl_model.parameters())]
    assert float(state["step"]) == 30 and state["exp_avg"].abs().sum() > 0


def test_30_fp8_sgd_steps_with_clipping_track_the_cpu_backend_on_the_standin():
    config = small_config("fp8", "sgd", "training.learning_rate=0.5", "training.grad_clip=1.0",
                          "ipu.device_iterations=3", "training.steps=30")
    cpu, popxl, *_ = train_both(config, 30)
    assert cpu.numel() == 30 and cpu[-10:].mean() < cpu[:10].mean()
    torch.testing.assert_close(popxl, cpu, rtol=2e-2, atol=0)


def test_adamw_and_weight_decay_track_the_cpu_backend_on_the_standin():
    config = small_config("fp32", "adamw", "training.weight_decay=0.1",
                          "ipu.replication_factor=2")
    cpu, popxl, *_ = train_both(config, 6)
    torch.testing.assert_close(popxl, cpu, rtol=1e-4, atol=1e-4)


def test_weights_and_adam_state_carry_over_to_a_new_training_model_on_the_standin():
    """Train 3 steps, copy weights and moments to the host, build a fresh training model from
    them and train 3 more: the same as 6 steps in one training model."""
    config = small_config("fp32", "adam", "training.learning_rate=0.05")
    ids, labels = batch(seed=5, rows=4 * 6)

    def run(pieces):
        model = build_model(config)
        model.load_state_dict(start)
        optimizer = make_optimizer(model.parameters(), config, "cpu")
        losses = []
        for piece in pieces:
            wrapper = PopXLTrainingModel(model, optimizer, **sections(config),
                                         xl=popxl_standin, device="ipu_model")
            for step in piece:
                losses.append(wrapper(ids[4 * step:4 * step + 4], labels[4 * step:4 * step + 4])[1])
            wrapper.copy_weights_to_host()
            wrapper.destroy()
        return torch.cat(losses), model.state_dict()

    torch.manual_seed(3)
    start = copy.deepcopy(build_model(config).state_dict())
    whole, whole_state = run([range(6)])
    split, split_state = run([range(3), range(3, 6)])
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
    for name, value in whole_state.items():
        torch.testing.assert_close(split_state[name], value, rtol=1e-6, atol=1e-6)
        assert not torch.equal(value, start[name]), name  # every weight trained


def test_the_training_loop_checkpoints_and_resumes_the_popxl_training_model_on_the_standin(
        monkeypatch, tmp_path):
    """train() with the PopXL training model in place of the backend's wrapper: 10 steps in one
    go equal 5 steps, a checkpoint (weights and Adam state) and 5 resumed steps."""
    import ipu_unit_scaling.loop.training_loop as train_module
    from ipu_unit_scaling.loop import run_session

    def build(model, optimizer, config, backend=None):
        return PopXLTrainingModel(model, optimizer, **sections(config), xl=popxl_standin,
                                  device="ipu_model")

    monkeypatch.setattr(run_session, "build_training_model", build)
    monkeypatch.setattr(train_module, "select_backend", lambda name="auto", config=None: "popxl")

    def config(steps):
        return load_config(None, [
            "model.depth=1", "model.hidden_size=16", "model.heads=2", "model.seq_len=8",
            "training.batch_size=4", f"training.steps={steps}", "training.warmup_steps=2",
            "training.schedule=constant", "training.eval_interval=5", "training.eval_batches=1",
            "backend=popxl"])

    whole = train_module.train(config(10), tmp_path / "whole", quiet=True)
    train_module.train(config(5), tmp_path / "split", quiet=True)
    resumed = train_module.train(config(10), tmp_path / "split", resume=True, quiet=True)
    assert whole.steps == resumed.steps == 10 and whole.backend == "popxl"
    assert resumed.final_train_loss == whole.final_train_loss
    assert resumed.val_curve == whole.val_curve


# ------------------------------------------------------------------------------------- wiring


@pytest.mark.parametrize("override, key", [
    ("precision.dtype=fp16", "precision.dtype"),
    ("model.dropout=0.1", "model.dropout"),
    ("model.unit_scaled=false", "model.unit_scaled"),
    ("precision.fp8.rounding=stochastic", "precision.fp8.rounding"),
    ("precision.fp8.attention=true", "precision.fp8.attention"),
    ("precision.fp8.gradient_format=E5M2", "precision.fp8.gradient_format"),
])
def test_configs_it_does_not_build_are_refused_by_key(override, key):
    config = small_config("fp8", "adam", override)
    with pytest.raises(ConfigError, match=key):
        check_config(config)
    with pytest.raises(ConfigError, match=key):
        PopXLTrainingModel(build_model(config), None, **sections(config), xl=popxl_standin)


def test_the_training_model_reads_the_sections_it_is_given():
    """Each section it is built from decides what it says it decides; omitted ones are the
    sections' defaults."""
    config = small_config("fp32", "sgd", "training.grad_clip=0.5", "training.learning_rate=0.3",
                          "ipu.device_iterations=3", "ipu.gradient_accumulation=2",
                          "ipu.replication_factor=2")
    model = build_model(config)
    wrapper = PopXLTrainingModel(model, None, **sections(config), xl=popxl_standin,
                                 device="ipu_model")
    assert (wrapper.device_iterations, wrapper.micro_batches) == (3, 4)
    assert wrapper.grad_clip == 0.5 and wrapper.fp8 is None
    assert (wrapper.optimizer.kind, wrapper.optimizer.learning_rate) == ("sgd", 0.3)
    assert wrapper.stages == ipu_stages(model, config.ipu)
    defaults = PopXLTrainingModel(model, xl=popxl_standin, device="ipu_model")
    assert (defaults.device_iterations, defaults.micro_batches, defaults.grad_clip) == (1, 1, None)
    assert defaults.fp8 == FP8Config(**dataclasses.asdict(PrecisionConfig().fp8))
    with pytest.raises(ConfigError, match="ipu.ipus_per_replica"):
        PopXLTrainingModel(model, ipu=load_config("tiny").ipu, xl=popxl_standin)


def test_the_popxl_backend_builds_its_training_model_from_the_configs_sections(monkeypatch):
    import ipu_unit_scaling.backends.popxl as popxl_package

    built: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []
    monkeypatch.setattr(popxl_package, "PopXLTrainingModel",
                        lambda *args, **kwargs: built.append((args, kwargs)))
    config = small_config("fp8", "adam", "backend=popxl")
    model = build_model(config)
    backend_named("popxl").build_training_model(model, None, config)
    [(args, kwargs)] = built
    assert args == (model, None)
    assert kwargs.keys() == {"training", "precision", "ipu"}
    assert all(kwargs[name] is getattr(config, name) for name in kwargs)
    # the backend object refuses every key of the config it does not build at once, the
    # model's among them
    refused = small_config("fp16", "adam", "model.dropout=0.1", "backend=popxl")
    with pytest.raises(ConfigError, match="(?s)model.dropout.*precision.dtype"):
        backend_named("popxl").build_training_model(build_model(refused), None, refused)
    assert len(built) == 1


def test_popxl_is_a_backend_name_and_needs_popxl():
    config = small_config("fp8", "adam", "backend=popxl")
    assert config.backend == "popxl"
    if popxl_available():
        pytest.skip("popxl imports here")
    with pytest.raises(ImportError, match="PopXL"):
        PopXLTrainingModel(build_model(config), None, **sections(config))


# ---------------------------------------------------------------------- the codelets' custom op


@pytest.fixture
def host_codelets():
    from ipu_unit_scaling.fp8 import host_library as _host

    if not _host.fused_cast_available():
        pytest.skip(f"host library of the codelets not built: {_host.fast_path_status()}")


def test_codelet_amax_gives_the_same_step_as_popxl_ops_on_the_standin(host_codelets):
    """amax="codelets": the custom op's stand-in runs the codelets' host build (emulator);
    every cast, loss and gradient equals those of the PopXL-ops scaling bias."""
    model, config = tiny_decoder(), FP8Config()
    by_ops = loss_and_gradients(model, *batch(), fp8=config, xl=popxl_standin, keep_values=True)
    by_codelets = loss_and_gradients(model, *batch(), fp8=config, xl=popxl_standin,
                                     keep_values=True, amax="codelets")
    assert len(by_codelets.casts) == len(by_ops.casts) == 27
    for a, b in zip(by_ops.casts, by_codelets.casts):
        assert (a.site, a.role) == (b.site, b.role)
        assert int(by_ops.session.values[a.log2_scale]) == int(
            by_codelets.session.values[b.log2_scale])
        assert torch.equal(by_ops.session.values[a.codes], by_codelets.session.values[b.codes])
    assert by_codelets.loss == by_ops.loss
    for name, grad in by_ops.gradients.items():
        assert torch.equal(by_codelets.gradients[name], grad), name


def test_codelet_amax_flags_a_non_finite_amax_on_the_standin(host_codelets):
    model = tiny_decoder()
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    result = loss_and_gradients(model, *batch(), fp8=FP8Config(), xl=popxl_standin,
                                amax="codelets")
    assert result.non_finite >= 1
    with pytest.raises(ValueError, match="amax"):
        PopXLTrainingModel(model, None, **sections(small_config("fp8", "adam")),
                           xl=popxl_standin, amax="tiles")
