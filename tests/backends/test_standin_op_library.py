"""The package's op library on the PopTorch stand-in: a PopTorch program calling the grouped
FP8 op (``Fp8GroupQuantise``) under ``ipu-unit-scaling emulate`` gets group_cast's values."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ROOT

from ipu_unit_scaling.fp8 import get_format
from ipu_unit_scaling.fp8.group_cast import Grouping, group_cast

pytestmark = pytest.mark.usefixtures("host_library")

PROGRAM = """
import sys
import torch
import poptorch

CASTS = [  # (format, grouping, group_size, rule, scale_rounding, margin)
    ("F143", "row", 0, "amax", "floor", 0),
    ("F152", "tile", 128, "amax", "floor", 2),
    ("F143", "block", 128, "amax", "floor", 0),
    ("E4M3FN", "tile", 32, "mx", "floor", 0),
    ("E5M2", "tile", 32, "mx", "up", 0),
]


class Quantise(torch.nn.Module):
    def forward(self, x):
        outputs = []
        for fmt, grouping, size, rule, rounding, margin in CASTS:
            y, scales, flags = poptorch.custom_op(
                [x], "Fp8GroupQuantise", "ai.graphcore.unit_scaling", 1,
                example_outputs=[x, torch.zeros(1, dtype=torch.int32),
                                 torch.zeros(1, dtype=torch.int32)],
                attributes={"format": fmt, "grouping": grouping, "group_size": size,
                            "rule": rule, "scale_rounding": rounding, "margin": margin,
                            "saturate": 1})
            outputs.extend([y, scales, flags])
        return tuple(outputs)


x = torch.load(sys.argv[1])
model = poptorch.inferenceModel(Quantise())
torch.save([t.clone() for t in model(x)], sys.argv[2])
"""


def test_a_poptorch_program_gets_group_casts_values_from_the_grouped_op(tmp_path):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(200, 300, generator=generator) * torch.exp2(
        torch.randint(-20, 20, (200, 300), generator=generator).float())
    torch.save(x, tmp_path / "x.pt")
    (tmp_path / "program.py").write_text(textwrap.dedent(PROGRAM))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "ipu_unit_scaling.apps.cli", "emulate",
         str(tmp_path / "program.py"), str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    outputs = torch.load(tmp_path / "out.pt")
    casts = [("F143", Grouping("row"), "amax", "floor", 0),
             ("F152", Grouping("tile", 128), "amax", "floor", 2),
             ("F143", Grouping("block", 128), "amax", "floor", 0),
             ("E4M3FN", Grouping("tile", 32), "mx", "floor", 0),
             ("E5M2", Grouping("tile", 32), "mx", "up", 0)]
    for i, (fmt, grouping, rule, rounding, margin) in enumerate(casts):
        expected = group_cast(x, get_format(fmt), grouping, rule=rule, margin=margin,
                              scale_rounding=rounding)
        values, scales, flags = outputs[3 * i:3 * i + 3]
        reference = expected.values
        if fmt in ("E4M3FN", "E5M2"):  # the IPU's grid has no -0 (docs/guide/codelets.md)
            values, reference = values + 0.0, reference + 0.0
        assert torch.equal(values.view(torch.int32), reference.view(torch.int32)), fmt
        assert torch.equal(scales, expected.log2_scales), fmt
        assert not bool(flags.any())
