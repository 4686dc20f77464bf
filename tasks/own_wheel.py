"""The wheel of the gpuflow that is running, built from its own files: what a machine
gpuflow starts (an EC2 instance) installs, so it runs the same code as the orchestrator
and never a package of that name from an index. The same files give the same bytes (fixed
order and dates), so its SHA-256 names the build.

Also the library a job's image gets (`library`): that gpuflow and the packages its code on a
node imports (pydantic and the rest of NODE_DISTRIBUTIONS), copied from this interpreter's
own environment into one folder a container's python3 puts first on its path. Some of them
are compiled for this interpreter, so the library fits an image whose python3 has the same
ABI (its SOABI, `cpython-311-x86_64-linux-gnu`): `ABI`."""

from __future__ import annotations

import base64
import compileall
import hashlib
import io
import os
import shutil
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

from gpuflow.tasks.host import make_dirs

PACKAGE = Path(__file__).parents[1]  # gpuflow/, as imported (its links followed below)
_EPOCH = (1980, 1, 1, 0, 0, 0)
# what gpuflow's code on a node imports beyond the standard library (the trainer and its
# shard reader, the render and hpc launchers, the stream server); the job's own stack
# (torch, numpy) is the image's
NODE_DISTRIBUTIONS = (
    "pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
    "PyYAML", "regex", "psutil", "websockets", "webdataset", "braceexpand",
)  # fmt: skip
ABI = str(sysconfig.get_config_var("SOABI") or "")
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


def library(root: Path) -> Path:
    """Return the folder under `root` that holds this gpuflow and NODE_DISTRIBUTIONS as this
    interpreter has them (made once per build: later calls find it), compiled for this
    interpreter, so a unit starts quickly from a read-only mount. Its own files are
    readable by all (it holds nothing private): a container running as the image's user, a
    uid other than this one, reads it through its mount; `root`, made private where it is
    under GPUFLOW_HOME, keeps other local users out."""
    _, data = build()
    key = hashlib.sha256(f"{sha256(data)} {ABI}".encode()).hexdigest()[:20]
    folder = root / f"lib-{key}"
    if folder.is_dir():
        return folder
    make_dirs(root)  # under GPUFLOW_HOME: 0700, so the library's own 0755 reaches no one else
    work = root / f".lib-{key}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as wheel:
            wheel.extractall(work)
        for dist_name in NODE_DISTRIBUTIONS:
            try:
                dist = metadata.distribution(dist_name)
            except metadata.PackageNotFoundError:
                continue  # not here: nor is the code that imports it run here
            for file in dist.files or []:
                if file.parts[0] == ".." or "__pycache__" in file.parts:
                    continue  # its programs (bin/), and bytecode made again below
                target = work / file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(str(dist.locate_file(file)), target)
        compileall.compile_dir(work, quiet=2, workers=1)
        for folder_path, _dirs, files in os.walk(work):
            os.chmod(folder_path, 0o755)
            for file_name in files:
                os.chmod(os.path.join(folder_path, file_name), 0o644)
        try:
            os.rename(work, folder)
        except OSError:  # another process made it meanwhile
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder
