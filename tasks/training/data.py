"""Reading webdataset shards from storage for training.

`load_index` and `check_shards` run before anything is provisioned. `batches` is the
streaming pipeline inside each rank: shards split by node and by worker (each sample
once per epoch across ranks), a seeded shuffle buffer, decoding, batching. Corrupt
samples are skipped and counted, or fail naming the shard and byte offset.
"""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import ValidationError

from gpuflow.tasks.errors import GpuflowError, InvalidSpec
from gpuflow.tasks.storage import FileStore, ObjectMissing, S3Store, StorageError, join
from gpuflow.tasks.training.shards import DatasetIndex

Store = FileStore | S3Store
Policy = Literal["skip", "fail"]


class DataError(GpuflowError):
    """A shard or sample could not be read; the message names the shard and offset."""


def load_index(prefix: str, store: Store, field: str = "train.dataset") -> DatasetIndex:
    """Return the data set's index; InvalidSpec when it is missing, malformed or empty."""
    try:
        raw = store.read_bytes(join(prefix, "index.json"))
    except ObjectMissing:
        raise InvalidSpec(
            f"{field}: {prefix} has no index.json, so it is not a gpuflow data set;"
            " run prepare_dataset into it first or fix the URL."
        ) from None
    except StorageError as exc:
        raise InvalidSpec(f"{field}: {exc}") from None
    try:
        index = DatasetIndex.model_validate_json(raw)
    except ValidationError:
        raise InvalidSpec(
            f"{field}: {prefix}/index.json is not a data set index; run prepare_dataset again."
        ) from None
    if not index.shards or index.samples == 0:
        raise InvalidSpec(
            f"{field}: the data set at {prefix} is empty; pack some samples into it first."
        )
    return index


def check_shards(
    index: DatasetIndex, prefix: str, store: Store, field: str = "train.dataset"
) -> None:
    """Raise InvalidSpec when a shard the index names is missing or is not a tar file."""
    for url in index.urls(prefix):
        try:
            head = store.read_head(url, 512)
        except StorageError:
            raise InvalidSpec(
                f"{field}: shard {url} named in the index is missing; run prepare_dataset again."
            ) from None
        if len(head) < 512 or head[257:262] != b"ustar":
            raise InvalidSpec(
                f"{field}: shard {url} is not a tar file; rebuild the data set with prepare_dataset."
            )


