"""The wheel of the gpuflow that is running, built from its own files: what a machine
gpuflow starts (an EC2 instance) installs, so it runs the same code as the orchestrator
and never a package of that name from an index. The same files give the same bytes (fixed
order and dates), so its SHA-256 names the build."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import zipfile
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).parents[1]  # gpuflow/, as imported (its links followed below)
_EPOCH = (1980, 1, 1, 0, 0, 0)
_WHEEL = "Wheel-Version: 1.0\nGenerator: gpuflow\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _files(package: Path) -> list[tuple[str, Path]]:
    """Return (name in the wheel, file) for every file of the package, links followed,
    compiled files left out, in a fixed order."""
    found = []
    for folder, dirs, names in os.walk(package, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = Path(folder) / name
            found.append((f"gpuflow/{path.relative_to(package).as_posix()}", path))
    return sorted(found)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build() -> tuple[str, bytes]:
    """Return the wheel's file name and bytes."""
    dist = metadata.distribution("gpuflow")
    version = dist.version
    info = f"gpuflow-{version}.dist-info"
    entries: list[tuple[str, bytes]] = [(n, p.read_bytes()) for n, p in _files(PACKAGE)]
    meta = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""  # PKG-INFO: egg-info
    entries.append((f"{info}/METADATA", meta.encode()))
    entries.append((f"{info}/WHEEL", _WHEEL.encode()))
    points = dist.read_text("entry_points.txt")
    if points:
        entries.append((f"{info}/entry_points.txt", points.encode()))
    entries.append((f"{info}/top_level.txt", b"gpuflow\n"))
    record = "\n".join([*(_record_line(n, d) for n, d in entries), f"{info}/RECORD,,"]) + "\n"
    entries.append((f"{info}/RECORD", record.encode()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in entries:
            member = zipfile.ZipInfo(name, date_time=_EPOCH)
            member.external_attr = 0o644 << 16
            member.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(member, data)
    return f"gpuflow-{version}-py3-none-any.whl", out.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
