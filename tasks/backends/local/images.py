"""Units in the spec's image on this machine: the engine found here pulls the image once per
run and pins it (tasks/containers.py); each unit is one container of that image with the
unit's GPUs, the workspace and the job's TMPDIR mounted at their own paths, the job's
environment passed by name, as the invoking user."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets as tokens
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import BaseModel

from gpuflow.tasks import containers, starter
from gpuflow.tasks.backends.base import exit_end
from gpuflow.tasks.backends.imaging import ENGINE_OWN, check_secrets_pass_by_name, credentials_of
from gpuflow.tasks.contract import Cluster, Needs, UnitEnd, WorkUnit, unit_env
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import stop_group
from gpuflow.tasks.spec import CodeJob, JobSpec


class LocalImage(BaseModel):
    """What a cluster's units run: the engine and the image as pinned at check time."""

    engine: str
    engine_path: str
    image_id: str  # the engine's id of the pinned image: exactly what was checked
    shown: str  # name@digest (or the reference, for an image only this host has)
    user: str | None  # uid:gid; None: the image's own user


def pin(spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
    """Pull the spec's image here (once) and return the spec with its digest; one sentence
    for an image that cannot be had, is for another machine or lacks what the kind needs."""
    assert spec.image is not None
    check_secrets_pass_by_name(spec)
    engine = containers.find_engine()
    wanted = spec.image.pinned
    pinned = containers.pull(engine, wanted, say, credentials_of(spec), spec.image.pull)
    containers.check_architecture(pinned)
    more = starter_needs(spec)
    needs = needs.model_copy(
        update={
            "programs": {**more.programs, **needs.programs},
            "shell": needs.shell or more.shell,
        }
    )
    programs = list(dict.fromkeys(needs.programs.values()))
    if needs.shell or programs:
        try:
            missing = containers.probe(engine, pinned, programs)
        except InvalidSpec:
            if needs.shell:
                raise
            missing = []  # no shell to look with, and the kind starts no shell: the job says
        if missing:
            fields = [f for f, p in needs.programs.items() if p in missing]
            raise InvalidSpec(
                f"{', '.join(fields)}: the image {spec.image.ref!r} has no"
                f" {', '.join(map(repr, missing))}; add it to the image or give the program's"
                " path in the image."
            )
    say(f"image {spec.image.ref} is {pinned.pinned_ref} (run by {engine.name})")
    image = spec.image.model_copy(update={"digest": pinned.digest or None})
    return spec.model_copy(update={"image": image})


def plan(spec: JobSpec) -> LocalImage | None:
    """What the cluster's units will run, from the pinned spec (None: no image)."""
    if spec.image is None:
        return None
    engine = containers.find_engine()
    described = containers.inspect(engine, spec.image.pinned)
    if described is None:
        raise InvalidSpec(
            f"image: {spec.image.pinned!r} is no longer in {engine.name}'s store here (removed"
            " since it was pulled); run again to pull it."
        )
    pinned = containers.pinned_from(spec.image.pinned, described)
    return LocalImage(
        engine=engine.name,
        engine_path=engine.path,
        image_id=pinned.image_id,
        shown=pinned.pinned_ref,
        user=_user(spec.image.user),
    )


def _user(wanted: str) -> str | None:
    if wanted == "invoking":
        return f"{os.geteuid()}:{os.getegid()}"
    if wanted == "image":
        return None
    if wanted == "root":
        return "0:0"
    return wanted


def start(
    image: LocalImage,
    cluster: Cluster,
    unit: WorkUnit,
    env: Mapping[str, str],
    tmp: str,
    memory: int | None,
    gpus: list[int],
) -> tuple[subprocess.Popen, str]:
    """Start the unit in a container; return the engine's process and the container's
    name. Inside, the unit's GPUs are 0..n-1 (the engine hands over those devices only)."""
    engine = containers.Engine(image.engine, image.engine_path)
    inside = {
        **env,
        **unit.env,
        "TMPDIR": tmp,
        **unit_env(unit.node, cluster.nodes, cluster.workspace, list(range(len(gpus)))),
    }
    if not gpus:
        inside.pop("CUDA_VISIBLE_DEVICES", None)
    by_name = {k: v for k, v in inside.items() if k not in ENGINE_OWN}
    on_line = {k: v for k, v in inside.items() if k in ENGINE_OWN}  # never a secret's
    name = f"{cluster.name}-{_safe(unit.name)}-{tokens.token_hex(3)}"
    args = containers.RunArgs(
        name=name,
        cluster=cluster.name,
        image=image.image_id,
        command=_starter_in_image(unit.command, cluster.workspace),
        env_names=sorted(by_name),
        env_values=on_line,
        mounts=[cluster.workspace, tmp],
        read_only=_archive_of(unit.command, cluster.workspace),
        workdir=cluster.workspace,
        user=image.user,
        gpus=gpus,
        memory=memory,
    )
    proc = subprocess.Popen(
        containers.run_argv(engine, args),
        env={**containers.engine_environ(), **by_name},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, name


def _starter_in_image(command: list[str], workspace: str) -> list[str]:
    """The unit's command with gpuflow's starter (`python -m gpuflow.tasks.workdir`, for
    the working folder, setup and ${NAME}) run by the image's own python3 from a copy of
    its one file in the workspace: the image needs no gpuflow."""
    if command[1:3] != ["-m", starter.MODULE]:
        return command
    script = Path(workspace) / ".gpuflow-starter.py"
    if not script.is_file():
        shutil.copyfile(starter.__file__, script)
    return ["python3", str(script), *command[3:]]


def _archive_of(command: list[str], workspace: str) -> list[str]:
    """The working folder's archive the starter reads, where it is a file on this host
    outside the workspace (a fleet host's staged copy): mounted read-only at its path."""
    if command[1:3] != ["-m", starter.MODULE] or len(command) < 4:
        return []
    try:
        archive = json.loads(command[3]).get("archive") or ""
    except ValueError:
        return []
    if not archive.startswith("/") or archive.startswith(workspace.rstrip("/") + "/"):
        return []
    return [archive] if Path(archive).is_file() else []


def starter_needs(spec: JobSpec) -> Needs:
    """What the starter needs of the image: python3, and a shell for job.setup."""
    job = spec.job
    if not isinstance(job, CodeJob) or not (job.workdir or job.setup):
        return Needs()
    programs = {"job.workdir" if job.workdir else "job.setup": "python3"}
    return Needs(programs=programs, shell=bool(job.setup))


def probe_argv(image: LocalImage, cluster: Cluster, argv: list[str]) -> list[str]:
    """The engine command that runs `argv` once in the image with the cluster's GPUs and
    workspace, as the job would (preflight's look at torch and CUDA from inside)."""
    engine = containers.Engine(image.engine, image.engine_path)
    args = containers.RunArgs(
        name=f"{cluster.name}-probe-{tokens.token_hex(3)}",
        cluster=cluster.name,
        image=image.image_id,
        command=argv,
        env_names=[],
        env_values={},
        mounts=[cluster.workspace],
        workdir=cluster.workspace,
        user=image.user,
        gpus=cluster.gpu_indices,
    )
    return containers.run_argv(engine, args)


def _safe(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", name)[:40] or "unit"


def stop(proc: subprocess.Popen, image: LocalImage, name: str, grace_s: float) -> None:
    """SIGTERM the unit's container (the job's own process gets it), wait `grace_s`, then
    remove it by force; the engine's process ends with it."""
    engine = containers.Engine(image.engine, image.engine_path)
    containers.kill(engine, name, "TERM")
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        engine.run("rm", "--force", name, timeout_s=120)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    if proc.poll() is None:  # the engine's client hung: its group goes
        stop_group(proc.pid, None, 2.0)


def end_of(proc: subprocess.Popen) -> UnitEnd:
    return exit_end(proc.wait())


def remove_all(image: LocalImage | None, cluster: str) -> int:
    """Remove every container of `cluster` (teardown, reap); return how many."""
    if image is None:
        return 0
    return containers.remove(containers.Engine(image.engine, image.engine_path), cluster)
