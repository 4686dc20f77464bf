"""Loading modules without collecting garbage meanwhile (a host utility: no gpuflow import).

`python -m gpuflow.tasks.loading MODULE [ARGS]` runs MODULE's main() with ARGS as its
command line, MODULE loaded that way: how the training launcher starts torchrun and
torchrun each rank (loading torch is most of their start: 1.6 s of CPU, a fifth of it
collections among objects that live as long as the process)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["loading", "run_main"]


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


def run_main(module: str) -> Any:
    """Import `module` inside loading(), then return what its main() returns."""
    with loading():
        loaded = importlib.import_module(module)
    return loaded.main()


if __name__ == "__main__":
    sys.argv.pop(0)  # MODULE ARGS...: MODULE's own command line, its name in argv[0]
    sys.exit(run_main(sys.argv[0]))
