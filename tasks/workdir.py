"""A job's working folder and how a unit starts in it.

On this machine, `scan` reads the folder (its `.gitignore` and `.gpuflowignore` excludes,
`.git` always left out, no link that points out of it, a size limit) and `pack` writes it
once per run into one archive named by its SHA-256 (the same content, the same bytes).
On each node, `python -m gpuflow.tasks.workdir START -- COMMAND...` runs the starter
(tasks/starter.py: it unpacks the archive, runs the setup and becomes the command).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import stat
import sys
import tarfile
import time
from pathlib import Path

from pydantic import BaseModel, Field

from gpuflow.tasks.starter import (  # the node's side, in a file of its own
    SETUP_FAILED_EXIT,
    SHA_MARKER,
    VARIABLE,
    WORK,
    _inside,
    expand,
    main,
    variables,
)
from gpuflow.tasks.units import format_bytes

IGNORE_FILES = (".gitignore", ".gpuflowignore")
ALWAYS_LEFT_OUT = (".git/",)
PACKING = ".packing-"  # an archive being written: .packing-<pid>-<ns>
KEEP_ARCHIVES_S = 7 * 24 * 3600  # packed archives unused this long are removed


class WorkdirError(ValueError):
    """The working folder cannot be sent as it is; one sentence naming the fix."""


class LeftOut(BaseModel):
    """What a working folder's ignore files left out of what is sent: how many files, their
    bytes, and the largest paths (a folder left out whole ends in /)."""

    files: int = 0
    size: int = 0
    largest: list[tuple[str, int]] = []  # (path, bytes), largest first
    at_least: bool = False  # a folder too large to count whole: more than the figures say

    def add(self, path: str, files: int, size: int) -> None:
        self.files += files
        self.size += size
        self.largest = sorted([*self.largest, (path, size)], key=lambda e: -e[1])[:LARGEST]

    def said(self) -> str:
        """Return one phrase for a run's log: what was left out, and how to keep a file."""
        if not self.files:
            return "nothing left out"
        more = "more than " if self.at_least else ""
        shown = ", ".join(f"{path} {format_bytes(size)}" for path, size in self.largest)
        return (
            f"left out by its ignore files: {more}{self.files} files, {more}"
            f"{format_bytes(self.size)} (largest: {shown}); a `!PATTERN` line in .gpuflowignore"
            " sends a file .gitignore leaves out"
        )


LARGEST = 3  # the largest paths left out, named in the log
COUNT_AT_MOST = 20_000  # files counted in the folders left out, at most (a whole .venv)


class Packed(BaseModel):
    """A working folder packed: its archive on this machine, named by its SHA-256."""

    sha256: str
    path: str
    files: int
    size: int  # bytes of the files before compression
    left_out: LeftOut = Field(default_factory=LeftOut)


class Start(BaseModel):
    """What the starter does on a node before it becomes the unit's command."""

    archive: str | None = None  # where the node reads the packed folder (a path or URL)
    sha256: str | None = None
    setup: list[str] = []  # shell lines, run once per node in the working folder
    expand: bool = False  # ${NAME} in the command's words, from the unit's environment


IGNORE_MAX = 1 << 20  # the most an ignore file may hold


def _ignores(root: Path, field: str):
    import pathspec

    lines = list(ALWAYS_LEFT_OUT)
    for name in IGNORE_FILES:
        lines += _ignore_lines(root / name, field)
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _ignore_lines(path: Path, field: str) -> list[str]:
    """Return the lines of one ignore file (none when there is none); WorkdirError when a
    FIFO, a device or a folder stands there or it is over IGNORE_MAX bytes: opened without
    blocking, its type and size checked before a byte is read."""
    refused = WorkdirError(
        f"{field}: {path} is not a file; make it a file of patterns, one a line, as"
        " .gitignore's (a `!PATTERN` line sends what another line leaves out)"
    )
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except IsADirectoryError:
        raise refused from None
    except OSError as exc:  # a link loop, no permission
        raise WorkdirError(
            f"{field}: {path} cannot be read ({exc.strerror}); fix it or remove it"
        ) from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise refused
    with os.fdopen(descriptor, "rb") as handle:
        data = handle.read(IGNORE_MAX + 1)
    if len(data) > IGNORE_MAX:
        raise WorkdirError(
            f"{field}: {path} holds over {format_bytes(IGNORE_MAX)} of patterns; an ignore"
            " file that large is not one: make it a file of patterns, one a line"
        )
    return data.decode("utf-8", errors="replace").splitlines()


def _count(folder: Path, left: LeftOut) -> tuple[int, int]:
    """Return the files and bytes under `folder` (links not followed), counting at most
    COUNT_AT_MOST files in all (then `left.at_least`)."""
    files = size = 0
    for here, _, names in os.walk(folder):
        for name in names:
            if left.files + files >= COUNT_AT_MOST:
                left.at_least = True
                return files, size
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(here, name)).st_size
                files += 1
    return files, size


def scan(root: Path, limit: int, field: str = "job.workdir") -> list[Path]:
    """Return the files of `root` to send (relative paths, sorted), without what its
    ignore files exclude; WorkdirError when it is missing, not a folder, holds a link out
    of it, or sends more than `limit` bytes."""
    return scan_folder(root, limit, field)[0]


