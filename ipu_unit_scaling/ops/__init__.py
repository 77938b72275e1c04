"""The ops layer: the scaling primitive, its constraints, the unit-scaled ops behind
``ipu_unit_scaling.functional`` (U), their fused eager forms, and the one switch to their
PopTorch forms. Nothing here imports from a layer above."""
