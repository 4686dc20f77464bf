"""What every backend that runs a job in its image shares: the registry's credentials from
the spec's block, the environment names an engine keeps for itself, the pin of an image by
the orchestrator where the units run elsewhere (the registry asked, nothing pulled here),
and a unit in a container on the host that runs it (this machine, a fleet host, an
instance's agent): the engine found there pulls the image once per run and pins it
(tasks/containers.py); each unit is one container of that image with the unit's GPUs, the
workspace and the job's TMPDIR mounted at their own paths, the job's environment passed
by name, as the invoking user."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import secrets as tokens
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from gpuflow.tasks import containers, own_wheel, starter
from gpuflow.tasks.contract import Cluster, Needs, unit_env
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import gpuflow_home, stop_group
from gpuflow.tasks.runscope import recall, remember
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import CodeJob, Image, JobSpec

# what an engine reads from its own environment: a job's value of one of these goes on the
# engine's command line (`--env NAME=VALUE`), so a secret may not use these names
ENGINE_OWN = frozenset(
    {"HOME", "PATH", "TMPDIR", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "USER"}
    | {"REGISTRY_AUTH_FILE", "CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "DOCKER_HOST"}
    | {"DOCKER_CONFIG", "CONTAINER_HOST"}
)


def credentials_of(spec: JobSpec) -> tuple[str | None, str | None]:
    """The user and password image.credentials names (its block), or none."""
    if spec.image is None:
        return None, None
    return credentials_of_image(spec.image)


def credentials_of_image(image: Image) -> tuple[str | None, str | None]:
    """The user and password `image.credentials` names (its block), or none."""
    if image.credentials is None:
        return None, None
    from gpuflow.blocks.registry_credentials import RegistryCredentials

    block = load_block(
        RegistryCredentials,
        image.credentials,
        "image.credentials",
        otherwise="remove image.credentials for a public image",
    )
    registry = containers.registry_of(image.ref)
    if block.registry != registry:
        raise InvalidSpec(
            f"image.credentials: the block {image.credentials!r} is for {block.registry},"
            f" the image is on {registry}; name that registry's block."
        )
    return block.username, block.password.get_secret_value()


def check_secrets_pass_by_name(spec: JobSpec) -> None:
    """A secret never goes on the engine's command line: refuse one named like the
    engine's own environment."""
    for name in spec.secret_env:
        if name in ENGINE_OWN:
            raise InvalidSpec(
                f"secret_env.{name}: a job in an image gets its secrets through the container"
                f" engine's environment, where {name} is the engine's own; give the secret"
                " another name."
            )


def pin_by_registry(spec: JobSpec, say: Callable[[str], None]) -> JobSpec:
    """The spec with its image's digest as the registry gives it now (asked from here;
    the hosts pull that digest): one sentence for an image the registry does not have,
    refuses or a registry that cannot be reached."""
    assert spec.image is not None
    check_secrets_pass_by_name(spec)
    digest = containers.resolve_digest(spec.image.pinned, credentials_of(spec))
    image = spec.image.model_copy(update={"digest": digest})
    say(f"image {spec.image.ref} is {image.pinned}")
    return spec.model_copy(update={"image": image})


@dataclass(frozen=True)
class UnitPlace:
    """Where a unit runs on its host: its workspace, TMPDIR, node and the run's nodes."""

    workspace: str
    tmp: str
    node: int = 0
    nodes: int = 1


class HostImage(BaseModel):
    """What a cluster's units run on a host: its engine and the image as pinned."""

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
    if needs.gpuflow:  # its units run gpuflow's own modules with the image's python3
        brings_gpuflow(engine, pinned, spec.job.kind)
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
    found = HostImage(
        engine=engine.name,
        engine_path=engine.path,
        image_id=pinned.image_id,
        shown=pinned.pinned_ref,
        user=containers.user_of(image.user),
    )
    remember(("host-image", image.pinned, image.user), found)  # provision reads it again
    return spec.model_copy(update={"image": image})


