"""Checkpoints in storage: every file first, manifest.json last, checksums in the manifest.

A checkpoint is valid only when its manifest exists and every file it names has the
recorded sha256, so one half-written when the process died is never chosen.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.storage import FileStore, S3Store, StorageError, join
from gpuflow.tasks.training.shards import sha256

Store = FileStore | S3Store
_STEP_RE = re.compile(r"/step-(\d{8})/")
MANIFEST = "manifest.json"


def step_prefix(prefix: str, step: int) -> str:
    return join(prefix, f"step-{step:08d}")


def to_bytes(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def write_file(store: Store, prefix: str, step: int, name: str, data: bytes) -> str:
    """Write one checkpoint file; return its sha256 for the manifest."""
    return store.write_bytes(join(step_prefix(prefix, step), name), data).sha256 or sha256(data)


def write_manifest(
    store: Store, prefix: str, step: int, files: dict[str, str], extra: dict[str, Any]
) -> str:
    """Write the manifest that makes the checkpoint at `step` valid; return its URL."""
    url = join(step_prefix(prefix, step), MANIFEST)
    manifest = {"step": step, "files": files, "created": datetime.now(UTC).isoformat(), **extra}
    store.write_bytes(url, json.dumps(manifest, indent=2).encode())
    return url


def steps(store: Store, prefix: str) -> list[int]:
    """Return the steps that have any checkpoint files, newest first."""
    found = {int(m.group(1)) for info in store.list(prefix) if (m := _STEP_RE.search(info.url))}
    return sorted(found, reverse=True)


def load_valid(store: Store, prefix: str, step: int) -> dict[str, bytes] | None:
    """Return the files of the checkpoint at `step`, or None when it is incomplete or damaged."""
    base = step_prefix(prefix, step)
    try:
        manifest = json.loads(store.read_bytes(join(base, MANIFEST)))
        files = {name: store.read_bytes(join(base, name)) for name in manifest["files"]}
    except (StorageError, ValueError, KeyError):
        return None
    if any(sha256(data) != manifest["files"][name] for name, data in files.items()):
        return None
    files[MANIFEST] = json.dumps(manifest).encode()
    return files


def latest_valid(store: Store, prefix: str) -> tuple[int, dict[str, bytes]] | None:
    """Return (step, files) of the newest valid checkpoint under `prefix`, skipping broken ones."""
    for step in steps(store, prefix):
        files = load_valid(store, prefix, step)
        if files is not None:
            return step, files
    return None


def prune(store: Store, prefix: str, keep: int) -> list[int]:
    """Delete every checkpoint older than the newest `keep` valid ones, half-written ones
    included (manifest first, so none is ever seen half-deleted); return the steps removed."""
    every = steps(store, prefix)
    valid = [s for s in every if store.exists(join(step_prefix(prefix, s), MANIFEST))]
    if len(valid) <= keep:
        return []
    oldest_kept = valid[keep - 1]
    removed = []
    for step in (s for s in every if s < oldest_kept):
        base = step_prefix(prefix, step)
        store.delete(join(base, MANIFEST))
        for info in store.list(base):
            store.delete(info.url)
        removed.append(step)
    return removed