def _read_exact(stream: Any, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError(f"the shard ends {left} bytes early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def tar_members(stream: Any) -> Iterator[tuple[str, int, bytes]]:
    """Yield (name, header offset, data) for the regular files of a tar stream.

    A small reader of ustar/GNU/pax headers: tarfile's stream mode costs more per member
    than decoding a small image does.
    """
    offset = 0
    long_name: str | None = None
    while True:
        header = stream.read(TAR_BLOCK)
        if not header or header == ZERO_BLOCK:
            return
        if len(header) < TAR_BLOCK:
            header += _read_exact(stream, TAR_BLOCK - len(header))
        if sum(header[:148]) + sum(header[156:]) + 8 * 32 != _octal(header[148:156]):
            raise tarfile.ReadError(f"bad header checksum at byte {offset}")
        size = _octal(header[124:136])
        kind = header[156:157]
        data = _read_exact(stream, size)
        padding = -size % TAR_BLOCK
        if padding:
            _read_exact(stream, padding)
        here, offset = offset, offset + TAR_BLOCK + size + padding
        if kind == b"L":  # GNU long name for the next member
            long_name = data.rstrip(b"\0").decode()
        elif kind == b"x":  # pax extended header: path=...
            for record in data.decode(errors="replace").splitlines():
                if " path=" in record:
                    long_name = record.split(" path=", 1)[1]
        elif kind in (b"0", b"\0"):
            name = long_name or _ustar_name(header)
            long_name = None
            yield name, here, data
        else:
            long_name = None


TAR_BLOCK = 512
ZERO_BLOCK = bytes(TAR_BLOCK)


def _octal(field: bytes) -> int:
    text = field.rstrip(b"\0 ").strip()
    return int(text, 8) if text else 0


def _ustar_name(header: bytes) -> str:
    name = header[:100].rstrip(b"\0").decode()
    prefix = header[345:500].rstrip(b"\0").decode() if header[257:262] == b"ustar" else ""
    return f"{prefix}/{name}" if prefix else name


def tar_samples(
    url: str, stream: Any, policy: Policy, skipped: list[int]
) -> Iterator[dict[str, Any]]:
    """Yield samples (files grouped by basename) from one tar stream, with their offsets."""
    sample: dict[str, Any] = {}
    offset = 0
    try:
        for name, offset, data in tar_members(stream):
            key, _, ext = name.rpartition("/")[2].partition(".")
            key = f"{name.rpartition('/')[0]}/{key}".lstrip("/")
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            if not sample:
                sample = {"__key__": key, "__url__": url, "__offset__": offset}
            sample[ext] = data
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        if policy == "fail":
            raise DataError(
                f"shard {url} is corrupt after byte {offset} ({exc}); rebuild it or set"
                " train.on_corrupt: skip."
            ) from None
        skipped[0] += 1 + (1 if sample else 0)
        return
    if sample:
        yield sample


class _Raw(io.RawIOBase):
    """Lets io.BufferedReader read an HTTP body in large chunks: the tar reader asks for
    512-byte headers, and each small read of a network stream is expensive."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _expand(store_factory: Callable[[], Store], policy: Policy, skipped: list[int]):
    def stage(src: Iterator[Any]) -> Iterator[dict[str, Any]]:
        store = store_factory()
        for item in src:
            url = item["url"] if isinstance(item, dict) else item
            with store.open(url) as raw:
                stream = io.BufferedReader(_Raw(raw), buffer_size=1 << 20)
                yield from tar_samples(url, stream, policy, skipped)

    return stage


def _decoded(decode: Callable[[dict[str, Any]], Any], policy: Policy, skipped: list[int]):
    def stage(src: Iterator[dict[str, Any]]) -> Iterator[Any]:
        for sample in src:
            try:
                yield sample["__key__"], decode(sample)
            except ImportError as exc:  # the decoder's library is missing: no sample is bad
                raise DataError(
                    f"the {exc.name or 'a'} module the samples are decoded with is not"
                    f" installed where the job runs ({exc}); install it (for images: pip"
                    " install pillow) in the job's environment or image."
                ) from None
            except Exception as exc:
                if policy == "fail":
                    raise DataError(
                        f"sample {sample['__key__']} in {sample['__url__']} at byte"
                        f" {sample['__offset__']} is corrupt ({type(exc).__name__}: {exc});"
                        " fix the data or set train.on_corrupt: skip."
                    ) from None
                skipped[0] += 1

    return stage


def _batched(batch_size: int, collate: Callable[[list[Any]], Any], skipped: list[int]):
    def stage(src: Iterator[Any]) -> Iterator[dict[str, Any]]:
        keys, items, reported = [], [], 0
        for key, item in src:
            keys.append(key)
            items.append(item)
            if len(items) == batch_size:
                yield {"keys": keys, "inputs": collate(items), "skipped": skipped[0] - reported}
                reported = skipped[0]
                keys, items = [], []
        if items:  # the epoch's last, smaller batch: every sample is trained on once per epoch
            yield {"keys": keys, "inputs": collate(items), "skipped": skipped[0] - reported}

    return stage


def batches(
    urls: list[str],
    store_factory: Callable[[], Store],
    decode: Callable[[dict[str, Any]], Any],
    collate: Callable[[list[Any]], Any],
    *,
    batch_size: int,
    epoch: int,
    seed: int,
    shuffle_buffer: int,
    policy: Policy,
    rank: int,
):
    """Return an IterableDataset of batches for one epoch of this rank's share of `urls`."""
    import webdataset as wds

    order = list(urls)
    random.Random(seed * 100_003 + epoch).shuffle(order)  # the same on every rank
    skipped = [0]
    stages = [
        wds.SimpleShardList(order),
        wds.split_by_node,
        wds.split_by_worker,
        _expand(store_factory, policy, skipped),
    ]
    if shuffle_buffer > 1:
        rng = random.Random(seed * 1_000_003 + epoch * 1009 + rank)
        stages.append(wds.shuffle(shuffle_buffer, initial=min(shuffle_buffer, 100), rng=rng))
    stages += [_decoded(decode, policy, skipped), _batched(batch_size, collate, skipped)]
    return wds.DataPipeline(*stages)


# -- decoders for the built-in tasks ------------------------------------------------
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")


def decode_classify(sample: dict[str, Any]) -> tuple[Any, int]:
    """Return (image tensor CxHxW in [0,1], label) from an image file and a .cls file."""
    import numpy as np
    import torch
    from PIL import Image

    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    if ext is None or "cls" not in sample:
        raise ValueError(
            f"needs an image ({'/'.join(IMAGE_EXTS)}) and a .cls file, has {sorted(sample)}"
        )
    image = Image.open(io.BytesIO(sample[ext])).convert("RGB")
    array = np.asarray(image, dtype=np.uint8).copy()
    return torch.from_numpy(array).permute(2, 0, 1).float().div_(255.0), int(sample["cls"])


def collate_classify(items: list[tuple[Any, int]]) -> tuple[Any, Any]:
    import torch

    return torch.stack([i for i, _ in items]), torch.tensor([c for _, c in items])


def decode_lm(sample: dict[str, Any], seq_len: int = 128) -> Any:
    """Return seq_len+1 byte tokens from a .txt file (padded with 0)."""
    import torch

    if "txt" not in sample:
        raise ValueError(f"needs a .txt file, has {sorted(sample)}")
    data = sample["txt"][: seq_len + 1].ljust(seq_len + 1, b"\0")
    return torch.tensor(list(data), dtype=torch.long)


def collate_lm(items: list[Any]) -> Any:
    import torch

    return torch.stack(items)
