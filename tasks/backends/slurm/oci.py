"""A Slurm run's units in the run's image: Slurm's own OCI containers (an `oci.conf` beside
`slurm.conf`; each unit a step `srun --container=BUNDLE`). The bundle (a root file system
and its `config.json`) is made once per image digest on the cluster's shared file system,
beside the runs' workspaces (`.gpuflow-images/<digest>`), by `skopeo` (the image into an
OCI layout, the registry's login in a file only gpuflow's user reads, removed after) and
`umoci` (the layout unpacked); later runs of that digest use it as it is.

The bundle's `config.json` is made fit for Slurm's steps: no terminal and no rlimits
(Slurm 22.05's runc refuses raising them), the node's network (a job reaches its storage
and its other nodes), and the workspaces' folder bound at its own path (Slurm starts the
step in the run's workspace). The GPUs are the site's runtime's to hand over (its
RunTimeRun through the NVIDIA Container Toolkit); Slurm sets CUDA_VISIBLE_DEVICES.
Pyxis/enroot (`srun --container-image`) is not used yet.

A kind whose steps run gpuflow's own code gets this gpuflow's library (own_wheel.library)
beside the bundles (`.gpuflow-images/lib-<key>`, inside the bound folder), first on the
step's PYTHONPATH, where the image's python3 is the version it was made for.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpuflow.tasks import containers, own_wheel, starter
from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.slurm.commands import LocalClient
from gpuflow.tasks.errors import InvalidSpec, ProvisionError
from gpuflow.tasks.host import gpuflow_home
from gpuflow.tasks.spec import Image

IMAGES = ".gpuflow-images"  # beside the runs' workspaces: one bundle per digest
PATCH = """
import json, sys
path, root = sys.argv[1], sys.argv[2]
config = json.load(open(path))
process = config.setdefault("process", {})
process["terminal"] = False
process["rlimits"] = []
linux = config.setdefault("linux", {})
linux["namespaces"] = [n for n in linux.get("namespaces", []) if n.get("type") != "network"]
config.setdefault("mounts", []).append(
    {"destination": root, "source": root, "type": "bind", "options": ["rbind", "rw"]}
)
for name in ("/etc/resolv.conf", "/etc/hosts"):
    config["mounts"].append({"destination": name, "source": name, "type": "bind",
                             "options": ["rbind", "ro"]})
json.dump(config, open(path + ".tmp", "w"))
import os
os.replace(path + ".tmp", path)
"""


def oci_conf(cli: LocalClient) -> str | None:
    """The cluster's oci.conf (beside the slurm.conf its controller reads), or None."""
    shown = cli.run(["scontrol", "show", "config"], check=False)
    conf = next(
        (
            line.split("=", 1)[1].strip()
            for line in shown.splitlines()
            if line.split("=", 1)[0].strip() == "SLURM_CONF"
        ),
        None,
    )
    if not conf:
        return None
    path = f"{conf.rsplit('/', 1)[0]}/oci.conf"
    found = cli.answer(["test", "-f", path])
    return path if found.returncode == 0 else None


def check(cli: LocalClient) -> None:
    """One sentence when the cluster cannot run a job in an image: no OCI support, or no
    skopeo/umoci where gpuflow makes the bundle."""
    if oci_conf(cli) is None:
        raise InvalidSpec(
            "image: this Slurm cluster runs no containers gpuflow can use (Slurm's OCI"
            " containers: an oci.conf beside slurm.conf, `srun --container`); ask its admins"
            " for it, or remove image to run on the nodes' own programs."
        )
    for program in ("skopeo", "umoci"):
        if cli.answer(["sh", "-c", f"command -v {program}"]).returncode != 0:
            raise InvalidSpec(
                f"image: {program} is not installed on {cli.where}, where gpuflow unpacks the"
                f" image for the cluster's nodes; install it (apt-get install {program})."
            )


def bundle(cli: LocalClient, image: Image, root: str, login: tuple[str | None, str | None]) -> str:
    """Return the bundle of the pinned `image` under `root` (the runs' workspaces' folder
    on the shared file system), made when no earlier run of that digest made it;
    ProvisionError (the tool's words) when it cannot be made."""
    if not image.digest:
        raise ProvisionError(f"image: {image.ref!r} was not pinned by digest")
    key = image.digest.removeprefix("sha256:")[:20]
    base = f"{root.rstrip('/')}/{IMAGES}/{key}"
    path = f"{base}/bundle"
    _check_owned(cli, root, base)
    if cli.answer(["test", "-f", f"{path}/config.json"]).returncode == 0:
        return path
    work = f"{root.rstrip('/')}/{IMAGES}/.{key}-{os.getpid()}"
    cli.remove_dir(work)
    cli.make_dir(work)
    source = f"docker://{containers.name_of(image.ref)}@{image.digest}"
    try:
        with _authfile(cli, work, containers.registry_of(image.ref), login) as auth:
            plain = containers.registry_of(image.ref) in containers.plain_http_registries()
            tls = ["--src-tls-verify=false"] if plain else []  # as registries.conf says here
            cli.run(["skopeo", "copy", "--quiet", *tls, *auth, source, f"oci:{work}/layout:image"])
        rootless = ["--rootless"] if cli.run(["id", "-u"]).strip() != "0" else []
        cli.run(["umoci", "unpack", *rootless, "--image", f"{work}/layout:image", f"{work}/bundle"])
        cli.run(["python3", "-c", PATCH, f"{work}/bundle/config.json", root.rstrip("/")])
        cli.run(["rm", "-rf", f"{work}/layout"])
        moved = cli.answer(["mv", "-T", work, base])
        if moved.returncode != 0 and cli.answer(["test", "-f", f"{path}/config.json"]).returncode:
            raise ProvisionError(f"the image's bundle could not be put at {base}")
    finally:
        cli.remove_dir(work)
    return path


