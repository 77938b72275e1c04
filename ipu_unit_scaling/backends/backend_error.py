"""The error every backend raises for what it cannot run, in its own module so that each
backend can raise it without importing the backend selection that imports them all."""
from __future__ import annotations


class BackendError(RuntimeError):
    """A backend cannot run this model or config here (the message says why)."""
