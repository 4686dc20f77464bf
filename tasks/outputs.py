"""The job's outputs folder, copied into the run's artifacts as the job left it, never more.

- A symbolic link is never followed out of the outputs folder: a link to a file inside it
  is copied as that file, anything else (a folder, a path outside, a loop, a dangling
  link) is left out and named. An outputs folder that is itself a link is not copied at
  all (the caller says so).
- A hard link to a file outside the folder (the file has more links than the folder
  holds), a file that is not this user's, a FIFO or a device are left out and named:
  each file is opened without following a link and without blocking, and judged by what
  was opened.
- Modes are kept (permission bits only, never widened): a file the job wrote 0600 stays
  0600 in the artifacts.
- Each file is written under a temporary name and renamed: a full disk leaves no
  truncated file under its final name (the OSError goes to the caller).
- The files gpuflow shows in summaries (error.txt, result.json) are copied with the run's
  secrets masked.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

MASKED = ("error.txt", "result.json")
CHUNK = 1 << 20


def copy_outputs(source: Path, target: Path, redact: Callable[[str], str]) -> list[str]:
    """Copy `source` into `target`; return what was left out, one phrase each. OSError
    (a full or read-only disk) leaves only whole files behind."""
    skipped: list[str] = []
    root = source.resolve()
    links_inside = _links_inside(source)
    for folder, dirs, files in os.walk(source):  # never descends into linked folders
        here = Path(folder)
        into = target / here.relative_to(source)
        into.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in [d for d in dirs if (here / d).is_symlink()]:
            dirs.remove(name)
            skipped.append(f"{(here / name).relative_to(source)} (a link to a folder)")
        for name in files:
            path = here / name
            shown = path.relative_to(source)
            opened = path
            if path.is_symlink():
                real = Path(os.path.realpath(path))
                if not real.is_relative_to(root) or not real.is_file():
                    skipped.append(f"{shown} (a link out of the outputs)")
                    continue
                opened = real
            masked = redact if here == source and name in MASKED else None
            why = _copy_file(opened, into / name, links_inside, masked)
            if why:
                skipped.append(f"{shown} ({why})")
    return skipped


def _links_inside(source: Path) -> Counter:
    """Return how many names each file (device, inode) has inside `source`."""
    found: Counter = Counter()
    for folder, _, files in os.walk(source):
        for name in files:
            try:
                info = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found[(info.st_dev, info.st_ino)] += 1
    return found


def _copy_file(
    path: Path, dest: Path, links_inside: Counter, redact: Callable[[str], str] | None
) -> str | None:
    """Copy one file as the job left it (its mode, never wider); return why it was left
    out, or None once copied."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_uid != os.geteuid():
            return f"not the job's own file: it belongs to uid {info.st_uid}"
        if info.st_nlink > links_inside.get((info.st_dev, info.st_ino), 0):
            return "a hard link to a file outside the outputs"
        mode = stat.S_IMODE(info.st_mode) & 0o777
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        tmp.unlink(missing_ok=True)
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(out_fd, "wb") as out:
                if redact is None:
                    shutil.copyfileobj(handle, out, CHUNK)
                else:
                    text = handle.read().decode(errors="replace")
                    out.write(redact(text).encode())
                os.fchmod(out.fileno(), mode)
            tmp.replace(dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return None


class OutputsKept(OSError):
    """The outputs could not be copied; they were moved whole to `kept`."""

    def __init__(self, cause: OSError, kept: Path) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.kept = kept


def keep_whole(outputs: Path, kept_root: Path) -> Path:
    """Move the job's outputs folder out of teardown's reach, whole, and return where it
    now is: `kept_root`/<workspace name> (a rename: no space needed on a full disk), else,
    where that folder cannot be made or lies on another filesystem, beside the workspace."""
    name = outputs.parent.name
    with contextlib.suppress(OSError):
        kept_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        outputs.rename(kept_root / name)
        return kept_root / name
    beside = outputs.parent.with_name(name + ".outputs-kept")
    outputs.rename(beside)
    return beside


Figures = TypeVar("Figures", bound=BaseModel)


def read_result(path: Path, model: type[Figures]) -> Figures | None:
    """Return the figures a job wrote to `path` (its result.json) read through `model`;
    None when it wrote none, or none of that shape (it stopped before its end)."""
    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
