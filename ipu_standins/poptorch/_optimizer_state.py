"""The device state of an optimizer as PopTorch reads and writes it.

:func:`ipu_state_dict` and :func:`load_ipu_state_dict` give and set the ``{"ipu_state",
"ipu_param"}`` dictionaries PopTorch reads from and writes to the device, with PopART's tensor
names (``Accl1___lin.weight``, ``learningRate___specific___lin.bias``, ``lossScaling_FLOAT``, with
automatic loss scaling ``lossScaleUpdateFactor``...);
:func:`popart_optimizer_ops` lists the optimizer ops PopART's IR holds per weight
(``SGD0VarUpdate``, ``AdamUpdater``...).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._popart_updates import AdamRule
from .optim import FP16_MAX, LAMB, SGD, AdamW, Optimizer, RMSprop

__all__ = ["ipu_state_dict", "load_ipu_state_dict", "popart_optimizer_ops", "popart_ir_json",
           "state_to_host",
           "state_to_device", "state_on_attach"]

logger = logging.getLogger("poptorch::python")

# ---- the device state as PopTorch reads and writes it ---------------------------------------

_UPDATE_FACTOR = "lossScaleUpdateFactor"  # automatic loss scaling's variable (PopART's name)

def _state_names(opt: Optimizer, group: Dict[str, Any]) -> Dict[str, str]:
    """PopART state tensor prefix -> key in ``opt.state[p]``."""
    if isinstance(opt, SGD):
        if not opt._with_velocity(group):
            return {}
        return {("Accl___" if opt.use_combined_accum else "Accl1___"): "momentum_buffer"}
    if isinstance(opt, RMSprop):
        names = {"Accl1___": "square_avg"}
        if group["centered"]:
            names["Accl2___"] = "grad_avg"
        if opt._with_momentum(group):
            names["Accl3___"] = "momentum_buffer"
        return names
    names = {"Accl1___": "exp_avg", "Accl2___": "exp_avg_sq"}
    if isinstance(opt, AdamRule) and opt._bias_corrected():
        names["Step___"] = "step"
    return names


def _is_variable(opt: Optimizer, attr: str, value: Any, torch_default: Any) -> bool:
    va = getattr(opt, "variable_attrs", None)
    if va is not None:
        return not va.isConstant(attr)
    return value != torch_default


def _param_scalars(opt: Optimizer, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, float]:
    """The per-weight hyperparameters PopART holds as tensors (the non-constant ones)."""
    if isinstance(opt, SGD):
        return opt._sgd_scalars(p, group)
    out = {"learningRate": opt._scalar(p, "learningRate", group["lr"])}
    wd_default = 1e-2 if isinstance(opt, (AdamW, LAMB)) else 0.0
    if _is_variable(opt, "weight_decay", group["weight_decay"], wd_default):
        out["weightDecay"] = opt._scalar(p, "weightDecay", group["weight_decay"])
    if isinstance(opt, RMSprop):
        for attr, name, default in (("alpha", "alpha", 0.99), ("eps", "eps", 1e-8),
                                    ("momentum", "momentum", 0.0)):
            if _is_variable(opt, attr, group[attr], default):
                out[name] = opt._scalar(p, name, group[attr])
        return out
    if _is_variable(opt, "eps", group["eps"], 1e-8):
        out["eps"] = opt._scalar(p, "eps", group["eps"])
    if isinstance(opt, LAMB) and _is_variable(opt, "max_weight_norm", group["max_weight_norm"],
                                              FP16_MAX):
        out["maxWeightNorm"] = opt._scalar(p, "maxWeightNorm", group["max_weight_norm"])
    return out


_PARAM_PREFIX = {"beta1": "adamBeta1", "beta2": "adamBeta2", "eps": "adamEps",
                 "alpha": "adaptiveAlpha", "momentum": "adaptiveMomentum"}


def _tensor_name(opt: Optimizer, name: str) -> str:
    if isinstance(opt, RMSprop) and name == "eps":
        return "adaptiveEps"
    if isinstance(opt, SGD):
        return name
    return _PARAM_PREFIX.get(name, name)


def _named(opt: Optimizer, named_parameters: Dict[str, torch.Tensor]
           ) -> List[Tuple[str, torch.Tensor, Dict[str, Any]]]:
    by_id = {id(p): n for n, p in named_parameters.items()}
    out = []
    for group in opt.param_groups:  # type: ignore[attr-defined]
        for p in group["params"]:
            if id(p) in by_id:
                out.append((by_id[id(p)], p, group))
    return out


def ipu_state_dict(opt: Optimizer, named_parameters: Dict[str, torch.Tensor]
                   ) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{"ipu_state": ..., "ipu_param": ...}`` of a device optimizer, named as PopART names the
    tensors (``Accl1___<weight>``, ``learningRate___specific___<weight>``, ``lossScaling_FLOAT``).
    The state is created (zeros, as PopART initialises it) if no step has run yet."""
    init = getattr(opt, "_init_device_state", None)
    if init is not None:
        init()
    ipu_state: Dict[str, torch.Tensor] = {}
    ipu_param: Dict[str, torch.Tensor] = {}
    for name, p, group in _named(opt, named_parameters):
        state = opt.state[p]  # type: ignore[attr-defined]
        for prefix, key in _state_names(opt, group).items():
            if key in state and state[key] is not None:
                ipu_state[prefix + name] = state[key].detach().clone()
        for pname, value in _param_scalars(opt, p, group).items():
            ipu_param[_tensor_name(opt, pname) + "___specific___" + name] = \
                torch.tensor(value, dtype=torch.float32)
    als = opt.auto_loss_scale()
    if als is not None or _is_variable(opt, "loss_scaling", opt._loss_scaling(), 1.0):
        ipu_param["lossScaling_FLOAT"] = torch.tensor(opt._loss_scaling(), dtype=torch.float32)
    if als is not None:
        ipu_state[_UPDATE_FACTOR] = als.update_factor.detach().clone()
    return {"ipu_state": ipu_state, "ipu_param": ipu_param}


