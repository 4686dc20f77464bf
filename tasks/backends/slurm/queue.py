"""What Slurm says about the run's jobs, asked once for every thread of this process:
squeue's table of the user's jobs, a job's `scontrol show job`, a node list's host names.
Many units (or runs) polling at once cost one answer per poll, not one each: 64 copies
starting together asked slurmctld 190 times, and two cores spent their time on it."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

from gpuflow.tasks.backends.slurm.commands import LocalClient, said
from gpuflow.tasks.errors import ProvisionError

# how many commands' answers are kept (a job's `scontrol show job` is one)
KEPT = 256
FIELDS = "%i\t%T\t%r\t%N\t%V\t%k"  # id, state, reason, nodes, submitted, comment (free text)


class SharedAnswer:
    """One command's answer shared by the threads of this process: a caller gets an answer
    the command gave after it asked, and one run of the command answers every caller that
    asked while the run before it went on."""

    def __init__(self, cli: LocalClient, argv: list[str]) -> None:
        self.cli, self.argv = cli, argv
        self._lock = threading.Lock()
        self._taken = float("-inf")  # when the run behind `_answer` started
        self._answer: subprocess.CompletedProcess | None = None

    def get(self) -> subprocess.CompletedProcess:
        asked = time.monotonic()
        with self._lock:
            if self._answer is None or self._taken < asked:
                started = time.monotonic()
                self._answer = self.cli.answer(self.argv)
                self._taken = started
            return self._answer


_SHARED: dict[tuple[int, tuple[str, ...]], SharedAnswer] = {}
_SHARED_LOCK = threading.Lock()


def shared(cli: LocalClient, argv: list[str]) -> subprocess.CompletedProcess:
    """Return the answer of `argv` on `cli`, given after this call began (SharedAnswer)."""
    key = (id(cli), tuple(argv))
    with _SHARED_LOCK:
        answer = _SHARED.get(key)
        if answer is None:  # once per command and way of reaching a cluster
            if len(_SHARED) >= KEPT:  # a long-lived worker asks of many jobs: the oldest go
                del _SHARED[next(iter(_SHARED))]
            answer = _SHARED[key] = SharedAnswer(cli, argv)
    return answer.get()


def parse(text: str) -> list[dict[str, Any]]:
    """Return squeue's rows (FIELDS), each with its comment read as the owner's labels."""
    rows = []
    keys = ("id", "state", "reason", "nodes", "submitted")
    for line in text.splitlines():
        parts = line.split("\t", 5)
        if len(parts) < 6:
            continue
        try:
            comment = json.loads(parts[5])
        except ValueError:  # not gpuflow's
            comment = {}
        row: dict[str, Any] = dict(zip(keys, parts[:5], strict=True))
        row["comment"] = comment if isinstance(comment, dict) else {}
        rows.append(row)
    return rows


_ROWS: dict[int, tuple[subprocess.CompletedProcess, dict[str, dict[str, Any]]]] = {}
_ROWS_LOCK = threading.Lock()


def job_row(cli: LocalClient, job_id: str) -> dict[str, Any] | None:
    """Return squeue's row of a job (read after this call began), None once Slurm no longer
    knows it; ProvisionError when squeue fails."""
    out = shared(cli, ["squeue", "-h", "--me", "-a", "-t", "all", "-o", FIELDS])
    if out.returncode != 0:
        raise ProvisionError(f"`squeue` failed: {said(out.stderr)}")
    with _ROWS_LOCK:  # each answer parsed once, whoever asks
        parsed = _ROWS.get(id(cli))
        if parsed is None or parsed[0] is not out:
            parsed = _ROWS[id(cli)] = (out, {row["id"]: row for row in parse(out.stdout)})
    return parsed[1].get(job_id)


def job_shown(cli: LocalClient, job_id: str) -> str:
    """Return `scontrol show job` of a job (read after this call began); "" when it fails."""
    out = shared(cli, ["scontrol", "show", "job", job_id])
    return out.stdout if out.returncode == 0 else ""


_HOSTS: dict[tuple[int, str], list[str]] = {}


def hostnames(cli: LocalClient, nodes: str) -> list[str]:
    """Return the host names of a node list ("g[1-2]": g1, g2), each list expanded once."""
    key = (id(cli), nodes)
    if key not in _HOSTS:
        _HOSTS[key] = cli.run(["scontrol", "show", "hostnames", nodes]).split()
    return _HOSTS[key]
