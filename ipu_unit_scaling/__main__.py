"""``python -m ipu_unit_scaling`` is the ``ipu-unit-scaling`` command (and what torchrun runs:
``torchrun --nproc-per-node N -m ipu_unit_scaling train ...``)."""
from .apps.cli import command

command()
