"""The applications: the ``ipu-unit-scaling`` command and what it runs (compare, sweep,
evaluate, sample, the masked-LM comparison)."""
