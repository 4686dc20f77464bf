"""What every MPI rank runs first: take this rank's GPUs, run the program, record how it
ended. Imports only the standard library, since it starts once per rank.

mpirun reports a failed rank poorly (Debian's Open MPI 4.1 cannot even print its
MPI_ABORT notice), so each rank writes `rank-N.json` (rank, host, exit code or signal,
when) into the status folder and the launcher names the first rank that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def local_gpus(local_rank: int, gpus_per_rank: int, visible: list[str]) -> list[str]:
    """Return the devices (from the host's visible list) a local rank owns: rank k gets
    the k-th block of `gpus_per_rank`."""
    start = local_rank * gpus_per_rank
    block = visible[start : start + gpus_per_rank]
    if len(block) < gpus_per_rank:
        raise ValueError(
            f"local rank {local_rank} needs GPUs {start}-{start + gpus_per_rank - 1} but only"
            f" {len(visible)} are visible; lower job.gpus_per_rank or the ranks per host"
        )
    return block


def _first(env: dict[str, str], names: tuple[str, ...]) -> int:
    return next((int(env[n]) for n in names if n in env), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--status-dir", required=True)
    parser.add_argument("--gpus-per-rank", type=int, default=0)
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    env = dict(os.environ)
    rank, local_rank = _first(env, RANK_VARIABLES), _first(env, LOCAL_RANK_VARIABLES)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if "CUDA_VISIBLE_DEVICES" not in env:  # a pod's GPUs, all visible and numbered from 0
        visible = [str(i) for i in range((local_rank + 1) * args.gpus_per_rank)]
    # A rank without GPUs of its own sees none, so it cannot take another rank's by accident.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(local_gpus(local_rank, args.gpus_per_rank, visible))
    status = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
    code: int | None
    sig: int | None
    try:
        child = subprocess.Popen(program, env=env)
    except OSError as exc:
        code, sig = 127, None
        print(f"rank {rank}: cannot start {program[0]!r}: {exc.strerror}", file=sys.stderr)
    else:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: child.send_signal(signum))
        returned = child.wait()
        code, sig = (returned, None) if returned >= 0 else (None, -returned)
    record = {**status, "exit_code": code, "signal": sig, "ended": time.time()}
    folder = Path(args.status_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps(record))
    return code if code is not None else 128 + (sig or 0)


if __name__ == "__main__":
    sys.exit(main())
