"""torchrun (torch.distributed.run) as the launcher starts it on each node: its modules
(torch) loaded without collecting garbage meanwhile, then its own main(), with the same
arguments and exit codes as `python -m torch.distributed.run`."""

from __future__ import annotations

import sys

from gpuflow.tasks.loading import loading

with loading():
    from torch.distributed import run

if __name__ == "__main__":
    sys.exit(run.main())