def brings_gpuflow(engine: containers.Engine, pinned: containers.Pinned, kind: str) -> bool:
    """Whether the units' gpuflow is this one's library (own_wheel.library: True), or the
    image's own gpuflow (False: its python3 is another than this gpuflow's compiled
    packages fit, and it has gpuflow installed); one sentence when it can have neither."""
    abi = containers.python_abi(engine, pinned)
    why = (
        f"job.kind: the {kind} kind's units run gpuflow's own code (its launcher, trainer or"
        " renderer) with the image's python3"
    )
    if abi is None:
        raise InvalidSpec(
            f"{why}, and {pinned.ref!r} has none; add Python {version_of(own_wheel.ABI)} to the"
            " image (gpuflow brings its own code into it)."
        )
    if abi == own_wheel.ABI:
        return True
    has_own = engine.run(
        "run", "--rm", "--network", "none", "--entrypoint", "python3",
        pinned.image_id or pinned.ref, "-c", "import gpuflow.tasks.spec", timeout_s=120,
    )  # fmt: skip
    if has_own.returncode == 0:
        return False
    raise InvalidSpec(
        f"{why}, which is Python {version_of(abi)} ({abi or 'no ABI said'}); gpuflow brings its"
        f" code into an image whose python3 is {version_of(own_wheel.ABI)} as this gpuflow's"
        f" ({own_wheel.ABI}), the packages it needs being compiled for that one: use an image"
        f" with Python {version_of(own_wheel.ABI)}, or install gpuflow"
        f" (pip install 'gpuflow=={_own_version()}') in the image."
    )


def version_of(abi: str) -> str:
    """`3.11` from `cpython-311-x86_64-linux-gnu` (the ABI itself when it is not CPython's)."""
    found = re.match(r"cpython-(\d)(\d+)", abi)
    return f"{found[1]}.{found[2]}" if found else (abi or "older than 3.3")


def _own_version() -> str:
    from importlib import metadata

    return metadata.version("gpuflow")


_LIBRARY: dict[str, str | None] = {}  # image id: its library's folder (None: its own)
INSIDE = "/opt/gpuflow"  # where a container sees the library


def library_of(image: HostImage, kind: str = "job") -> str | None:
    """The folder of this gpuflow's library that `image`'s units mount (made here once), or
    None where the image's own gpuflow runs them; InvalidSpec when it can have neither."""
    if image.image_id in _LIBRARY:
        return _LIBRARY[image.image_id]
    engine = containers.Engine(image.engine, image.engine_path)
    pinned = containers.Pinned(image.shown, "", image.image_id, "", "")
    folder = None
    if brings_gpuflow(engine, pinned, kind):
        folder = str(own_wheel.library(gpuflow_home() / "images"))
    _LIBRARY[image.image_id] = folder
    return folder


def runs_gpuflow(command: list[str]) -> bool:
    """Whether a unit's command runs one of gpuflow's own modules (`-m gpuflow.…`)."""
    return any(a == "-m" and b.startswith("gpuflow.") for a, b in itertools.pairwise(command))


def plan(spec: JobSpec) -> HostImage | None:
    """What the cluster's units will run, from the pinned spec (None: no image)."""
    if spec.image is None:
        return None
    if (known := recall(("host-image", spec.image.pinned, spec.image.user))) is not None:
        return known  # as this run's check pinned it, a moment ago
    engine = containers.find_engine()
    described = containers.inspect(engine, spec.image.pinned)
    if described is None:
        raise InvalidSpec(
            f"image: {spec.image.pinned!r} is no longer in {engine.name}'s store here (removed"
            " since it was pulled); run again to pull it."
        )
    pinned = containers.pinned_from(spec.image.pinned, described)
    return HostImage(
        engine=engine.name,
        engine_path=engine.path,
        image_id=pinned.image_id,
        shown=pinned.pinned_ref,
        user=containers.user_of(spec.image.user),
    )


