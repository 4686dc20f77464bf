"""How gpuflow's Slurm commands reach the cluster: the Slurm client on this machine, with
the SLURM_CONF it is given (or the client's own default). Every failure is named with the
command and what Slurm said, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from tasks.errors import InvalidSpec, ProvisionError

# Every Slurm command gpuflow runs answers within this (slurmctld down: it says so sooner).
TIMEOUT_S = 60.0


def check_client() -> None:
    """Raise InvalidSpec when this machine has no Slurm client, or SLURM_CONF names a file
    that is not there."""
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        raise InvalidSpec(
            "placement.backend: slurm needs the Slurm client (sbatch, srun, squeue, scancel) on"
            " this machine, and it has none; install slurm-client, or run gpuflow on the"
            " cluster's login node."
        )
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        raise InvalidSpec(
            f"SLURM_CONF: {conf} does not exist; point SLURM_CONF at the cluster's slurm.conf,"
            " or unset it to use the client's own."
        )


def slurm(argv: list[str], env: Mapping[str, str] | None = None, check: bool = True) -> str:
    """Return what a Slurm command printed; with `check`, ProvisionError naming the command
    and Slurm's own words when it fails or does not answer."""
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env={**os.environ, **env} if env else None,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ProvisionError(
            f"`{argv[0]}` did not answer within {TIMEOUT_S:.0f} s: the cluster's slurmctld is"
            " busy or unreachable from here"
        ) from None
    except OSError as exc:
        raise ProvisionError(f"`{argv[0]}` could not be started: {exc.strerror}") from None
    if check and done.returncode != 0:
        raise ProvisionError(f"`{argv[0]}` failed: {said(done.stderr)}")
    return done.stdout


def said(stderr: str) -> str:
    """Return Slurm's error lines as one sentence, without the program's prefix."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    text = "; ".join(line.split("error: ", 1)[-1] for line in lines[-3:])
    return text or "no message"
