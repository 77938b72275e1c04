"""Old import paths of the modules that moved into the layer folders, still importable.

``import ipu_unit_scaling.train`` gives the module that now lives at
``ipu_unit_scaling.loop.training_loop``: the same module object, so a patch or an ``isinstance``
through either path sees the other. The finder answers only for the names in :data:`MOVED` and
runs before the path finder, so a moved module is never loaded a second time under its old name.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Dict, Optional, Sequence

_PACKAGE = __name__.rsplit(".", 1)[0]

# old path -> new path, both under the package
MOVED: Dict[str, str] = {
    "_host": "fp8.host_library",
    "_llm_ops": "ops.llm_ops",
    "_op_library": "ops.op_library",
    "_softmax_moments": "ops.softmax_moments",
    "backends.emulator": "backends.poptorch_emulator",
    "backends.ipu": "backends.poptorch",
    "backends.ipu.checks": "backends.poptorch.compile_checks",
    "backends.ipu.custom_op": "backends.poptorch.fp8_custom_op",
    "backends.ipu.options": "backends.poptorch.poptorch_options",
    "backends.ipu.rewrites": "backends.poptorch.rewrites",
    "backends.ipu.training": "backends.poptorch.poptorch_training",
    "blocks": "modules.depth_blocks",
    "cli": "apps.cli",
    "config": "training.run_config",
    "data": "training.data",
    "emulator": "fp8.codelet_emulator",
    "encoder": "models.encoder",
    "experiments": "apps.experiments",
    "finetune": "training.finetune",
    "fp8.config": "fp8.fp8_config",
    "fp8.formats": "fp8.fp8_formats",
    "fp8.ops": "fp8.cast_ops",
    "fused": "ops.fused_ops",
    "fused_blocks": "ops.fused_blocks",
    "inference": "training.inference",
    "lowering": "ops.ipu_lowering",
    "memory": "training.memory",
    "mlm": "apps.mlm",
    "plots": "training.plots",
    "poptorch_lowering": "ops.poptorch_lowering_table",
    "popxl": "backends.popxl",
    "popxl._reference_ops": "backends.popxl._reference_ops",
    "popxl._reference_tensor": "backends.popxl._reference_tensor",
    "popxl._reference_transforms": "backends.popxl._reference_transforms",
    "popxl.codelets": "backends.popxl.codelets",
    "popxl.fp8_ops": "backends.popxl.fp8_ops",
    "popxl.model": "backends.popxl.popxl_model",
    "popxl.reference": "backends.popxl.reference",
    "popxl.reference_settings": "backends.popxl.reference_settings",
    "popxl.training": "backends.popxl.popxl_training",
    "precision": "training.precision",
    "pretrained": "apps.pretrained",
    "rundir": "training.run_directory",
    "scaled_identity": "ops.scaled_identity",
    "tasks": "loop.tasks",
    "tensorboard_log": "training.tensorboard_log",
    "tracing": "ops.trace_switch",
    "train": "loop.training_loop",
    "transforms.tracing": "transforms.fx_tracing",
    "umup": "parametrization.umup",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.target_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new name. The import system has just
        given it the alias's spec; it gets its own back, or its later relative imports would
        resolve against the old path's package."""
        module.__spec__ = self.target_spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves the old path of a moved module to the module at its new path."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, name = fullname.partition(".")
        new = MOVED.get(name) if package == _PACKAGE else None
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{_PACKAGE}.{new}"))


if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MovedModuleFinder())
