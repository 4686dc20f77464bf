"""A new version of a running service's `job:` section, handed to it through its
endpoint folder (in the run's private workspace): `propose` writes it, the service reads
it, says whether it takes it, and rolls its replicas over to it one at a time.

What a running service can take: a new command, probes, scaling targets, replicas.min,
request and start bounds. What it cannot: a new port or host (the endpoint keeps its
address), a new replicas.max (the GPUs it holds), a new working folder (packed once per
run); for those, start the service again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from gpuflow.tasks.host import write_atomic
from gpuflow.tasks.service.model import ServiceJob

NEXT = "next.json"  # the version offered
ANSWER = "version.json"  # what the service said of it
KEPT = ("port", "host", "workdir", "workdir_max", "packed", "replica_gpus", "setup")


class Answer(BaseModel):
    """The service's word on the version last offered."""

    offer: int  # the offer it answers (its file's mtime in ns)
    version: int
    state: str  # rolling | done | refused | rolled back
    said: str


def propose(folder: Path, job: ServiceJob) -> int:
    """Offer `job` to the service whose endpoint folder is `folder`; return the offer's
    stamp, which the service's answer carries."""
    write_atomic(folder / NEXT, job.model_dump_json())
    os.chmod(folder / NEXT, 0o600)
    return (folder / NEXT).stat().st_mtime_ns


def offered(folder: Path, seen_ns: int) -> tuple[int, ServiceJob | None, str | None]:
    """Return the offer's mtime and the job offered since `seen_ns` (None: nothing new),
    or the sentence that says why it cannot be read."""
    path = folder / NEXT
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return seen_ns, None, None
    if stamp == seen_ns:
        return seen_ns, None, None
    try:
        return stamp, ServiceJob.model_validate_json(path.read_text()), None
    except ValueError as exc:
        return stamp, None, f"the new version could not be read: {exc}"


def refusal(running: ServiceJob, offer: ServiceJob) -> str | None:
    """Return why a running `running` cannot take `offer`, None when it can."""
    for name in KEPT:
        if name in ("packed", "replica_gpus"):
            continue
        if getattr(running, name) != getattr(offer, name):
            return (
                f"job.{name}: a running service keeps its {name} ({getattr(running, name)!r});"
                " start the service again to change it"
            )
    if offer.replicas.max != running.replicas.max:
        return (
            f"job.replicas.max: a running service holds the GPUs of {running.replicas.max}"
            " replicas; start the service again to change it"
        )
    return None


def taken(running: ServiceJob, offer: ServiceJob) -> ServiceJob:
    """Return `offer` with what the running service keeps as it was."""
    return offer.model_copy(update={name: getattr(running, name) for name in KEPT})


def answer(folder: Path, said: Answer) -> None:
    write_atomic(folder / ANSWER, said.model_dump_json())


def answer_of(folder: Path) -> Answer | None:
    try:
        return Answer.model_validate(json.loads((folder / ANSWER).read_text()))
    except (FileNotFoundError, ValueError):
        return None