@contextlib.contextmanager
def _authfile(
    cli: LocalClient, work: str, registry: str, login: tuple[str | None, str | None]
) -> Iterator[list[str]]:
    """skopeo's --authfile with the registry's login, put in the bundle's work folder
    (0700, this user's) and removed once the copy ended; never on a command line."""
    username, password = login
    if not (username and password):
        yield []
        return
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    target = f"{work}/auth.json"
    with tempfile.TemporaryDirectory(prefix="gpuflow-registry-") as local:
        file = Path(local) / "auth.json"
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {registry: {"auth": token}}}, f)
        cli.run(["chmod", "700", work])
        cli.put_file(file, target)
        cli.run(["chmod", "600", target])
    try:
        yield ["--authfile", target]
    finally:
        cli.run(["rm", "-f", target], check=False)


def in_bundle(cli: LocalClient, command: list[str], workspace: str) -> list[str]:
    """The unit's command as the image runs it: gpuflow's starter (`python -m
    gpuflow.tasks.workdir`, for the working folder, setup and ${NAME}) run by the image's
    own python3 from a copy of its one file in the workspace."""
    if command[1:3] != ["-m", starter.MODULE]:
        return imaging.in_image(command)
    script = f"{workspace.rstrip('/')}/.gpuflow-starter.py"
    cli.put_file(Path(starter.__file__), script)
    return ["python3", script, *command[3:5], *imaging.in_image(command[5:])]


# the image's python3 and the folders its packages are in (Debian's, and python.org's)
_PYTHONS = r"""
cd "$1/rootfs" || exit 0
for p in usr/local/bin/python3 usr/bin/python3; do [ -e "$p" ] && readlink -f "$p"; done
ls -d usr/lib/python3*/*-packages/gpuflow usr/local/lib/python3*/*-packages/gpuflow 2>/dev/null
exit 0
"""


def library(cli: LocalClient, bundle: str, root: str, kind: str) -> str | None:
    """The folder of this gpuflow's library that the steps put first on their path, put
    beside the bundles once (None: the image's own gpuflow runs them); InvalidSpec, one
    sentence, where the image's python3 can have neither."""
    said = cli.run(["sh", "-c", _PYTHONS, "pythons", bundle])
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    versions = {line.rsplit("python", 1)[1] for line in lines if "/bin/python" in line}
    has_own = any(line.endswith("/gpuflow") for line in lines)
    wanted = imaging.version_of(own_wheel.ABI)
    why = f"job.kind: the {kind} kind's units run gpuflow's own code with the image's python3"
    if wanted not in versions:
        if has_own:
            return None
        if not versions:
            raise InvalidSpec(f"{why}, and the image has none; add Python {wanted} to it.")
        raise InvalidSpec(
            f"{why}, which is Python {', '.join(sorted(versions))}; gpuflow brings its code"
            f" into an image whose python3 is {wanted}, as this gpuflow's: use an image with"
            f" Python {wanted}, or install gpuflow in the image."
        )
    made = own_wheel.library(gpuflow_home() / "images")
    target = f"{root.rstrip('/')}/{IMAGES}/{made.name}"
    _check_owned(cli, root, target)
    if cli.answer(["test", "-d", target]).returncode == 0:
        return target
    with tempfile.TemporaryDirectory(prefix="gpuflow-lib-") as local:
        archive = Path(local) / "lib.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(made, arcname=made.name)
        work = f"{root.rstrip('/')}/{IMAGES}/.{made.name}-{os.getpid()}"
        cli.make_dir(work)
        try:
            cli.put_file(archive, f"{work}/lib.tar")
            cli.run(["tar", "-xf", f"{work}/lib.tar", "-C", work])
            moved = cli.answer(["mv", "-T", f"{work}/{made.name}", target])
            if moved.returncode != 0 and cli.answer(["test", "-d", target]).returncode:
                raise ProvisionError(f"gpuflow's library could not be put at {target}")
        finally:
            cli.remove_dir(work)
    return target


def _check_owned(cli: LocalClient, root: str, found: str) -> None:
    """The steps run what is under `.gpuflow-images` as the job: its folder, and `found`
    where it is already there, must be this user's (in a workspace root others can write
    to, another user could have put an image or a library there first)."""
    images = f"{root.rstrip('/')}/{IMAGES}"
    cli.make_dir(images)
    for path in (images, found):
        there = cli.answer(["test", "-e", path]).returncode == 0
        if there and cli.answer(["test", "-O", path]).returncode != 0:
            raise InvalidSpec(
                f"placement.workspace_root: {path} belongs to another user, and the job would"
                " run what it holds; remove it, or give a workspace_root only you can write to."
            )