def start(
    image: HostImage,
    cluster: str,
    where: UnitPlace,
    unit: str,
    command: list[str],
    env: Mapping[str, str],
    gpus: list[int],
    memory: int | None = None,
    reads: list[str] | None = None,
    writes: list[str] | None = None,
    shm: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start one unit in a container of `image` on this host; return the engine's process
    and the container's name. Inside, the unit's GPUs are 0..n-1 (the engine hands over
    those devices only)."""
    engine = containers.Engine(image.engine, image.engine_path)
    inside = {
        **env,
        "TMPDIR": where.tmp,
        **unit_env(where.node, where.nodes, where.workspace, list(range(len(gpus)))),
    }
    if not gpus:
        inside.pop("CUDA_VISIBLE_DEVICES", None)
    read_only, library_at = _archive_of(command, where.workspace), {}
    inside_workspace = where.workspace.rstrip("/") + "/"
    outside = [p for p in reads or [] if not p.startswith(inside_workspace)]  # the unit's own
    read_only += [p for p in outside if Path(p).exists()]  # one not there: the job says so
    written = [p for p in writes or [] if not p.startswith(inside_workspace)]
    for folder in written:  # as the job would make it without an image
        Path(folder).mkdir(parents=True, exist_ok=True)
    if runs_gpuflow(command) and (library := library_of(image)) is not None:
        # gpuflow's own code (and what it imports) from this host, first on the path
        inside["PYTHONPATH"] = ":".join(filter(None, [INSIDE, inside.get("PYTHONPATH")]))
        library_at[library] = INSIDE
    by_name = {k: v for k, v in inside.items() if k not in ENGINE_OWN}
    on_line = {k: v for k, v in inside.items() if k in ENGINE_OWN}  # never a secret's
    name = f"{cluster}-{_safe(unit)}-{tokens.token_hex(3)}"
    args = containers.RunArgs(
        name=name,
        cluster=cluster,
        image=image.image_id,
        command=_starter_in_image(command, where.workspace),
        env_names=sorted(by_name),
        env_values=on_line,
        mounts=list(dict.fromkeys([where.workspace, where.tmp, *written])),
        read_only=read_only,
        read_only_at=library_at,
        workdir=where.workspace,
        user=image.user,
        gpus=gpus,
        memory=memory,
        shm=shm,
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


def in_image(command: list[str]) -> list[str]:
    """A unit's command as an image runs it: gpuflow's own modules (`PYTHON -m gpuflow...`,
    this host's interpreter) with the image's python3."""
    if len(command) > 2 and command[1] == "-m" and command[2].startswith("gpuflow."):
        return ["python3", *command[1:]]
    return command


def _starter_in_image(command: list[str], workspace: str) -> list[str]:
    """The unit's command with gpuflow's starter (`python -m gpuflow.tasks.workdir`, for
    the working folder, setup and ${NAME}) run by the image's own python3 from a copy of
    its one file in the workspace: the image needs no gpuflow for it."""
    if command[1:3] != ["-m", starter.MODULE]:
        return in_image(command)
    script = Path(workspace) / ".gpuflow-starter.py"
    if not script.is_file():
        shutil.copyfile(starter.__file__, script)
    return ["python3", str(script), *command[3:5], *in_image(command[5:])]


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


def probe_argv(image: HostImage, cluster: Cluster, argv: list[str]) -> list[str]:
    """The engine command that runs `argv` once in the image with the cluster's GPUs and
    workspace, as the job would (preflight's look at torch and CUDA from inside)."""
    return probe_here(image, cluster.name, cluster.workspace, cluster.gpu_indices, argv)


def probe_here(
    image: HostImage, label: str, folder: str, gpus: list[int], argv: list[str]
) -> list[str]:
    """The engine command that runs `argv` once in the image with `gpus`, in `folder`."""
    engine = containers.Engine(image.engine, image.engine_path)
    args = containers.RunArgs(
        name=f"{label}-probe-{tokens.token_hex(3)}",
        cluster=label,
        image=image.image_id,
        command=argv,
        env_names=[],
        env_values={},
        mounts=[folder],
        workdir=folder,
        user=image.user,
        gpus=gpus,
    )
    return containers.run_argv(engine, args)


def _safe(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", name)[:40] or "unit"


def stop(proc: subprocess.Popen, image: HostImage, name: str, grace_s: float) -> None:
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


def remove_all(image: HostImage | None, cluster: str) -> int:
    """Remove every container of `cluster` (teardown, reap); return how many."""
    if image is None:
        return 0
    return containers.remove(containers.Engine(image.engine, image.engine_path), cluster)
