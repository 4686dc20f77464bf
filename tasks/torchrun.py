"""torchrun for a user's own command, on one node (`launcher: torchrun`).

    python -m gpuflow.tasks.torchrun [torchrun's options] -- python train.py --epochs 3

starts torchrun with those options; each rank runs the command through this module
(`--rank`), which keeps the rank's exit code in the workspace. When every rank of the
node exited with the "preempted" code (a checkpoint saved on SIGTERM), this exits with it
too, so the pipeline retries and the script resumes; otherwise with torchrun's own code
(torchrun says 1 for any failed rank). The pipeline stops a job by sending SIGTERM to its
whole process group: torchrun and the ranks get it directly, so this process only waits.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

from gpuflow.tasks.errors import PREEMPTED_EXIT_CODE

PYTHON = re.compile(r"^python[0-9.]*$")
EXITS = ".gpuflow-rank-exits"  # in the workspace: one file per rank of this node


def _exits() -> Path:
    return Path(os.environ.get("GPUFLOW_WORKSPACE") or ".") / EXITS


def _code(value: object) -> int:
    if value is None:
        return 0
    return value if isinstance(value, int) else 1


def rank(command: list[str]) -> int:
    """Run one rank's command here (a python script in this interpreter, else as a child)
    and keep its exit code for the launcher."""
    code = 1
    try:
        if (
            PYTHON.match(Path(command[0]).name)
            and len(command) > 1
            and not command[1].startswith("-")
        ):
            script = command[1]
            sys.argv = command[1:]
            sys.path.insert(0, str(Path(script).resolve().parent))
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = _code(exc.code)
        else:
            code = subprocess.call(command)
            code = code if code >= 0 else 128 - code
    finally:
        which = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
        _exits().mkdir(parents=True, exist_ok=True)
        (_exits() / which).write_text(str(code))
    return code


def launch(options: list[str], command: list[str]) -> int:
    """Run torchrun with `options` over `command`; return the preempted code when every
    local rank exited with it, else torchrun's."""
    exits = _exits()
    exits.mkdir(parents=True, exist_ok=True)
    for old in exits.iterdir():
        old.unlink()
    nproc = next((int(o.split("=", 1)[1]) for o in options if o.startswith("--nproc-per-node=")), 1)
    torchrun = [sys.executable, "-m", "torch.distributed.run", *options]
    child = subprocess.Popen([*torchrun, "-m", "gpuflow.tasks.torchrun", "--rank", "--", *command])
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the ranks checkpoint first
    code = child.wait()
    codes = [f.read_text().strip() for f in exits.iterdir()]
    if len(codes) == nproc and all(c == str(PREEMPTED_EXIT_CODE) for c in codes):
        return PREEMPTED_EXIT_CODE
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python -m gpuflow.tasks.torchrun [OPTIONS] -- COMMAND...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    options, command = argv[:cut], argv[cut + 1 :]
    if options == ["--rank"]:
        return rank(command)
    return launch(options, command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
