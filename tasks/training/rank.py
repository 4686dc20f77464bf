"""A training rank as torchrun starts it: gpuflow.tasks.training.entry, its modules (torch,
numpy, webdataset) loaded without collecting garbage meanwhile, then run. Loading them
is most of a rank's start (1.6 s of CPU, a fifth of it collections among objects that
live as long as the rank); every attempt of every run starts its ranks again."""

from __future__ import annotations

import sys

from gpuflow.tasks.loading import loading

with loading():
    from gpuflow.tasks.training import entry

if __name__ == "__main__":
    sys.exit(entry.main())
