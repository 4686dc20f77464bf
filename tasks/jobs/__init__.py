"""Job kinds: each turns its spec into the command the backend runs."""

from __future__ import annotations

import sys

from tasks.spec import JobSpec


def command_for(spec: JobSpec) -> list[str]:
    """Return the argv that runs `spec`'s job in its workspace."""
    job = spec.job
    if job.kind == "command":
        return list(job.command)
    if job.kind == "matmul":
        return [
            sys.executable,
            "-m",
            "tasks.jobs.matmul",
            "--size",
            str(job.size),
            "--dtype",
            job.dtype,
            "--seconds",
            str(job.seconds),
        ]
    raise ValueError(f"no command for job kind {job.kind!r}")
