"""A model of your own in ``ipu-unit-scaling train``: ``model.factory: "package.module:function"``.

The function is called once per build with the run's ``model`` settings (a copy of the
config's ``model`` section, :class:`~ipu_unit_scaling.models.GPTConfig`: ``vocab_size`` is the
corpus's vocabulary, then ``seq_len``, ``hidden_size``, ``depth``, ``heads``,
``mlp_expansion``, ``dropout``, ``bias`` and u-μP's multipliers) and returns an ``nn.Module``
that maps token ids ``[batch, seq]`` to logits ``[batch, seq, vocab_size]`` (an output with a
``.logits`` tensor, as Hugging Face models return, is read the same way).

That is the convention of unit-scaling's ``TransformerDecoder``: ``forward`` gives logits, and
its ``loss(input_ids)`` is the next-token cross-entropy. The loop's labels are the next tokens
already, so the loss is computed here, as that method computes it: ``U.cross_entropy`` (unit
scaled in the backward pass) of the float32 logits against the labels. A model's own
``loss`` method is not called.

The module is imported with the current directory on ``sys.path`` (as ``python -m`` has it),
so ``my_model:build`` finds ``./my_model.py``. The run's ``config.yaml`` records the factory:
resume, ``evaluate`` and ``sample`` call it again and load the checkpoint into what it returns.
Problems are one :class:`~ipu_unit_scaling.training.config_files.ConfigError` naming
``model.factory``: a path that is not ``module:function``, a module that does not import, a missing
or non-callable attribute, a factory that raises, returns something other than an ``nn.Module``, or
a model whose output is not ``[batch, seq, vocab_size]`` logits (checked by one forward pass of a
``[1, seq_len]`` batch, in eval mode, without gradients, before training).

Backends: ``cpu`` and ``emulator`` (the IPU backend on the PopTorch stand-in: the traced graph
and PopART-style gradients); ``ipu`` and ``ipu_model`` with one IPU per replica (the same code
on the SDK's PopTorch). Refused: ``popxl``
(it trains the GPT it writes in PopXL), ``distributed`` (its stages and replicas split the
GPT's layer list), a pipeline (``ipu.ipus_per_replica`` above 1: the stage split places the
GPT's layers), the masked-LM task (it trains the package's encoder) and ``compare`` (its
regimes rebuild the GPT plain, unit-scaled and in u-μP).
"""
from __future__ import annotations

import copy
import importlib
import os
import re
import sys
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor, nn

from .. import ops as U
from ..models.gpt import GPTConfig
from ..modules.mup_parameter import has_parameter_data
from ..parametrization.umup import WeightRule
from .config_files import ConfigError
from .run_config import Config

__all__ = ["FACTORY_KEY", "GivenLanguageModel", "load_factory",
           "check_given_model", "build_given_model"]

FACTORY_KEY = "model.factory"

# unit_scaling's parameter types -> this package's (an embedding table is a "weight" there).
_WEIGHT_TYPE_OF_MUP_TYPE = {"weight": "hidden", "output": "output", "norm": "norm",
                            "bias": "bias"}

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def _refuse(message: str) -> ConfigError:
    return ConfigError([(FACTORY_KEY, message)])


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _exited(error: SystemExit) -> str:
    """How user code that called ``sys.exit`` is named: its code when a number or short text,
    else the type of what it passed (a config object's repr would fill the line)."""
    code = error.code
    if code is None or isinstance(code, int):
        shown = "" if code is None else str(code)
    elif isinstance(code, str) and len(code) <= 40 and "\n" not in code:
        shown = repr(code)
    else:
        shown = f"<{type(code).__name__}>"
    return f"called sys.exit({shown})"


