"""What an ``emulate`` run leaves in the temporary directory is what the guide says: torch's
compile cache directory, which torch's fake-tensor mode makes, and nothing of the command's."""
from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

PROGRAM = """import torch
import poptorch
model = poptorch.inferenceModel(torch.nn.Linear(4, 2))
assert model(torch.ones(3, 4)).shape == (3, 2)
"""


def test_an_emulated_program_leaves_only_what_the_guide_names(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TMPDIR": str(temporary)}
    environment.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-m", "ipu_unit_scaling", "emulate", str(program)],
                          cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    left = sorted(os.listdir(temporary))
    assert all(name.startswith("torchinductor_") for name in left), left  # <user>, sanitised
    guide = (ROOT / "docs" / "guide" / "poptorch-programs.md").read_text()
    assert "nothing is left in the temporary directory" not in guide
    assert "$TMPDIR/torchinductor_<user>" in guide and "TORCHINDUCTOR_CACHE_DIR" in guide
