"""Pack samples into webdataset tar shards, deterministically, with a JSON index.

A sample is a dict of extension -> bytes plus "__key__" (the webdataset convention:
files that share a basename form one sample). The same samples always give the same
shard bytes (fixed mtime, owner and order), so a rerun can skip identical shards.
No torch here.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gpuflow.tasks.errors import InvalidSpec

Sample = dict[str, Any]
TAR_BLOCK = 512


class ShardInfo(BaseModel):
    name: str
    samples: int
    bytes: int
    sha256: str


class DatasetIndex(BaseModel):
    format: str = "gpuflow-webdataset/1"
    shards: list[ShardInfo]
    samples: int
    source: str

    def urls(self, prefix: str) -> list[str]:
        return [f"{prefix.rstrip('/')}/{s.name}" for s in self.shards]


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def _sample_bytes(sample: Sample) -> int:
    return sum(len(v) + TAR_BLOCK for k, v in sample.items() if not k.startswith("__"))


def _tar(samples: list[Sample]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            for ext in sorted(k for k in sample if not k.startswith("__")):
                tar.addfile(*_member(f"{sample['__key__']}.{ext}", sample[ext]))
    return buffer.getvalue()


def pack(samples: Iterable[Sample], target_bytes: int) -> Iterator[tuple[bytes, list[str]]]:
    """Yield (tar bytes, sample keys) per shard of about `target_bytes` each."""
    batch: list[Sample] = []
    size = 0
    for sample in samples:
        cost = _sample_bytes(sample)
        if batch and size + cost > target_bytes:
            yield _tar(batch), [s["__key__"] for s in batch]
            batch, size = [], 0
        batch.append(sample)
        size += cost
    if batch:
        yield _tar(batch), [s["__key__"] for s in batch]


def folder_samples(folder: Path) -> Iterator[Sample]:
    """Yield samples from a folder of files grouped by basename (a.png + a.txt -> one sample)."""
    groups: dict[str, Sample] = {}
    root = folder.resolve()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if not path.resolve().is_relative_to(root):  # a link out of the folder
            raise InvalidSpec(
                f"source: {path} is a link to {path.resolve()}, outside {folder}; copy the"
                " file into the folder or remove the link."
            )
        relative = path.relative_to(folder).as_posix()
        stem, _, ext = relative.partition(".")
        if not ext:
            continue
        groups.setdefault(stem, {"__key__": stem.replace("/", "_")})[ext] = path.read_bytes()
    yield from (groups[k] for k in sorted(groups))


def synthetic_samples(
    kind: str, count: int, seed: int = 0, image_size: int = 32, classes: int = 10
) -> Iterator[Sample]:
    """Yield a learnable synthetic data set: 'classify' (PNG + class) or 'lm' (text)."""
    rng = random.Random(seed)
    if kind == "classify":
        import numpy as np
        from PIL import Image

        np_rng = np.random.default_rng(seed)
        for i in range(count):
            label = rng.randrange(classes)
            # Each class has its own colour; noise keeps it from being trivial.
            base = np.array(
                [(label * 37) % 256, (label * 91) % 256, (label * 53) % 256], dtype=np.float32
            )
            pixels = np.clip(
                base + np_rng.normal(0, 40, (image_size, image_size, 3)), 0, 255
            ).astype("uint8")
            png = io.BytesIO()
            Image.fromarray(pixels).save(png, format="PNG", optimize=False)
            meta = json.dumps({"index": i, "label": label}).encode()
            yield {
                "__key__": f"{i:08d}",
                "png": png.getvalue(),
                "cls": str(label).encode(),
                "json": meta,
            }
    elif kind == "lm":
        words = [
            "gpu",
            "flow",
            "train",
            "shard",
            "tensor",
            "spot",
            "node",
            "render",
            "frame",
            "rank",
        ]
        for i in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."
            yield {"__key__": f"{i:08d}", "txt": text.encode()}
    else:
        raise ValueError(f"unknown synthetic data set {kind!r}; use classify or lm")


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
