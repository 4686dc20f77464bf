"""Import this before reading a spec: it registers every job kind (their `job:` models) and
every backend (their `placement:` models), the built-in ones and those registered later."""

from __future__ import annotations

from gpuflow.tasks.backends import registry as backends
from gpuflow.tasks.kinds import registry as kinds

__all__ = ["backends", "kinds"]
