"""The starter a unit runs on its node, before it becomes the unit's command:
`python -m gpuflow.tasks.workdir START -- COMMAND...` (where gpuflow is installed) or
`python3 starter.py START -- COMMAND...` (this file alone, in an image that has only its
own Python): it fetches the run's working folder archive (a path, file:// or s3://),
checks its hash, unpacks it into `$GPUFLOW_WORKSPACE/work` once per node, runs the setup
commands once per node, expands `${NAME}` in the command's words from the unit's
environment (nothing else is expanded; no shell is involved) and becomes the command,
started in the working folder.

The standard library only, and no import of gpuflow but for an s3:// archive: it runs in
any Python from 3.8 on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path

MODULE = "gpuflow.tasks.workdir"  # what `python -m` runs where gpuflow is installed
WORK = "work"  # the working folder's place in a unit's workspace
SHA_MARKER = ".gpuflow-work-sha256"  # beside it: the archive it was unpacked from
SETUP_FAILED_EXIT = 3  # what the starter exits with when a setup command fails
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class Start:
    """What the starter does (the orchestrator's `workdir.Start`, read from its JSON)."""

    def __init__(self, data: dict) -> None:
        self.archive = data.get("archive")  # where the node reads the packed folder
        self.sha256 = data.get("sha256")
        self.setup = list(data.get("setup") or [])  # shell lines, once per node
        self.expand = bool(data.get("expand"))  # ${NAME} in the command's words


def variables(words: list[str]) -> list[str]:
    """Return the names of the `${NAME}` variables in `words`, in order."""
    return [name for word in words for name in VARIABLE.findall(word)]


def expand(words: list[str], env: Mapping[str, str]) -> list[str]:
    """Return `words` with each `${NAME}` replaced by its value in `env`; KeyError names
    the first one that is not set."""
    return [VARIABLE.sub(lambda m: env[m.group(1)], word) for word in words]


def _fail(sentence: str, code: int, workspace: Path | None = None) -> None:
    print(f"gpuflow: {sentence}", file=sys.stderr, flush=True)
    if workspace is not None:  # the run's failure sentence, where the run can read it
        with contextlib.suppress(OSError):
            (workspace / "outputs").mkdir(parents=True, exist_ok=True)
            (workspace / "outputs" / "error.txt").write_text(sentence + "\n")
    raise SystemExit(code)


@contextlib.contextmanager
def _node_lock(workspace: Path) -> Iterator[None]:
    """Hold the node's lock: the units of one node (copies per GPU) unpack and set up once."""
    workspace.mkdir(parents=True, exist_ok=True)
    with open(workspace / ".gpuflow-start.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _fetch(archive: str, sha256: str, into: Path) -> None:
    if archive.startswith(("s3://", "file://")):
        from gpuflow.tasks.storage import S3Settings, store_for

        local = into.parent / f".{sha256}.tar.gz"
        store_for(archive, S3Settings.from_env()).download_file(archive, local)
    else:
        local = Path(archive)
    digest = hashlib.sha256()
    with open(local, "rb") as data:
        while chunk := data.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ValueError(
            f"the working folder's archive {archive} is not the one packed for this run"
            f" (SHA-256 {digest.hexdigest()[:12]}, expected {sha256[:12]})"
        )
    partial = into.parent / f".{WORK}-{sha256[:12]}"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(local, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(partial, filter="data")
        else:  # a Python before 3.11.4 (an image's): the same checks, made here
            tar.extractall(partial, members=_inside(tar.getmembers()))
    shutil.rmtree(into, ignore_errors=True)
    partial.rename(into)
    (into.parent / SHA_MARKER).write_text(sha256)
    if local != Path(archive):
        local.unlink(missing_ok=True)


def _inside(members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """Return the archive's members when each stays inside the folder it is unpacked in:
    files, folders and links between them only (what `pack` writes); ValueError else."""
    for member in members:
        name = Path(member.name)
        if name.is_absolute() or ".." in name.parts:
            raise ValueError(f"{member.name} would land outside the working folder")
        if member.issym() and (
            Path(member.linkname).is_absolute()
            or ".." in Path(os.path.normpath(name.parent / member.linkname)).parts
        ):
            raise ValueError(f"{member.name} links out of the working folder")
        if not (member.isfile() or member.isdir() or member.issym()):
            raise ValueError(f"{member.name} is neither a file, a folder nor a link")
        member.mode &= 0o755
    return members


def _setup(start: Start, folder: Path, workspace: Path) -> None:
    key = hashlib.sha256(json.dumps([start.sha256, start.setup]).encode()).hexdigest()
    done = workspace / ".gpuflow-setup-done"
    if done.is_file() and done.read_text() == key:
        return  # another unit of this node ran it
    for number, line in enumerate(start.setup, start=1):
        print(f"gpuflow: setup {number}/{len(start.setup)}: {line}", file=sys.stderr, flush=True)
        ended = subprocess.run(["/bin/sh", "-c", line], cwd=folder, check=False)
        if ended.returncode != 0:
            how = (
                f"was killed by signal {-ended.returncode}"
                if ended.returncode < 0
                else f"exited with {ended.returncode}"
            )
            _fail(
                f"job.setup[{number - 1}] ({line!r}) {how} on this node, so the job did not"
                " start; its output is above. Fix the command (or what it installs) and run"
                " again.",
                SETUP_FAILED_EXIT,
                workspace,
            )
    done.write_text(key)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        _fail("usage: python -m gpuflow.tasks.workdir START_JSON -- COMMAND...", 2)
    start = Start(json.loads(argv[0]))
    command = argv[2:]
    workspace = Path(os.environ.get("GPUFLOW_WORKSPACE") or os.getcwd())
    folder = Path.cwd()
    if start.archive and start.sha256:
        folder = workspace / WORK
        with _node_lock(workspace):
            marker = workspace / SHA_MARKER
            if not (marker.is_file() and marker.read_text() == start.sha256):
                try:
                    _fetch(start.archive, start.sha256, folder)
                except Exception as exc:
                    _fail(f"job.workdir could not be unpacked on this node: {exc}", 2, workspace)
            if start.setup:
                _setup(start, folder, workspace)
    elif start.setup:
        with _node_lock(workspace):
            _setup(start, folder, workspace)
    if start.expand:
        try:
            command = expand(command, os.environ)
        except KeyError as exc:
            _fail(
                f"job.command: ${{{exc.args[0]}}} is not set on this node; set it in env, or"
                " remove it",
                2,
                workspace,
            )
    os.chdir(folder)
    program = command[0]
    if "/" not in program and (folder / program).is_file() and shutil.which(program) is None:
        program = str(folder / program)  # a script of the working folder, named bare
    try:
        os.execvp(program, [command[0], *command[1:]])
    except FileNotFoundError:
        _fail(
            f"job.command: {command[0]!r} is neither in the working folder nor on PATH on"
            " this node; install it in the image (or a setup command), or send it in"
            " job.workdir",
            127,
            workspace,
        )
    except PermissionError:
        _fail(
            f"job.command: {command[0]!r} is not executable; chmod +x it, or start it with"
            " its interpreter ([bash, script.sh])",
            126,
            workspace,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
