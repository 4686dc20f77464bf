"""Fetch every object under a storage prefix into a folder, keeping the layout below the
prefix; keys that would land outside the folder (`..`, absolute) are refused before
anything is written. Used for render scenes and HPC inputs."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from gpuflow.tasks.storage import FileStore, ObjectInfo, S3Store, StorageError


class UnsafeKey(StorageError):
    """An object's key would put its file outside the folder it is fetched into."""


def relative_names(prefix: str, objects: list[ObjectInfo]) -> list[tuple[str, str]]:
    """Return (url, path below the prefix) for each object; UnsafeKey for the first whose
    path climbs out of the folder (a `..` part, an absolute or empty path)."""
    base = prefix.rstrip("/") + "/"
    named = []
    for obj in objects:
        relative = obj.url[len(base) :] if obj.url.startswith(base) else ""
        parts = PurePosixPath(relative).parts
        if not relative or relative.startswith("/") or ".." in parts:
            raise UnsafeKey(
                f"{obj.url} would land outside the folder it is fetched into (its key climbs"
                f" out of {base}); rename or remove that object."
            )
        named.append((obj.url, relative))
    return named


def fetch_prefix(
    store: FileStore | S3Store,
    prefix: str,
    folder: Path,
    named: list[tuple[str, str]] | None = None,
) -> list[Path]:
    """Download every object under `prefix` (or the already listed `named` ones) into
    `folder`; return the files written. Checks every key before writing any."""
    if named is None:
        named = relative_names(prefix, store.list(prefix))
    root = folder.resolve()
    written = []
    for url, relative in named:
        target = (root / relative).resolve()
        if not target.is_relative_to(root):  # a link inside the folder pointing out
            raise UnsafeKey(f"{url} would land outside {folder}; rename or remove that object.")
        target.parent.mkdir(parents=True, exist_ok=True)
        store.download_file(url, target)
        written.append(target)
    return written
