"""The job's outputs folder, copied into the run's artifacts without following it out.

A symbolic link is never followed out of the outputs folder: a link to a file inside it
is copied as that file, anything else (a folder, a path outside, a loop, a dangling link)
is left out and named. The files gpuflow shows in summaries (error.txt, result.json) are
copied with the run's secrets masked.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

MASKED = ("error.txt", "result.json")


def copy_outputs(source: Path, target: Path, redact: Callable[[str], str]) -> list[str]:
    """Copy `source` into `target`; return what was left out, one phrase each."""
    skipped: list[str] = []
    root = source.resolve()
    for folder, dirs, files in os.walk(source):  # never descends into linked folders
        here = Path(folder)
        into = target / here.relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in [d for d in dirs if (here / d).is_symlink()]:
            dirs.remove(name)
            skipped.append(f"{(here / name).relative_to(source)} (a link to a folder)")
        for name in files:
            path = here / name
            if path.is_symlink():
                real = Path(os.path.realpath(path))
                if not real.is_relative_to(root) or not real.is_file():
                    skipped.append(f"{path.relative_to(source)} (a link out of the outputs)")
                    continue
            elif not path.is_file():
                skipped.append(f"{path.relative_to(source)} (not a regular file)")
                continue
            if here == source and name in MASKED:
                text = path.read_text(errors="replace")
                (into / name).write_text(redact(text))
            else:
                shutil.copyfile(path, into / name)
    return skipped
