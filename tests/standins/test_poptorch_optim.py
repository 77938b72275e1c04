"""The PopTorch stand-in's ``poptorch.optim``: PopART's update rules, dtypes and PopTorch's checks.

Gradients are set by hand (no backward pass), so each reference below is the PopART rule of
``sgd.hpp`` / ``adam.hpp`` / ``adaptive.hpp`` evaluated in float64 on the same gradients.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict, List

import pytest
import torch

from ipu_standins.poptorch import _device_optimizer as device_optimizer
from ipu_standins.poptorch import _optimizer_state as optimizer_state
from ipu_standins.poptorch import optim as popt

U32 = 2.0**-24  # float32 unit roundoff
STEPS = 3


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 4, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(4, generator=g).to(dtype))]


def _grads(seed: int, params: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """STEPS float32 gradients per parameter (true gradients, before loss scaling)."""
    g = torch.Generator().manual_seed(seed + 100)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(STEPS)]


def _run(opt: torch.optim.Optimizer, params: List[torch.Tensor],
         grads: List[List[torch.Tensor]], ls: float) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = (g * ls).to(p.dtype)  # what backward of loss * loss_scaling gives
        opt.step()
        opt.zero_grad()


def _tol(ref: torch.Tensor, ref0: torch.Tensor) -> float:
    # Each step rounds the weight once (<= u|w|) and computes the update through at most ~16
    # float32 operations on float32 state (first-order bound 16u|update|), and the state carries
    # the same relative error forward: over STEPS steps |w - w_ref| <= STEPS*(u|w| + 16u|dw|)
    # with |dw| <= max|w_ref - w0|; 4x margin for the second-order terms.
    w = float(ref.abs().max())
    dw = float((ref - ref0).abs().max())
    return 4 * STEPS * U32 * (w + 16 * max(dw, U32))


def _check(opt_factory: Callable[[List[torch.Tensor]], torch.optim.Optimizer],
           reference: Callable[[torch.Tensor, List[torch.Tensor]], torch.Tensor],
           ls: float = 1.0, seed: int = 0) -> torch.optim.Optimizer:
    params = _params(seed)
    start = [p.detach().double().clone() for p in params]
    grads = _grads(seed, params)
    opt = opt_factory(params)
    _run(opt, params, grads, ls)
    for i, p in enumerate(params):
        ref = reference(start[i], [gs[i].double() for gs in grads])
        err = float((p.detach().double() - ref).abs().max())
        assert err <= _tol(ref, start[i]), (i, err, _tol(ref, start[i]))
        # the update is not negligible next to the tolerance, so the check can fail
        assert float((ref - start[i]).abs().max()) > 100 * _tol(ref, start[i])
    return opt


# ---- float64 references of PopART's rules ------------------------------------------------------

def _ref_sgd(lr: float, mm: float, dm: float, wd: float, nesterov: bool = False):
    def ref(w: torch.Tensor, gs: List[torch.Tensor]) -> torch.Tensor:
        w = w.clone()
        v = torch.zeros_like(w)
        for g in gs:
            if mm == 0.0:  # SGD0: dampening applies without momentum too
                w = w - lr * (1 - dm) * (g + wd * w)
                continue
            v = mm * v + (1 - dm) * (g + wd * w)  # first velocity (1-dm)(g + wd w)
            upd = (g + wd * w + mm * v) if nesterov else v
            w = w - lr * upd
        return w
    return ref


def _ref_adam(lr: float, b1: float, b2: float, eps: float, wd: float, mode: str,
              bias: bool = True, mwn: float = 65500.0):
    def ref(w: torch.Tensor, gs: List[torch.Tensor]) -> torch.Tensor:
        w = w.clone()
        m = torch.zeros_like(w)
        v = torch.zeros_like(w)
        for t, g in enumerate(gs, start=1):
            if mode == "adam":
                g = g + wd * w  # L2 regularisation
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            mc = m / (1 - b1**t) if bias else m
            vc = v / (1 - b2**t) if bias else v
            u = mc / (vc.sqrt() + eps)
            if mode != "adam":
                u = u + wd * w  # decay
            scale = lr
            if mode == "lamb":
                r1, r2 = float(w.norm()), float(u.norm())
                if r1 > 0 and r2 > 0:
                    scale = lr * min(r1, mwn) / r2
            w = w - scale * u
        return w
    return ref


def _ref_rmsprop(lr: float, alpha: float, eps: float, wd: float, mom: float, centered: bool,
                 tf: bool):
    def ref(w: torch.Tensor, gs: List[torch.Tensor]) -> torch.Tensor:
        w = w.clone()
        v1 = torch.ones_like(w) if tf else torch.zeros_like(w)
        v2 = torch.zeros_like(w)
        v3 = torch.zeros_like(w)
        for g in gs:
            g = g + wd * w
            v1 = alpha * v1 + (1 - alpha) * g * g
            d = v1
            if centered:
                v2 = alpha * v2 + (1 - alpha) * g
                d = v1 - v2 * v2
            x = g / (d + eps).sqrt() if tf else g / (d.sqrt() + eps)
            if mom > 0 and tf:
                v3 = mom * v3 + lr * x
                w = w - v3
            elif mom > 0:
                v3 = mom * v3 + x
                w = w - lr * v3
            else:
                w = w - lr * x
        return w
    return ref


# ---- update rules --------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(lr=0.1),
    dict(lr=0.1, dampening=0.5, weight_decay=0.1),  # SGD0 scales lr by (1 - dampening)
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
    dict(lr=0.05, momentum=0.8, weight_decay=0.02, use_combined_accum=True, velocity_scaling=4.0),
])
@pytest.mark.parametrize("ls", [1.0, 8.0])
def test_sgd_follows_popart(kw: Dict, ls: float) -> None:
    ref = _ref_sgd(kw["lr"], kw.get("momentum", 0.0), kw.get("dampening", 0.0),
                   kw.get("weight_decay", 0.0), kw.get("nesterov", False))
    _check(lambda ps: popt.SGD(ps, loss_scaling=ls, **kw), ref, ls=ls)


@pytest.mark.parametrize("combined", [False, True])
def test_sgd_velocity_is_stored_scaled(combined: bool) -> None:
    """Separate variant: velocity scaled by the loss scaling (PopTorch copies it to the velocity
    scaling). Combined: scaled by velocity_scaling, and already holding the next step's momentum
    and weight-decay terms."""
    lr, mm, dm, wd, ls, vs = 0.1, 0.9, 0.25, 0.5, 8.0, 4.0
    params = _params(2)
    w0 = params[0].detach().double().clone()
    g = _grads(2, params)[0][0].double()
    kw = dict(use_combined_accum=True, velocity_scaling=vs) if combined else {}
    opt = popt.SGD(params[:1], lr=lr, momentum=mm, dampening=dm, weight_decay=wd,
                   loss_scaling=ls, **kw)
    params[0].grad = (g * ls).float()
    opt.step()
    v = (1 - dm) * (g + wd * w0)  # PopART's first velocity
    w1 = w0 - lr * v
    if combined:
        expected = vs * (mm * v + (1 - dm) * wd * w1)
    else:
        expected = ls * v
    got = opt.state[params[0]]["momentum_buffer"].double()
    # a few float32 operations on values of size |expected|: 8u relative to the largest
    assert torch.allclose(got, expected, rtol=0, atol=8 * U32 * float(expected.abs().max()))
    assert torch.allclose(params[0].detach().double(), w1, rtol=0,
                          atol=8 * U32 * float(w1.abs().max()))


@pytest.mark.parametrize("cls,mode,kw", [
    (popt.Adam, "adam", dict(lr=0.01, weight_decay=0.1)),
    (popt.AdamW, "adamw", dict(lr=0.01, weight_decay=0.1)),
    (popt.AdamW, "adamw", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6)),
    (popt.LAMB, "lamb", dict(lr=0.01, weight_decay=0.05)),
    (popt.LAMB, "lamb", dict(lr=0.01, max_weight_norm=0.5)),
])
@pytest.mark.parametrize("ls", [1.0, 1024.0])
def test_adam_family_follows_popart(cls, mode: str, kw: Dict, ls: float) -> None:
    b1, b2 = kw.get("betas", (0.9, 0.999))
    wd = kw.get("weight_decay", 0.01 if cls in (popt.AdamW, popt.LAMB) else 0.0)
    ref = _ref_adam(kw["lr"], b1, b2, kw.get("eps", 1e-8), wd, mode,
                    mwn=kw.get("max_weight_norm", 65500.0))
    _check(lambda ps: cls(ps, loss_scaling=ls, **kw), ref, ls=ls)


def test_lamb_without_bias_correction() -> None:
    ref = _ref_adam(0.01, 0.9, 0.999, 1e-8, 0.01, "lamb", bias=False)
    _check(lambda ps: popt.LAMB(ps, lr=0.01, bias_correction=False), ref)


def test_adamw_without_bias_correction_is_bias_corrected_as_in_poptorch() -> None:
    # PopTorch c2a8b17 gives ADAMW_NO_BIAS PopART's AdamMode::Adam (CompilerImpl.cpp).
    ref = _ref_adam(0.01, 0.9, 0.999, 1e-8, 0.01, "adamw", bias=True)
    _check(lambda ps: popt.AdamW(ps, lr=0.01, bias_correction=False), ref)


@pytest.mark.parametrize("kw", [
    dict(lr=0.01),
    dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1),
    dict(lr=0.01, momentum=0.5, use_tf_variant=True),
    dict(lr=0.01, alpha=0.9, centered=True, use_tf_variant=True),
])
def test_rmsprop_follows_popart(kw: Dict) -> None:
    ref = _ref_rmsprop(kw["lr"], kw.get("alpha", 0.99), 1e-8, kw.get("weight_decay", 0.0),
                       kw.get("momentum", 0.0), kw.get("centered", False),
                       kw.get("use_tf_variant", False))
    _check(lambda ps: popt.RMSprop(ps, loss_scaling=4.0, **kw), ref, ls=4.0)


@pytest.mark.parametrize("opt_cls,torch_cls", [
    (popt.SGD, torch.optim.SGD), (popt.Adam, torch.optim.Adam),
    (popt.AdamW, torch.optim.AdamW), (popt.RMSprop, torch.optim.RMSprop)])
def test_matches_torch_for_its_defaults(opt_cls, torch_cls) -> None:
    """Without loss scaling, dampening or the TF variant, PopART's rules are torch's."""
    params, tparams = _params(3), _params(3)
    grads = _grads(3, params)
    _run(opt_cls(params, lr=0.01), params, grads, 1.0)
    _run(torch_cls(tparams, lr=0.01), tparams, grads, 1.0)
    for p, q in zip(params, tparams):
        assert isinstance(opt_cls(params, lr=0.01), torch_cls)
        # two float32 evaluations of the same rule, same tolerance argument as _tol
        assert torch.allclose(p, q, rtol=0, atol=_tol(q.detach().double(), q.detach().double()))


@pytest.mark.parametrize("factory", [
    lambda ps, ls: popt.SGD(ps, lr=0.1, momentum=0.9, loss_scaling=ls),
    lambda ps, ls: popt.Adam(ps, lr=0.01, loss_scaling=ls),
    lambda ps, ls: popt.RMSprop(ps, lr=0.01, loss_scaling=ls),
    lambda ps, ls: popt.LAMB(ps, lr=0.01, loss_scaling=ls),
])
def test_loss_scaling_leaves_float32_update_unchanged(factory) -> None:
    a, b, start = _params(5), _params(5), _params(5)
    grads = _grads(5, a)
    _run(factory(a, 1.0), a, grads, 1.0)
    _run(factory(b, 1000.0), b, grads, 1000.0)  # not a power of two: g*1000 and /1000 round
    for p, q, w0 in zip(a, b, start):
        # The scaled gradient carries <= 3u relative error (scale, round, unscale), which the
        # update passes on like its own rounding: the _tol bound with 3x the per-step factor.
        moved = float((p - w0).detach().abs().max())
        assert moved > 1e-3
        atol = 4 * STEPS * U32 * (float(p.detach().abs().max()) + 48 * moved)
        assert torch.allclose(p.detach(), q.detach(), rtol=0, atol=atol)


def test_max_grad_norm_clips_as_popart() -> None:
    """PopART's factor max_norm / max(max_norm, ||g||) over all the optimizer's gradients."""
    params = _params(7)
    grads = [[g * 10 for g in _grads(7, params)[0]]]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads[0]))
    start = [p.detach().double().clone() for p in params]
    _run(popt.SGD(params, lr=0.1, max_grad_norm=0.5), params, grads, 1.0)
    for p, w0, g in zip(params, start, grads[0]):
        ref = w0 - 0.1 * g.double() * (0.5 / max(0.5, norm))
        atol = 8 * U32 * float(ref.abs().max())  # a few float32 roundings of size |w|
        assert torch.allclose(p.detach().double(), ref, rtol=0, atol=atol)
    with pytest.raises(RuntimeError, match="cannot be NaN"):
        _run(popt.SGD(params, lr=0.1, max_grad_norm=float("nan")), params, grads, 1.0)


# ---- dtypes ----------------------------------------------------------------------------------

def _one_step_half(opt: torch.optim.Optimizer, params: List[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()


@pytest.mark.parametrize("cls", [popt.Adam, popt.AdamW, popt.LAMB])
def test_adam_moments_float32_by_default_for_half_weights(cls) -> None:
    params = _params(0, torch.float16)
    opt = cls(params, lr=1e-3)
    _one_step_half(opt, params)
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
    assert params[0].dtype == torch.float16
    params = _params(0, torch.float16)
    opt = cls(params, lr=1e-3, first_order_momentum_accum_type=torch.float16,
              second_order_momentum_accum_type=torch.float16)
    _one_step_half(opt, params)
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == torch.float16 and st["exp_avg_sq"].dtype == torch.float16


def test_sgd_and_rmsprop_state_dtypes() -> None:
    params = _params(0, torch.float16)
    opt = popt.SGD(params, lr=0.1, momentum=0.9)
    _one_step_half(opt, params)
    assert opt.state[params[0]]["momentum_buffer"].dtype == torch.float32
    params = _params(0, torch.float16)
    opt = popt.SGD(params, lr=0.1, momentum=0.9, velocity_accum_type=torch.float16)
    _one_step_half(opt, params)
    assert opt.state[params[0]]["momentum_buffer"].dtype == torch.float16
    params = _params(0, torch.float16)  # combined variant: one tensor in the weight's dtype
    opt = popt.SGD(params, lr=0.1, momentum=0.9, use_combined_accum=True)
    _one_step_half(opt, params)
    assert opt.state[params[0]]["momentum_buffer"].dtype == torch.float16
    params = _params(0, torch.float16)
    opt = popt.RMSprop(params, lr=0.1, momentum=0.9, centered=True,
                       second_order_momentum_accum_type=torch.float16)
    _one_step_half(opt, params)
    st = opt.state[params[0]]
    assert st["square_avg"].dtype == torch.float32 and st["grad_avg"].dtype == torch.float16
    assert st["momentum_buffer"].dtype == torch.float32


def test_half_adamw_with_fp16_accum_and_loss_scaling_stays_finite_where_torch_gives_nan() -> None:
    """The mixed-precision tutorial's optimizer on a half model: AdamW(accum_type=float16,
    loss_scaling=1024). PopART keeps the moments in float32 and casts the gradient up before
    unscaling; torch's AdamW keeps them in float16, where eps=1e-8 rounds to 0 and a zero
    gradient gives 0/0."""
    g = torch.Generator().manual_seed(11)
    true_grads = []
    for _ in range(5):
        t = torch.randn(6, 6, generator=g) * 1e-3
        t[0] = 0.0  # a row with no gradient (an unused embedding row, say)
        true_grads.append(t)
    w0 = (torch.randn(6, 6, generator=g) * 0.1).half()
    w_pop = torch.nn.Parameter(w0.clone())
    w_torch = torch.nn.Parameter(w_pop.detach().clone())
    opt = popt.AdamW([w_pop], lr=1e-3, accum_type=torch.float16, loss_scaling=1024)
    ref = torch.optim.AdamW([w_torch], lr=1e-3)
    torch_runs = True
    for t in true_grads:
        w_pop.grad = (t * 1024).half()
        opt.step()
        assert torch.isfinite(w_pop).all()
        w_torch.grad = t.half()
        try:
            ref.step()
        except RuntimeError as err:  # torch 2.0.1 has no float16 addcmul on the CPU
            assert "not implemented for 'Half'" in str(err)
            torch_runs = False
    assert opt.state[w_pop]["exp_avg_sq"].dtype == torch.float32
    assert ref.state[w_torch]["exp_avg_sq"].dtype == torch.float16
    if torch_runs:
        assert torch.isnan(w_torch).any()
    # The stand-in's row without gradient only decays, by lr*wd = 1e-5 per step relative: five
    # steps move it by at most 5e-5 relative plus one float16 rounding per step (2^-11 relative).
    assert torch.allclose(w_pop[0].float(), w0[0].float(), rtol=5e-5 + 5 * 2.0**-11, atol=0)


# ---- PopTorch's arguments and checks -------------------------------------------------------

def test_defaults_and_variable_attributes() -> None:
    ps = _params()
    sgd = popt.SGD(ps, lr=0.1, loss_scaling=2.0)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.accum_type == torch.float32 and sgd.velocity_accum_type == torch.float32
    assert sgd.use_combined_accum is False and sgd.max_grad_norm == float("inf")
    assert "velocity_scaling" not in sgd.param_groups[0]
    assert not sgd.variable_attrs.isConstant("lr")
    assert not sgd.variable_attrs.isConstant("loss_scaling")
    assert sgd.variable_attrs.isConstant("momentum")
    sgd.variable_attrs.markAsVariable("momentum")
    assert not sgd.variable_attrs.isConstant("momentum")
    sgd.variable_attrs.markAsConstant("lr")
    assert sgd.variable_attrs.isConstant("lr")
    with pytest.raises(AssertionError, match="Unknown attribute nope"):
        sgd.variable_attrs.markAsVariable("nope")
    lamb = popt.LAMB(ps)
    assert lamb.defaults == dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                                 max_weight_norm=65500.0)
    assert lamb.bias_correction is True and lamb.loss_scaling == 1.0
    assert popt.LAMB(ps, max_weight_norm=None).max_weight_norm == 65500.0
    adamw = popt.AdamW(ps)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["weight_decay"] == 1e-2
    rms = popt.RMSprop(ps)
    assert rms.use_tf_variant is False and rms.defaults["alpha"] == 0.99
    comb = popt.SGD(ps, lr=0.1, use_combined_accum=True, velocity_scaling=3.0)
    assert [g["velocity_scaling"] for g in comb.param_groups] == [3.0]
    c = copy.copy(comb)
    assert c.use_combined_accum and c.loss_scaling == 1.0
    assert c.variable_attrs is comb.variable_attrs


@pytest.mark.parametrize("make", [
    lambda ps: popt.SGD(ps, lr=0.1, accum_type=torch.bfloat16),
    lambda ps: popt.SGD(ps, lr=0.1, velocity_accum_type=torch.float64),
    lambda ps: popt.Adam(ps, first_order_momentum_accum_type=torch.int32),
    lambda ps: popt.AdamW(ps, second_order_momentum_accum_type=torch.bfloat16),
    lambda ps: popt.RMSprop(ps, accum_type=torch.float64),
    lambda ps: popt.LAMB(ps, accum_type=torch.float64),
])
def test_accumulation_types_refused(make) -> None:
    with pytest.raises(AssertionError,
                       match="Accumulation types must be either torch.float32 or torch.float16"):
        make(_params())


def test_what_poptorch_refuses_when_the_model_is_built() -> None:
    ps = _params()
    with pytest.raises(ValueError, match="Only non-amsgrad Adam/AdamW optimizers are supported."):
        device_optimizer.to_ipu_optimizer(torch.optim.Adam(ps, amsgrad=True))
    with pytest.raises(ValueError, match="Only non-amsgrad"):
        device_optimizer.to_ipu_optimizer(popt.AdamW(ps, amsgrad=True))
    with pytest.raises(AssertionError, match="Unsupported optimizer type"):
        device_optimizer.to_ipu_optimizer(torch.optim.Adagrad(ps))
    rms = popt.RMSprop([{"params": ps[:1]}, {"params": ps[1:], "centered": True}])
    with pytest.raises(AssertionError, match="same value for the 'centered' attribute"):
        device_optimizer.to_ipu_optimizer(rms)
    adam = popt.Adam(ps)
    adam.accum_type = torch.bfloat16
    with pytest.raises(ValueError, match="accum_type must be set to either torch.float16"):
        device_optimizer.to_ipu_optimizer(adam)
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        popt.SGD(ps, lr=0.1, nesterov=True)  # torch's own check, inherited as in PopTorch
    with pytest.raises(RuntimeError, match="Only IPU optimizer states can be loaded onto the IPU."):
        popt.Adam(ps).load_state_dict(torch.optim.Adam(ps).state_dict())
    assert device_optimizer.requires_running_mean_reduction(popt.Adam(ps, accum_type=torch.float16))
    assert not device_optimizer.requires_running_mean_reduction(
        popt.SGD(ps, lr=0.1, accum_type=torch.float16, use_combined_accum=True))


def test_to_ipu_optimizer_copies_and_keeps_state() -> None:
    ps = _params()
    user = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    dev = device_optimizer.to_ipu_optimizer(user)
    assert type(dev) is popt.SGD and dev.variable_attrs is None
    assert dev.param_groups[0]["lr"] == 0.1 and dev.param_groups[0]["momentum"] == 0.9
    assert dev.param_groups[0]["params"][0] is ps[0]
    user.param_groups[0]["lr"] = 0.5  # seen only through setOptimizer
    assert dev.param_groups[0]["lr"] == 0.1
    _one_step_half(dev, ps)
    again = device_optimizer.to_ipu_optimizer(user, previous=dev)
    assert again.param_groups[0]["lr"] == 0.5
    assert again.state[ps[0]]["momentum_buffer"] is dev.state[ps[0]]["momentum_buffer"]
    pop = popt.AdamW(ps, lr=0.2, loss_scaling=16.0, accum_type=torch.float16)
    dev = device_optimizer.to_ipu_optimizer(pop)
    assert dev is not pop and type(dev) is popt.AdamW
    assert dev.loss_scaling == 16.0 and dev.accum_type == torch.float16
    assert device_optimizer.from_torch_optimizer(torch.optim.AdamW(ps)).__class__ is popt.AdamW


def test_ipu_state_dict_names_and_values() -> None:
    lin = torch.nn.Linear(3, 3)
    named = dict(("lin." + n, p) for n, p in lin.named_parameters())
    sgd = device_optimizer.to_ipu_optimizer(popt.SGD(lin.parameters(), lr=0.05, weight_decay=0.025,
                                         loss_scaling=0.75))
    s = optimizer_state.ipu_state_dict(sgd, named)
    p = s["ipu_param"]
    # PopART's SGD0 compound scalars: wdsf0 = 1 - lr(1-dm)wd, slr0 = lr(1-dm)/ls
    assert math.isclose(float(p["weightDecayScaleFactor0___specific___lin.bias"]),
                        1 - 0.05 * 0.025, rel_tol=2 * U32)
    assert math.isclose(float(p["scaledLearningRate0___specific___lin.weight"]), 0.05 / 0.75,
                        rel_tol=2 * U32)
    assert math.isclose(float(p["lossScaling_FLOAT"]), 0.75, rel_tol=U32)
    adam = device_optimizer.to_ipu_optimizer(
        popt.Adam(lin.parameters(), lr=0.05, weight_decay=0.025))
    s0 = optimizer_state.ipu_state_dict(adam, named)
    assert {"Accl1___lin.weight", "Accl2___lin.bias", "Step___lin.weight"} <= set(s0["ipu_state"])
    assert float(s0["ipu_param"]["learningRate___specific___lin.bias"]) == pytest.approx(0.05)
    for q in lin.parameters():
        q.grad = torch.ones_like(q)
    adam.step()
    s1 = optimizer_state.ipu_state_dict(adam, named)
    key = "Accl1___lin.weight"
    assert not torch.equal(s0["ipu_state"][key], s1["ipu_state"][key])
    # writing a state back: the moments and the per-weight learning rate are those written
    s1["ipu_state"]["Accl1___lin.weight"] = torch.full((3, 3), 0.25)
    s1["ipu_param"]["learningRate___specific___lin.weight"] = torch.tensor(0.125)
    optimizer_state.load_ipu_state_dict(adam, s1, named)
    s2 = optimizer_state.ipu_state_dict(adam, named)
    assert torch.equal(s2["ipu_state"]["Accl1___lin.weight"], torch.full((3, 3), 0.25))
    assert float(s2["ipu_param"]["learningRate___specific___lin.weight"]) == 0.125
    assert float(s2["ipu_param"]["learningRate___specific___lin.bias"]) == pytest.approx(0.05)
    # setOptimizer with an unchanged optimizer sends nothing: the written value stays;
    # a changed one overwrites it
    user = popt.Adam(lin.parameters(), lr=0.05, weight_decay=0.025)
    same = device_optimizer.to_ipu_optimizer(user, previous=adam)
    assert float(optimizer_state.ipu_state_dict(same, named)["ipu_param"][
        "learningRate___specific___lin.weight"]) == 0.125
    user.param_groups[0]["lr"] = 0.5
    changed = device_optimizer.to_ipu_optimizer(user, previous=same)
    assert float(optimizer_state.ipu_state_dict(changed, named)["ipu_param"][
        "learningRate___specific___lin.weight"]) == 0.5


def test_state_dict_carries_ipu_keys_and_lr_scheduler_works() -> None:
    ps = _params()
    opt = popt.Adam(ps, lr=1.0)
    sd = opt.state_dict()
    assert sd["ipu_state"] is None and sd["ipu_param"] is None and "param_groups" in sd
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
    _one_step_half(opt, ps)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    sd["ipu_state"], sd["ipu_param"] = {}, {}
    opt.load_state_dict(sd)
    assert opt.has_state() and opt.ipu_state_is_dirty


def test_popart_optimizer_ops() -> None:
    lin = torch.nn.Linear(2, 2)
    named = dict(lin.named_parameters())

    def types(opt: popt.Optimizer) -> List[str]:
        return [op["type"] for op in optimizer_state.popart_optimizer_ops(opt, named)]

    assert types(popt.SGD(lin.parameters(), lr=0.1)).count("SGD0VarUpdate") == 2
    adamw = types(device_optimizer.to_ipu_optimizer(torch.optim.AdamW(lin.parameters())))
    assert adamw.count("AdamUpdater") == 2 and adamw.count("AdamVarUpdate") == 2
    assert "SGD0VarUpdate" not in adamw
    sgd2 = types(popt.SGD(lin.parameters(), lr=0.1, momentum=0.9))
    assert sgd2.count("SGD2VarUpdate") == 2 and "SGD0VarUpdate" not in sgd2
    assert types(popt.LAMB(lin.parameters())).count("LambSquare") == 4


def test_replacing_the_optimizer_of_a_compiled_model() -> None:
    """PopART's validReplacement: explicit arguments are variables and may change; a constant
    (an argument left to its default) may not, nor the optimizer's kind or clipping."""
    ps = _params()
    first = device_optimizer.to_ipu_optimizer(popt.SGD(ps, lr=0.1, loss_scaling=2.0))
    ok = popt.SGD(ps, lr=0.5, loss_scaling=4.0)  # lr and loss_scaling are variables
    device_optimizer.to_ipu_optimizer(ok, previous=first)
    constant = popt.SGD(ps, lr=0.1, loss_scaling=2.0)
    constant.param_groups[0]["weight_decay"] = 0.1  # weight_decay was left constant
    with pytest.raises(RuntimeError, match="Problem with weight decays.*Values are constant "
                                           "but do not match"):
        device_optimizer.to_ipu_optimizer(constant, previous=first)
    with pytest.raises(RuntimeError, match="Can not replace a constant value with a non constant"):
        device_optimizer.to_ipu_optimizer(popt.SGD(ps, lr=0.1, loss_scaling=2.0, weight_decay=0.0),
                              previous=first)
    with pytest.raises(RuntimeError, match="Can not replace optimizer of type SGD with new "
                                           "optimizer of type Adam"):
        device_optimizer.to_ipu_optimizer(popt.Adam(ps, lr=0.1, loss_scaling=2.0), previous=first)
    with pytest.raises(RuntimeError, match="Clip norm settings do not match"):
        device_optimizer.to_ipu_optimizer(popt.SGD(ps, lr=0.1, loss_scaling=2.0, max_grad_norm=1.0),
                              previous=first)
    with pytest.raises(RuntimeError, match="Weight decay modes do not match"):
        device_optimizer.to_ipu_optimizer(torch.optim.AdamW(ps),
                              previous=device_optimizer.to_ipu_optimizer(torch.optim.Adam(ps)))
    # a torch optimizer: constant where it equals torch's default, lr always variable
    adam = device_optimizer.to_ipu_optimizer(torch.optim.Adam(ps, lr=0.1))
    device_optimizer.to_ipu_optimizer(torch.optim.Adam(ps, lr=0.01), previous=adam)
    with pytest.raises(RuntimeError, match="Problem with eps"):
        device_optimizer.to_ipu_optimizer(torch.optim.Adam(ps, lr=0.1, eps=1e-6), previous=adam)
