"""prepare_dataset's work: source -> webdataset shards + index.json in storage.

Shards are written first and the index last ("put then manifest"): a reader that
finds an index finds every shard it names. Shards whose bytes are already there
(same sha256) are not written again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlparse

from pydantic import BaseModel

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import no_climbing
from gpuflow.tasks.storage import FileStore, S3Store, StorageError, join, store_for
from gpuflow.tasks.training.shards import (
    DatasetIndex,
    Sample,
    ShardInfo,
    folder_samples,
    pack,
    sha256,
    shard_name,
    synthetic_samples,
)
from gpuflow.tasks.units import parse_size

INDEX = "index.json"
_SHARD_RE = re.compile(r"shard-\d{6}\.tar$")
# What a synthetic data set's parameters may be (beyond, numpy or memory refuses).
_SYNTHETIC_BOUNDS = {
    "samples": (1, 100_000_000),
    "seed": (0, 2**32 - 1),
    "image_size": (1, 4096),
    "classes": (1, 1_000_000),
}


class PrepareResult(BaseModel):
    index_url: str
    shards: int
    samples: int
    written: int
    skipped: int
    removed: int
    bytes: int


def open_source(source: str) -> tuple[Iterator[Sample], str]:
    """Return the samples of `source` (a folder, file:// folder, or synthetic:KIND?samples=N)
    and a description; InvalidSpec names what is wrong."""
    if source.startswith("synthetic:"):
        parsed = urlparse(source)
        kind = parsed.path
        example = "write e.g. synthetic:classify?samples=2000&seed=0 or synthetic:lm?samples=500"
        if kind not in ("classify", "lm"):
            raise InvalidSpec(f"source: {source!r} is not a synthetic data set; {example}")
        query = _parameters(source, parsed.query, example)
        try:
            args = {k: int(v) for k, v in query.items()}
        except ValueError:
            raise InvalidSpec(f"source: the numbers in {source!r} must be integers.") from None
        for name, (low, high) in _SYNTHETIC_BOUNDS.items():
            if name in args and not low <= args[name] <= high:
                raise InvalidSpec(
                    f"source: {name}={args[name]} in {source!r} is out of range; give"
                    f" {low} to {high:,}."
                )
        count = args.pop("samples", 1000)
        return synthetic_samples(kind, count, **args), source
    folder = Path(source.removeprefix("file://")).expanduser()
    if not folder.is_dir():
        raise InvalidSpec(
            f"source: {source!r} is not a folder; give a folder of files grouped by basename."
        )
    samples = folder_samples(folder)
    first = next(samples, None)
    if first is None:
        raise InvalidSpec(f"source: {folder} has no files with an extension to pack; it is empty.")

    def chained() -> Iterator[Sample]:
        yield first
        yield from samples

    return chained(), str(folder)


def _parameters(source: str, text: str, example: str) -> dict[str, str]:
    """Return a synthetic data set's parameters; InvalidSpec names one that is unknown,
    empty or given twice."""
    query: dict[str, str] = {}
    for name, value in parse_qsl(text, keep_blank_values=True):
        if name not in _SYNTHETIC_BOUNDS:
            known = ", ".join(_SYNTHETIC_BOUNDS)
            raise InvalidSpec(
                f"source: {name!r} in {source!r} is not a parameter of a synthetic data set"
                f" (it takes {known}); {example}"
            )
        if name in query:
            raise InvalidSpec(f"source: {name} is given twice in {source!r}; give it once.")
        if not value:
            raise InvalidSpec(f"source: {name} has no value in {source!r}; {example}")
        query[name] = value
    if (text and not query) or any(not part for part in text.split("&") if text):
        raise InvalidSpec(f"source: {source!r} has an empty parameter; {example}")
    return query


def check_request(source: str, output: str, shard_size: str) -> int:
    """Return the shard size in bytes; InvalidSpec names the first input that is wrong.
    Reads no credentials and writes nothing, so it runs before any API or flow run."""

    try:
        shard_bytes = parse_size(shard_size)
    except ValueError as exc:
        raise InvalidSpec(f"shard_size: {exc}.") from None
    if shard_bytes < 4096:
        raise InvalidSpec("shard_size must be at least 4 KiB; the usual is 256MB.")
    if not output.startswith(("file:///", "s3://")):
        raise InvalidSpec(
            f"output: {output!r} is not a storage URL; write file:///path or s3://bucket/prefix."
        )
    try:
        no_climbing(output)
        store_for(output)
    except (StorageError, ValueError) as exc:
        raise InvalidSpec(f"output: {exc}.") from None
    open_source(source)
    return shard_bytes


def prepare(
    source: str, output: str, shard_bytes: int, store: FileStore | S3Store
) -> PrepareResult:
    """Pack `source` into shards under `output`, skipping identical ones; write the index last."""
    if shard_bytes < 4096:
        raise InvalidSpec("shard_size must be at least 4 KiB; the usual is 256MB.")
    samples, described = open_source(source)
    shards, written, skipped, total_bytes = [], 0, 0, 0
    for number, (data, keys) in enumerate(pack(samples, shard_bytes)):
        name = shard_name(number)
        digest = sha256(data)
        url = join(output, name)
        if store.checksum(url) == digest:
            skipped += 1
        else:
            store.write_bytes(url, data)
            written += 1
        shards.append(ShardInfo(name=name, samples=len(keys), bytes=len(data), sha256=digest))
        total_bytes += len(data)
    index = DatasetIndex(shards=shards, samples=sum(s.samples for s in shards), source=described)
    index_url = join(output, INDEX)
    store.write_bytes(index_url, index.model_dump_json(indent=2).encode())
    keep = {s.name for s in shards}
    removed = 0
    for info in store.list(output):
        name = info.url.rsplit("/", 1)[-1]
        if (
            _SHARD_RE.match(name)
            and name not in keep
            and info.url.rsplit("/", 1)[0] == output.rstrip("/")
        ):
            store.delete(info.url)
            removed += 1
    return PrepareResult(
        index_url=index_url,
        shards=len(shards),
        samples=index.samples,
        written=written,
        skipped=skipped,
        removed=removed,
        bytes=total_bytes,
    )
