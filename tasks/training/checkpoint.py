"""Checkpoints in storage: every file first, manifest.json last, checksums in the manifest.

A checkpoint is valid only when its manifest exists and every file it names has the
recorded sha256, so one half-written when the process died is never chosen.
"""

from __future__ import annotations

import hashlib
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


# what makes a checkpoint this job's: its weights only fit the same model, and its data
# position only means something over the same data set and the same ranks
IDENTITY = ("model", "model_args", "task", "strategy", "dataset", "dataset_index", "world_size")


def identity(job: Any, world_size: int, dataset_index: str, name: str) -> dict[str, Any]:
    """Return the identity a checkpoint of `job` records: its model (factory and
    arguments), task, strategy, data set (URL and a digest of its index), ranks, a hash
    of all of these (`spec`), and the job's name (shown, never compared)."""
    fields = {
        "model": job.model,
        "model_args": job.model_args,
        "task": job.task,
        "strategy": job.strategy,
        "dataset": job.dataset,
        "dataset_index": dataset_index,
        "world_size": world_size,
    }
    spec = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    return {**fields, "spec": spec[:16], "job": name}


def index_digest(index_json: str) -> str:
    """Return the short digest of a data set's index (its JSON) a checkpoint records."""
    return hashlib.sha256(index_json.encode()).hexdigest()[:16]


def mismatch(found: dict[str, Any], wanted: dict[str, Any], prefix: str, step: int) -> str | None:
    """Return the sentence refusing a resume from the checkpoint at `step` (its manifest
    `found`) by the job `wanted`; None when it is this job's. A checkpoint written before
    identities were recorded names its model and ranks only: those are compared."""
    recorded = found.get("identity") or {
        "model": found.get("model"),
        "world_size": found.get("world_size"),
    }
    differ = [
        k
        for k in IDENTITY
        if k in recorded and wanted.get(k) is not None and recorded[k] != wanted[k]
    ]
    if not differ:
        return None
    theirs = ", ".join(f"{k} {_shown(recorded[k])}" for k in differ)
    ours = ", ".join(f"{k} {_shown(wanted.get(k))}" for k in differ)
    return (
        f"job.output: the newest checkpoint under {prefix} (step {step}) is job"
        f" {recorded.get('job', 'unknown')!r}'s ({theirs}), not this job {wanted.get('job')!r}'s"
        f" ({ours}); give this job another job.output, or set job.checkpoint.resume: any to"
        " resume from it anyway."
    )


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, dict) else str(value)


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