def load_factory(path: str) -> Callable[[GPTConfig], Any]:
    """The callable ``path`` (``package.module:function``, the function part may be dotted)
    names; ConfigError saying what is wrong otherwise."""
    if not _PATH.match(path):
        raise _refuse(f"got {path!r}; expected 'package.module:function', e.g. "
                      "'my_model:build' for build() in ./my_model.py")
    module_name, attribute = path.split(":")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise _refuse(f"cannot import {module_name!r} (no module {error.name!r} on the path "
                          f"from {here} or PYTHONPATH)") from None
        raise _refuse(f"importing {module_name!r} failed: {_first_line(error)}") from None
    except Exception as error:  # the module's own code failed: say how, in one line
        raise _refuse(f"importing {module_name!r} failed: {_first_line(error)}") from None
    except SystemExit as error:
        raise _refuse(f"importing {module_name!r} {_exited(error)}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise _refuse(f"{module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise _refuse(f"{path} is a {type(target).__name__}, not a function")
    return target  # type: ignore[no-any-return]


def check_given_model(config: Config, backend: str, trains_given_model: bool = True) -> None:
    """ConfigError if ``config.model.factory`` does not import, or names a model that
    ``backend`` (``trains_given_model``: its capability) or ``config``'s IPU layout cannot
    train; nothing when it is not set."""
    path = config.model.factory
    if path is None:
        return
    if not trains_given_model:
        raise _refuse(f"a given model trains on a backend that takes any model, not backend "
                      f"{backend!r} (it trains the GPT it splits or writes itself)")
    if config.ipu.ipus_per_replica > 1:
        raise _refuse(f"a given model trains on one IPU per replica, not "
                      f"ipu.ipus_per_replica={config.ipu.ipus_per_replica} (the pipeline split "
                      "places the GPT's layers); set ipu.ipus_per_replica=1 and "
                      "ipu.layers_per_ipu=[-1]")
    load_factory(path)


class GivenLanguageModel(nn.Module):
    """The model a factory returned, called as the loop calls its GPT:
    ``forward(input_ids)`` gives logits, ``forward(input_ids, labels)`` the loss,
    ``return_logits=True`` both as ``(loss, logits)``."""

    def __init__(self, model: nn.Module, factory: str):
        super().__init__()
        self.model = model
        self.factory = factory

    def umup_rules(self) -> Dict[str, WeightRule]:
        """u-μP's type of each parameter, from the ``mup_type`` and ``mup_scaling_depth`` that
        ``uu`` modules and ``uu.DepthSequential`` give it (the rates ``uu.optim`` applies)."""
        rules: Dict[str, WeightRule] = {}
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if not has_parameter_data(param):
                    raise ConfigError([("model.parametrization", (
                        f"u-μP takes each tensor's learning rate from its mup_type; {name} of a "
                        f"{type(module).__name__} in the model of {self.factory} has none: build "
                        "it from uu modules, or set model.parametrization=unit"))])
                kind = _WEIGHT_TYPE_OF_MUP_TYPE[param.mup_type]  # type: ignore[attr-defined]
                if kind == "hidden" and isinstance(module, nn.Embedding):
                    kind = "embedding"
                rules[name] = WeightRule(kind, tuple(param.shape),
                                         param.mup_scaling_depth)  # type: ignore[attr-defined]
        return rules

    def logits(self, input_ids: Tensor) -> Tensor:
        output = self.model(input_ids)
        logits = getattr(output, "logits", output)
        if not isinstance(logits, Tensor) or logits.dim() != 3 \
                or logits.shape[:2] != input_ids.shape:
            shape = list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise _refuse(f"the model of {self.factory} maps ids {list(input_ids.shape)} to "
                          f"{shape}; expected logits [batch, seq, vocab_size]")
        return logits

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None,
                return_logits: bool = False) -> Any:
        logits = self.logits(input_ids)
        if labels is None:
            return logits
        loss = U.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
        return (loss, logits) if return_logits else loss


def build_given_model(settings: GPTConfig) -> GivenLanguageModel:
    """Call ``settings.factory`` with a copy of ``settings``; the model it returns, checked
    to give ``[batch, seq, vocab_size]`` logits, as the loop calls its models."""
    path = settings.factory
    if path is None:
        raise ValueError("settings.factory is not set")
    factory = load_factory(path)
    try:
        model = factory(copy.deepcopy(settings))
    except Exception as error:  # the user's code: one line, naming where it came from
        raise _refuse(f"{path} raised {_first_line(error)}") from None
    except SystemExit as error:  # not the command's exit: its status 1 means divergence
        raise _refuse(f"{path} {_exited(error)} instead of returning a model") from None
    if not isinstance(model, nn.Module):
        raise _refuse(f"{path} returned {type(model).__name__}, not a torch.nn.Module")
    given = GivenLanguageModel(model, path)
    _check_logits(given, settings)
    return given


def _check_logits(given: GivenLanguageModel, settings: GPTConfig) -> None:
    ids = torch.zeros(1, settings.seq_len, dtype=torch.long)
    was_training = given.training
    given.eval()
    try:
        with torch.no_grad():
            logits = given.logits(ids)
    except ConfigError:
        raise
    except Exception as error:
        raise _refuse(f"the model of {given.factory} fails on ids [1, {settings.seq_len}]: "
                      f"{_first_line(error)}") from None
    except SystemExit as error:
        raise _refuse(f"the model of {given.factory} {_exited(error)} on ids "
                      f"[1, {settings.seq_len}]") from None
    finally:
        given.train(was_training)
    if logits.shape[-1] != settings.vocab_size:
        raise _refuse(f"the model of {given.factory} gives {logits.shape[-1]} logits per "
                      f"token; the run's vocabulary (model.vocab_size) is {settings.vocab_size}")
