"""Stand-ins for the Poplar SDK's Python packages: PopTorch (:mod:`ipu_standins.poptorch`),
PopXL (:mod:`ipu_standins.popxl`), in torch, on the CPU, and the part of PopART that PopTorch
programs import (:mod:`ipu_standins.popart`).

Each models one outside library and depends on torch alone, as poptorch's own ``python/``
depends only on torch and its compiled core: nothing here imports ``ipu_unit_scaling``. A
program reaches a stand-in as it reaches the real library, by ``import poptorch`` (or ``import
popxl``, ``import popart``) once :func:`ipu_standins.install.install` has mapped the name, which
``ipu-unit-scaling emulate`` has every interpreter of the program do (through the
``sitecustomize`` of :data:`ipu_standins.install.SHIM_DIRECTORY`). The few things a stand-in
has and the real library has not live beside the stand-in, never in its namespace:
:mod:`ipu_standins.poptorch_custom_ops` (where an op library registers the host numerics of
its ``poptorch.custom_op`` ops),
:mod:`ipu_standins.poptorch_settings`, :mod:`ipu_standins.popxl_settings`, and
:mod:`ipu_standins.emulated_system` (the IPU system PopTorch reports under ``emulate``).
"""
