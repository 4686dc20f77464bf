"""A member's run on a shared platform never gets the platform owner's powers.

The platform's worker runs every flow run as its owner's Unix user: a job started on this
host as a plain process could read the owner's GPUFLOW_HOME (the platform's auth string, the
user book, the database and its key), and a spec that names host paths or Secret blocks
would have gpuflow read them for it. So before anything is provisioned, a run whose tag
names a user who is not an admin (tasks/platform/users.py) must:

- run in a container image wherever it runs on this host (`image:`; the container mounts
  its workspace alone: tasks/backends/imaging.py);
- name no file of this host: no `job.workdir`, no `file://` URL anywhere in the spec;
- read only Secret blocks named after it (`NAME-...`: its own, which an admin saves).

Runs without an owner tag are the platform's own (its owner's commands and triggers); runs
on a member's own machine are checked by nobody here (no user book there: the member's
own powers). One sentence each, naming the field and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform.users import UserBook, owner_of
from gpuflow.tasks.spec import CodeJob, JobSpec

ON_THIS_HOST = ("local",)  # the backends whose jobs run on the platform's own host


def own_block(owner: str, name: str) -> bool:
    """Return True when block `name` is `owner`'s on a shared platform (`owner-...`)."""
    return name.startswith(f"{owner}-")


def member(tags: list[str], book: UserBook) -> tuple[str, str] | None:
    """Return (name, "NAME is a member of this shared platform") when the run these `tags`
    mark is confined: a user's who is not an admin, on the platform's host (where the user
    book is); None for the platform's own runs, an admin's, and elsewhere. InvalidSpec for
    a run of a user revoked or removed since it was made."""
    owner = owner_of(tags)
    if owner is None or not book.path.is_file():
        return None
    user = book.users().get(owner)
    if user is None or user.revoked is not None:
        raise InvalidSpec(
            f"this run belongs to {owner}, who is no longer a user of this platform (revoked"
            f" or removed); an admin may run it, or give {owner} a token again."
        )
    if user.role == "admin":
        return None
    return owner, f"{owner} is a {user.role} of this shared platform"


def confine(spec: JobSpec, tags: list[str], book: UserBook) -> None:
    """Raise InvalidSpec (one sentence) when a confined run (`member`) asks for more than a
    member's run may have."""
    if (found := member(tags, book)) is None:
        return
    owner, who = found
    places = list(spec.candidates) or [spec.placement]
    if spec.image is None and any(p.backend in ON_THIS_HOST for p in places):
        raise InvalidSpec(
            f"image: {who}, and a member's job on the platform's host runs in a container"
            " image (as a plain process it would run as the platform's owner); add"
            " `image:` (e.g. image: python:3.12-slim) or place it on another backend."
        )
    if isinstance(spec.job, CodeJob) and spec.job.workdir:
        raise InvalidSpec(
            f"job.workdir: {who}, and its run may not send a folder of the platform's host;"
            " put the code in the job's image (or ask an admin to run it)."
        )
    if (field := _host_file(spec.model_dump(mode="json"), "")) is not None:
        raise InvalidSpec(
            f"{field}: {who}, and its run may not read or write the platform host's files"
            " (file://, or a path of this host); use s3:// storage (or ask an admin to run"
            " it)."
        )
    for variable, block in spec.secret_env.items():
        if not own_block(owner, block):
            raise InvalidSpec(
                f"secret_env.{variable}: Secret block {block!r} is not {owner}'s; a member's"
                f" run reads only its own Secret blocks, named {owner}-...: ask an admin to"
                f" save it as {owner}-{block} (`gpuflow secret set {owner}-{block}`)."
            )


def confine_paths(
    paths: Mapping[str, str | None],
    blocks: Mapping[str, str | None],
    tags: list[str],
    book: UserBook,
) -> None:
    """For a flow's own parameters: a confined run names no path of this host among
    `paths` (field -> value; s3:// and synthetic: sources pass) and only its own blocks
    among `blocks`."""
    if (found := member(tags, book)) is None:
        return
    owner, who = found
    for field, value in paths.items():
        if value and not value.startswith(("s3://", "synthetic:")):
            raise InvalidSpec(
                f"{field}: {who}, and its run may not read or write the platform host's files"
                f" ({value[:60]!r}); use s3:// (or ask an admin to run it)."
            )
    for field, block in blocks.items():
        if block and not own_block(owner, block):
            raise InvalidSpec(
                f"{field}: block {block!r} is not {owner}'s; a member's run uses only its own"
                f" blocks, named {owner}-..."
            )


INSIDE_THE_JOB = ("env", "secret_env")  # values the job reads in its own container


def _host_file(value: Any, where: str, listed: bool = False) -> str | None:
    """Return the field (dotted) of the first file:// URL in a spec's JSON, or of a field
    naming a path that exists on this host (a render's local scene, a workspace root);
    in lists (a command and its arguments: paths inside the image) only file:// URLs
    count, and the job's environment is its own. None when there is none."""
    if isinstance(value, str):
        local = not listed and value.startswith(("/", "~")) and Path(value).expanduser().exists()
        return (where or "spec") if value.startswith("file://") or local else None
    if isinstance(value, list | tuple):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = ((k, v) for k, v in value.items() if k not in INSIDE_THE_JOB)
    else:
        return None
    for key, inner in items:
        inside = isinstance(value, list | tuple) or listed
        found = _host_file(inner, f"{where}.{key}" if where else str(key), inside)
        if found is not None:
            return found
    return None
