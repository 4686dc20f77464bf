"""Loading modules without collecting garbage meanwhile (a host utility: no gpuflow import)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["loading"]


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Import the body's modules without collecting garbage meanwhile, then freeze what
    they made: a command loads Prefect's and gpuflow's modules (hundreds of thousands of
    objects that live as long as the process), and collecting among them as they are made
    is wasted work (about a tenth of a command's import time); frozen, no later collection
    scans them. Collection is on again after the body, however it ends."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
