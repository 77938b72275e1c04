"""IPU backend: PopTorch options, pipelining and the training wrapper.

Nothing here imports poptorch at import time; the functions that need it import it lazily.
"""
from __future__ import annotations
