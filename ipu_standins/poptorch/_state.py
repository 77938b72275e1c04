"""What the stand-in's executor shares with the ops while it traces or runs a model."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

# True while an executor traces or runs a model (``poptorch.isRunningOnIpu()``).
ON_IPU = False
# The stage manager of the model being traced (set by its execution strategy).
STAGE_MANAGER: Optional[Any] = None
# Blocks begun while tracing, in execution order: (block id, stage, phase, ipu).
BLOCKS: List[Tuple[str, int, int, int]] = []
# True between the end of a ``poptorch.Block`` and the start of the next one, while tracing.
BLOCK_ENDED = False
# True while a training model is traced.
TRAINING = False
