"""The IPU system that ``ipu-unit-scaling emulate`` presents to a program.

Programs branch on what PopTorch reports of the machine (``poptorch.ipuHardwareIsAvailable``,
``poptorch.ipuHardwareVersion``): Optimum Graphcore refuses to build options without an IPU Mk2
system, Lightning's IPU accelerator without IPU devices. Under ``emulate`` the PopTorch stand-in
reports an emulated IPU-POD of Mk2 IPUs (16 unless told otherwise), so that such programs take
the path they take on an IPU. The number of IPUs is :data:`EMULATED_IPUS_ENV` in the program's
environment (``emulate --ipus N`` sets it); where it is not set, as under a plain
:func:`ipu_standins.install.install`, there is no IPU system, as on a machine without one.

This module reads the environment only (no torch): ``emulate`` checks the number before it
starts the program.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["EMULATED_IPUS_ENV", "DEFAULT_EMULATED_IPUS", "MAX_EMULATED_IPUS", "IPU_VERSION",
           "parse_ipu_count", "emulated_ipus", "device_available", "describe"]

EMULATED_IPUS_ENV = "IPU_UNIT_SCALING_EMULATED_IPUS"
# An IPU-POD16: the system most of Graphcore's and Optimum's examples are configured for
# (pipelines of 2 to 8 IPUs, replicated up to 16 IPUs in all).
DEFAULT_EMULATED_IPUS = 16
# The largest Bow Pod: 1024 IPUs.
MAX_EMULATED_IPUS = 1024
# Mk2 (GC200 / Bow): the architecture string "ipu2", what PopTorch reports as version 2.
IPU_VERSION = 2
# Graphcore's names of the systems of these sizes.
_POD_SIZES = (4, 16, 64, 128, 256)


def parse_ipu_count(text: str, source: str = EMULATED_IPUS_ENV) -> int:
    """The number of IPUs ``text`` gives; ``ValueError`` in one line, naming ``source``, for
    anything but 0 (no IPU system) or a power of two up to :data:`MAX_EMULATED_IPUS` (an IPU
    device is always a power of two of IPUs: PopTorch rounds a pipeline's count up to one)."""
    try:
        count = int(text.strip())
    except ValueError:
        count = -1
    if count < 0 or count > MAX_EMULATED_IPUS or (count & (count - 1)):
        raise ValueError(f"{source} must be 0 (no IPU system) or a power of two from 1 to "
                         f"{MAX_EMULATED_IPUS}, not {text!r}")
    return count


def emulated_ipus(environment: Optional[Mapping[str, str]] = None) -> int:
    """The number of IPUs of the emulated system: 0 (none) where :data:`EMULATED_IPUS_ENV` is
    not set or empty."""
    text = (os.environ if environment is None else environment).get(EMULATED_IPUS_ENV, "")
    return parse_ipu_count(text) if text.strip() else 0


def device_available(num_ipus: int, environment: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the emulated system has a device of ``num_ipus`` IPUs: as a V-IPU partition
    lists them, devices of every power of two of IPUs up to the whole system."""
    total = emulated_ipus(environment)
    return 1 <= num_ipus <= total and not num_ipus & (num_ipus - 1)


def describe(count: int) -> str:
    """The system in words: ``an IPU-POD16 (16 Mk2 IPUs)``."""
    ipus = f"{count} Mk2 IPU" + ("s" if count != 1 else "")
    if count in _POD_SIZES:
        return f"an IPU-POD{count} ({ipus})"
    return f"a system of {ipus}"