def scan_folder(root: Path, limit: int, field: str = "job.workdir") -> tuple[list[Path], LeftOut]:
    """Return what `scan` sends, and what the ignore files left out of it. Links are never
    followed (one pointing out of the folder, or in a loop, is refused), a folder that
    cannot be read is named, and the walk stops as soon as the files pass `limit`."""
    if not root.exists():
        raise WorkdirError(f"{field}: {root} does not exist; give the folder that holds the code")
    if not root.is_dir():
        raise WorkdirError(
            f"{field}: {root} is a file, not a folder; give the folder that holds it"
            f" ({root.parent})"
        )
    ignored = _ignores(root, field)
    found: list[Path] = []
    left = LeftOut()
    size = 0
    real_root = root.resolve()

    def unreadable(exc: OSError) -> None:
        where = Path(exc.filename or root)
        raise WorkdirError(
            f"{field}: {where} cannot be read ({exc.strerror}); make it readable, or exclude"
            f" it in {root}/.gpuflowignore"
        )

    for folder, dirs, files in os.walk(real_root, onerror=unreadable):
        here = Path(folder)
        rel_dir = here.relative_to(real_root)
        for d in [d for d in dirs if ignored.match_file(f"{(rel_dir / d).as_posix()}/")]:
            if not (here / d).is_symlink():
                left.add(f"{(rel_dir / d).as_posix()}/", *_count(here / d, left))
        dirs[:] = sorted(d for d in dirs if not ignored.match_file(f"{(rel_dir / d).as_posix()}/"))
        for name in sorted(files) + [d for d in dirs if (here / d).is_symlink()]:
            rel = rel_dir / name
            if ignored.match_file(rel.as_posix()):
                with contextlib.suppress(OSError):
                    left.add(rel.as_posix(), 1, (here / name).lstat().st_size)
                continue
            path = here / name
            try:
                info = path.lstat()
            except OSError as exc:
                unreadable(exc)
            if stat.S_ISLNK(info.st_mode):
                _check_link(path, rel, root, real_root, field)
                found.append(rel)
                continue
            if not stat.S_ISREG(info.st_mode):
                continue  # sockets, FIFOs: nothing a node could use
            size += info.st_size
            found.append(rel)
            if size > limit:  # said at once, not after the whole walk
                raise WorkdirError(
                    f"{field}: {root} holds more than {format_bytes(limit)} to send (after its"
                    f" ignore files), its limit; exclude what the job does not need in"
                    f" {root}/.gpuflowignore, or raise job.workdir_max"
                )
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]
    return sorted(found), left


def _check_link(path: Path, rel: Path, root: Path, real_root: Path, field: str) -> None:
    """WorkdirError when the link `path` points out of the folder, loops or cannot be
    followed: a node gets the link as it is, so what it points to must be sent too."""
    try:
        points = os.readlink(path)
    except OSError as exc:  # a link of /proc: not even where it points may be read
        raise WorkdirError(
            f"{field}: {rel} is a link that cannot be read ({exc.strerror}); remove it or"
            f" exclude it in {root}/.gpuflowignore"
        ) from None
    try:
        target = path.resolve()  # a link to a file still to be made inside is sent as it is
    except RuntimeError:  # Python 3.11 says a loop this way
        target = None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise WorkdirError(
                f"{field}: {rel} is a link to {points}, which cannot be followed"
                f" ({exc.strerror}); remove it or exclude it in {root}/.gpuflowignore"
            ) from None
        target = None
    if target is None:
        raise WorkdirError(
            f"{field}: {rel} is a link that loops ({rel} -> {points} -> ...);"
            f" remove it or exclude it in {root}/.gpuflowignore"
        )
    if not target.is_relative_to(real_root):
        raise WorkdirError(
            f"{field}: {rel} is a link to {points}, out of {root}; copy what it"
            f" points to into the folder, or exclude it in {root}/.gpuflowignore"
        )


def pack(root: Path, limit: int, into: Path) -> Packed:
    """Pack `root` into `into`/<sha256>.tar.gz and return it; the same files give the same
    bytes (sorted names, no times, no owners), so a run that packs twice sends once."""
    files, left_out = scan_folder(root, limit)
    into.mkdir(parents=True, exist_ok=True)
    _remove_old(into)
    temporary = into / f"{PACKING}{os.getpid()}-{time.monotonic_ns()}"  # 0600, swept by reap
    size = 0
    digest = hashlib.sha256()
    try:
        made = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(made, "wb") as raw:
            hashing = _HashingWriter(raw, digest)
            with (
                gzip.GzipFile(fileobj=hashing, mode="wb", compresslevel=1, mtime=0) as zipped,
                tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
            ):
                for rel in files:
                    path = root / rel
                    info = tar.gettarinfo(str(path), arcname=rel.as_posix())
                    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                    if info.isreg():
                        info.mode = 0o755 if info.mode & 0o111 else 0o644
                        size += info.size
                        with open(path, "rb") as content:
                            tar.addfile(info, content)
                    else:  # a link inside the folder (scan refused others), made relative
                        real = os.path.realpath(path)
                        info.linkname = os.path.relpath(real, os.path.realpath(path.parent))
                        tar.addfile(info)
        sha = digest.hexdigest()
        final = into / f"{sha}.tar.gz"
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    return Packed(sha256=sha, path=str(final), files=len(files), size=size, left_out=left_out)


class _HashingWriter(io.RawIOBase):
    def __init__(self, raw: io.BufferedWriter, digest: hashlib._Hash) -> None:
        self.raw, self.digest = raw, digest

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.digest.update(data)
        return self.raw.write(data)


def _remove_old(folder: Path) -> None:
    now = time.time()
    for old in folder.glob("*.tar.gz"):
        with contextlib.suppress(OSError):
            if now - old.stat().st_atime > KEEP_ARCHIVES_S:
                old.unlink()


__all__ = ["SETUP_FAILED_EXIT", "SHA_MARKER", "VARIABLE", "WORK", "_inside", "expand", "variables"]

if __name__ == "__main__":
    main(sys.argv[1:])