def load_ipu_state_dict(opt: Optimizer, state: Dict[str, Any],
                        named_parameters: Dict[str, torch.Tensor]) -> None:
    """Write ``state["ipu_state"]`` / ``state["ipu_param"]`` into a device optimizer; tensors the
    dictionaries lack keep their values (PopTorch merges them)."""
    init = getattr(opt, "_init_device_state", None)
    if init is not None:
        init()
    ipu_state = state.get("ipu_state") or {}
    ipu_param = state.get("ipu_param") or {}
    overrides = opt._overrides()
    reverse = {v: k for k, v in _PARAM_PREFIX.items()}
    reverse["adaptiveEps"] = "eps"
    for name, p, group in _named(opt, named_parameters):
        st = opt.state[p]  # type: ignore[attr-defined]
        for prefix, key in _state_names(opt, group).items():
            value = ipu_state.get(prefix + name)
            if value is not None and key in st:
                st[key].copy_(torch.as_tensor(value).to(st[key].dtype).reshape(st[key].shape))
        suffix = "___specific___" + name
        for tname, value in ipu_param.items():
            if tname.endswith(suffix):
                short = tname[: -len(suffix)]
                overrides[(id(p), reverse.get(short, short))] = \
                    torch.as_tensor(value, dtype=torch.float32).reshape(())
    als = opt.auto_loss_scale()
    if als is not None and ipu_state.get(_UPDATE_FACTOR) is not None:
        als.update_factor = torch.as_tensor(ipu_state[_UPDATE_FACTOR],
                                            dtype=torch.float32).reshape(()).clone()
    if "lossScaling_FLOAT" in ipu_param:
        overrides[(0, "lossScaling")] = torch.as_tensor(ipu_param["lossScaling_FLOAT"],
                                                        dtype=torch.float32).reshape(())


# ---- when the state moves between host and device (PopTorch's _poplar_executor.py) ---------
# ``host_state_is_dirty``: the device ran since the host copy was read, so ``state_dict()``
# reads the device. ``ipu_state_is_dirty``: a state loaded with ``load_state_dict`` waits to be
# written to the device (merged into it) before the next run or on attaching.

Named = Callable[[], Dict[str, torch.Tensor]]


def state_to_host(optimizer: Any, device: Optional[Any], named: Named) -> None:
    """Before ``optimizer.state_dict()`` answers: read the device's state if it is newer."""
    if not isinstance(optimizer, Optimizer):
        return
    if optimizer.host_state_is_dirty and isinstance(device, Optimizer):
        logger.debug("Writing optimiser state tensors from IPU to host.")
        state = ipu_state_dict(device, named())
        host = torch.optim.Optimizer.state_dict(optimizer)  # type: ignore[arg-type]
        optimizer.set_state_dict({**state, **host})
        optimizer.ipu_state_is_dirty = False
    else:
        logger.debug("Using cached optimiser state dict")


def state_to_device(optimizer: Any, device: Optional[Any], named: Named) -> None:
    """Before a run: write a state loaded into ``optimizer`` to the device."""
    if not (isinstance(optimizer, Optimizer) and optimizer.ipu_state_is_dirty
            and isinstance(device, Optimizer)):
        return
    if optimizer.has_state():
        logger.debug("Writing optimiser state tensors from host to IPU memory")
        load_ipu_state_dict(device, optimizer._state_dict, named())
    optimizer.ipu_state_is_dirty = False


def state_on_attach(optimizer: Any, device: Optional[Any], named: Named) -> None:
    """On compiling or attaching: the optimizer's own state (a checkpoint) goes to the device;
    without one, the device's state is what ``state_dict()`` reads next."""
    if not isinstance(optimizer, Optimizer) or device is None:
        return
    if optimizer.has_state():
        optimizer.ipu_state_is_dirty = True
        optimizer.host_state_is_dirty = False
        state_to_device(optimizer, device, named)
    else:
        optimizer.host_state_is_dirty = True
        optimizer.ipu_state_is_dirty = False


def state_after_run(optimizer: Any) -> None:
    """After a run: the device's state is newer than the host's copy."""
    if isinstance(optimizer, Optimizer):
        optimizer.host_state_is_dirty = True


def popart_optimizer_ops(opt: Optimizer, named_parameters: Dict[str, torch.Tensor]
                         ) -> List[Dict[str, Any]]:
    """The optimizer ops PopART's decomposition patterns put in the IR for each weight
    (``{"type": ..., "name": ...}``, in order), for the executor's ``_debugGetPopartIR``:
    ``SGD0VarUpdate``; ``SGD2PartialAcclUpdate``, ``Accumulate``, ``SGD2VarUpdate`` (separate);
    ``Accumulate``, ``SGD1VarUpdate``, ``SGD1AcclUpdate`` (combined); ``Accumulate`` x2,
    ``AdamUpdater``, ``LambSquare`` x2 (LAMB), ``AdamVarUpdate``; ``Accumulate``,
    ``RMSPropUpdater``, ``ScaledVarUpdate`` (RMSprop)."""
    ops: List[Dict[str, Any]] = []
    for name, _p, group in _named(opt, named_parameters):
        types: List[str] = []
        if isinstance(opt, SGD):
            nesterov = ["SGD1Nesterov"] if group.get("nesterov", False) else []
            if not opt._with_velocity(group):
                types = ["SGD0VarUpdate"]
            elif opt.use_combined_accum:
                types = ["Accumulate"] + nesterov + ["SGD1VarUpdate", "SGD1AcclUpdate"]
            else:
                types = ["SGD2PartialAcclUpdate", "Accumulate"] + nesterov + ["SGD2VarUpdate"]
        elif isinstance(opt, RMSprop):
            types = ["Accumulate"] + (["Accumulate"] if group["centered"] else [])
            types += ["RMSPropUpdater"]
            types += ["Accumulate"] if opt._with_momentum(group) else []
            types += ["ScaledVarUpdate"]
        else:
            types = ["Accumulate", "Accumulate", "AdamUpdater"]
            types += ["LambSquare", "LambSquare"] if isinstance(opt, LAMB) else []
            types += ["AdamVarUpdate"]
        ops.extend({"type": t, "name": f"{t}___{name}"} for t in types)
    return ops




def popart_ir_json(opt: Optional[Any], named_parameters: Dict[str, torch.Tensor]) -> str:
    """``_debugGetPopartIR()``: PopART's IR as JSON, ``{"maingraph": [ops]}``, with the
    optimizer ops of :func:`popart_optimizer_ops` (none for an inference model)."""
    ops = popart_optimizer_ops(opt, named_parameters) if isinstance(opt, Optimizer) else []
    return json.dumps({"maingraph": ops})
